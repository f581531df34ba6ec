"""TensorRT engine runner with the ONNX Runtime runner's interface (``engines/ort/runner.py: OrtRunner``).

One plan file per graph holds one optimization profile per bucket (``builder.py``), so the weights are
in memory once per graph, as ONNX Runtime's ``WeightStore`` keeps them once; each bucket's runner is an
execution context of the shared engine bound to its profile (Polygraphy ``TrtRunner(engine,
optimization_profile=i)``). Inputs and outputs are host numpy arrays (Polygraphy copies them to and
from the GPU); the runtime's KV cache is host-side, so every step copies the cache buffer in.
NOT RUN on real hardware (no TensorRT/GPU where this was written); ``scripts/gpu_check.sh`` runs it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from ...errors import EngineDirError, RequestError
from ..manifest import EngineKey
from ..runner import EngineRunner
from . import require_tensorrt

log = logging.getLogger(__name__)

__all__ = ["PlanStore", "TrtEngineRunner"]

_NP = {"FLOAT": np.float32, "INT64": np.int64, "BOOL": np.bool_, "INT32": np.int32}


class PlanStore:
    """Deserializes each plan file once (after registering our plugins) and shares the engine."""

    def __init__(self):
        self._engines: dict[Path, object] = {}

    def engine(self, plan: Path):
        plan = Path(plan).resolve()
        if plan not in self._engines:
            require_tensorrt(f"loading TensorRT engine {plan}")
            from polygraphy.backend.trt import EngineFromBytes

            from ...plugins.tensorrt_plugins import register_plugins

            register_plugins()
            try:
                self._engines[plan] = EngineFromBytes(plan.read_bytes())()
            except Exception as e:  # TensorRT raises its own error types (version, device, plugin mismatch)
                raise EngineDirError(f"{plan}: TensorRT could not deserialize the engine ({type(e).__name__}: {e}); "
                                     "rebuild it with `dspark-export trt build` on this GPU and TensorRT") from e
        return self._engines[plan]


class TrtEngineRunner(EngineRunner):
    """Runs one (graph, bucket) engine: a context of the graph's plan bound to the bucket's profile.

    Args:
        plan: the graph's plan file.
        profile_index: the bucket's optimization profile in that plan.
        key: which bucket this runner serves.
        store: shared deserialized engines.
    """

    def __init__(self, plan: Path, profile_index: int, key: EngineKey, store: PlanStore):
        self.plan, self.profile_index, self.key, self.store = Path(plan), int(profile_index), key, store
        self.last_latency_ms = 0.0
        self._runner = None
        self._meta: dict[str, tuple[type, int]] = {}

    def activate(self) -> "TrtEngineRunner":
        if self._runner is None:
            import tensorrt as trt
            from polygraphy.backend.trt import TrtRunner

            engine = self.store.engine(self.plan)
            runner = TrtRunner(engine, name=self.key.path, optimization_profile=self.profile_index)
            runner.activate()
            self._runner = runner
            meta = {}
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                    dtype = _NP.get(engine.get_tensor_dtype(name).name)
                    if dtype is None:
                        raise EngineDirError(f"{self.plan}: input {name!r} has type {engine.get_tensor_dtype(name)}, "
                                             "which the runtime does not feed")
                    meta[name] = (dtype, len(engine.get_tensor_shape(name)))
            self._meta = meta
        return self

    def deactivate(self) -> None:
        if self._runner is not None:
            self._runner.deactivate()
            self._runner = None

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the engine (same checks and errors as ``OrtRunner.infer``); records ``last_latency_ms``.

        Raises:
            RequestError: a missing/unexpected input, a wrong dtype or rank, or a shape outside the
                bucket's optimization profile (TensorRT refuses it).
        """
        if self._runner is None:
            self.activate()
        self.check_feed(feed)
        t0 = time.perf_counter()
        try:
            out = self._runner.infer({k: np.ascontiguousarray(v) for k, v in feed.items()}, check_inputs=True)
        except Exception as e:  # Polygraphy raises PolygraphyException for shapes outside the profile
            raise RequestError(f"engine {self.key.path}: TensorRT refused the feed ({type(e).__name__}: {e})") from e
        self.last_latency_ms = (time.perf_counter() - t0) * 1e3
        # Polygraphy's TrtRunner returns its own host output buffers and overwrites them on the next call
        # (np.asarray would not copy): return arrays the caller owns, as OrtRunner's are fresh per call.
        return {k: np.array(v, copy=True) for k, v in out.items()}
