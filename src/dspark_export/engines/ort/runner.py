"""ONNX Runtime backend: one session per (graph, bucket), all sessions sharing one copy of the weights.

An ORT engine is a canonical graph specialised to one bucket by a free-dimension override (the
target's N, the drafter block's R). The engine file (engines/onnxruntime/<graph>.<dim><bucket>.json)
records the graph, the overrides and the session settings; building it means creating that session.

Weights: every external initializer is memory-mapped once from the graph's .data file and handed
to each session with `SessionOptions.add_initializer`.

Prepacking (MLAS packs each constant MatMul weight into its GEMM layout once, at load):
- A prepacked session holds a private packed copy of its weights (a few hundred MB for a 135M target).
- Without it, every GEMM call with more than one row packs the weights again: all of the target's
  weights per target pass. One-row calls use GEMV and never pack. Prepacked multi-row passes ran
  about 2× faster on CPU (reports/measurement_history.md, "prepacked sessions").
- So the graphs in `PACKED_GRAPHS` (every bucket of the target, the drafter block and the drafter context)
  run on ONE shared session per graph (`SharedSession`), with prepacking on and no free-dimension override.
  Only one packed copy per graph is paid for. `verify` (no weights) keeps per-bucket sessions with
  prepacking off. Quantized weights need the packed session even for one row: MatMulNBits without its
  packed weights dequantizes them on every call (an int4 drafter context pass: 7.2 ms unpacked, 0.33 ms
  packed, in the loop).
- `EngineSet(prepack=False)` / `Runtime.open(..., prepack=False)` returns to per-bucket sessions, with prepacking off
  everywhere, for memory-tight hosts.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import uses_external_data

from ...errors import ConfigError, EngineDirError
from ...plugins import cpu_ops
from ..runner import EngineRunner
from ..manifest import EngineKey

log = logging.getLogger(__name__)

__all__ = ["WeightStore", "OrtRunner", "SharedSession", "engine_spec", "session_options", "PACKED_GRAPHS",
           "uses_shared_session", "use_shared_thread_pool", "shared_thread_pool", "base_session_options",
           "check_threads"]

_NP = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_}


class WeightStore:
    """Memory-maps the external initializers of graphs once and shares them as OrtValues by name.

    Two graphs that name an initializer alike (the drafter's frozen embedding/LM head is named
    after the target's when equal; see exporter/drafter.py) share one copy.
    """

    def __init__(self):
        self._values: dict[str, ort.OrtValue] = {}
        self._arrays: dict[str, np.ndarray] = {}  # keeps the memory maps alive
        self._by_graph: dict[Path, list[str]] = {}
        self._cpu_ops: dict[Path, frozenset[str]] = {}   # the dspark.cpu ops each graph uses (they need its library)

    def names_for(self, graph_path: Path) -> list[str]:
        graph_path = Path(graph_path).resolve()
        if graph_path not in self._by_graph:
            self._by_graph[graph_path] = self._map_graph(graph_path)
        return self._by_graph[graph_path]

    def uses_cpu_ops(self, graph_path: Path) -> bool:
        return bool(self.cpu_op_types(graph_path))

    def cpu_op_types(self, graph_path: Path) -> frozenset[str]:
        """The dspark.cpu op types the graph uses (`plugins.cpu_ops.cpu_op_types`), read once per graph."""
        self.names_for(graph_path)
        return self._cpu_ops[Path(graph_path).resolve()]

    def _map_graph(self, graph_path: Path) -> list[str]:
        try:
            model = onnx.load(str(graph_path), load_external_data=False)
        except Exception as e:  # onnx raises DecodeError/OSError/... for a damaged file
            raise EngineDirError(f"{graph_path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
        self._cpu_ops[graph_path] = cpu_ops.cpu_op_types(model)
        names = []
        for init in model.graph.initializer:
            if not uses_external_data(init):
                continue
            info = {e.key: e.value for e in init.external_data}
            location = info.get("location", "")
            if not location or Path(location).name != location or location in (".", ".."):
                raise EngineDirError(f"{graph_path}: weight {init.name!r} points to external data {location!r}; "
                                     "expected a file name in the graph's own folder")
            data_path = graph_path.parent / location
            if init.name not in self._values:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
                offset = int(info.get("offset", 0))
                shape = tuple(init.dims)
                need = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
                if not data_path.is_file() or data_path.stat().st_size < need:
                    raise EngineDirError(f"{data_path}: weight {init.name!r} needs {need} bytes, file is "
                                         f"{data_path.stat().st_size if data_path.is_file() else 'missing'}")
                arr = np.memmap(data_path, dtype=dtype, mode="r", offset=offset, shape=shape)
                self._arrays[init.name] = arr
                self._values[init.name] = ort.OrtValue.ortvalue_from_numpy(arr)
            names.append(init.name)
        return names

    def value(self, name: str) -> ort.OrtValue:
        return self._values[name]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


#: graphs small enough to run on the calling thread (no intra-op pool, nothing left spinning)
SINGLE_THREAD_GRAPHS = ("drafter_context", "verify")

#: graph → smallest bucket served by the graph's shared prepacked session (see the module docstring).
#: Every target bucket: even one-row passes ran faster on the packed weights (SmolLM2, quiet machine:
#: B=1 36.1 ms on its own unpacked session vs B=2 26.5 ms on the shared packed one).
PACKED_GRAPHS = {"target": 1, "drafter_block": 1, "drafter_context": 1}


def uses_shared_session(key: EngineKey, prepack: bool = True) -> bool:
    """Whether the engine `key` runs on its graph's shared prepacked session."""
    threshold = PACKED_GRAPHS.get(key.graph)
    return prepack and threshold is not None and key.bucket >= threshold


#: intra-op threads of this process's shared ORT pool (`use_shared_thread_pool`); None: every session has its own
_shared_pool_threads: int | None = None


def use_shared_thread_pool(threads: int = 0) -> None:
    """Run every ONNX Runtime session this process creates from now on on ONE intra-op pool of `threads` threads
    (0: ONNX Runtime's choice, the physical cores): ORT's global thread pool (`shared_thread_pool` says whether).

    Why: a step alternates engines (drafter block, target, drafter context), each with its own pool when
    sessions keep their own. Only the target's may spin (`thread_settings`), so every parallel section of the
    drafter block wakes a sleeping worker; on one shared spinning pool nothing is woken and nothing spins against
    anything else (reports/runtime_split/s34/).

    It is a process-wide choice: from then on ORT refuses any new session of the process that keeps threads of its
    own (sessions created before keep theirs), which is why the `dspark-export` command turns it on and the Python
    API leaves it to the embedding application. A second call changes nothing. If another caller of the process
    set ORT's global pool sizes first, ORT keeps theirs, and it does not always say so (1.32 raises only
    sometimes): `shared_thread_pool` then reports the size asked for, not the pool's.

    Raises:
        ConfigError: `threads` outside 0..4 × this machine's cores (nothing changed).
    """
    global _shared_pool_threads
    if _shared_pool_threads is None:
        check_threads(threads)
        try:
            ort.set_global_thread_pool_sizes(int(threads), 1)
        except Exception as e:   # ORT's Fail: the process's global pools exist already, made by another caller
            if "already been created" not in str(e):
                raise
            log.info("ONNX Runtime's global thread pool already exists; using it")
        _shared_pool_threads = int(threads)


def check_threads(threads) -> None:
    """Raise ConfigError unless `threads` is 0 (ONNX Runtime's choice) or 1..4 × this machine's cores."""
    limit = 4 * (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 0 <= threads <= limit:
        raise ConfigError(f"threads: expected 0 (ONNX Runtime's choice) or 1..{limit} (4 × this machine's "
                          f"{os.cpu_count()} cores), found {threads!r}")


def shared_thread_pool() -> int | None:
    """The shared pool's threads as requested (0: ORT's choice), or None when sessions keep their own pools."""
    return _shared_pool_threads


def base_session_options(threads: int = 0) -> ort.SessionOptions:
    """SessionOptions for any other ORT session of ours: on the shared pool when the process has one (ORT refuses
    a session with threads of its own then), else with `threads` intra-op threads (0: ORT's choice)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if _shared_pool_threads is not None:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = int(threads)
    return so


def thread_settings(graph: str, threads: int = 0) -> dict:
    """Intra-op threading per graph: {"intra_op_num_threads": n, "allow_spinning": bool}.

    Why: every ORT session owns an intra-op pool whose threads spin after each run. With ~28 bucket
    sessions alternating (drafter, target, verify) on 2 cores, idle pools spun against the busy one.
    So only the target keeps spinning threads (it dominates the step); the drafter block's pool does not
    spin; drafter_context and verify run on the calling thread (reports/measurement_history.md, "ORT thread
    pools"). These settings apply while sessions keep their own pools, the Python API's default; the
    `dspark-export` command runs every session on one process-wide pool instead (`use_shared_thread_pool`),
    which spares the drafter block its wake-ups.
    """
    if graph in SINGLE_THREAD_GRAPHS:
        return {"intra_op_num_threads": 1, "allow_spinning": False}
    return {"intra_op_num_threads": int(threads), "allow_spinning": graph == "target"}


def session_options(overrides: Mapping[str, int], threads: int = 0, graph: str = "target",
                    prepack: bool = False) -> ort.SessionOptions:
    settings = thread_settings(graph, threads)
    so = base_session_options(settings["intra_op_num_threads"])
    if _shared_pool_threads is None and not settings["allow_spinning"]:   # a shared pool's spinning is its own
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    for dim, value in overrides.items():
        so.add_free_dimension_override_by_name(dim, int(value))
    return so


def engine_spec(key: EngineKey, graph_rel: str) -> dict:
    """The JSON written to engines/onnxruntime/<key>.json (what the runtime does with prepacking on)."""
    shared = uses_shared_session(key)
    return {"key": key.to_dict(), "graph": graph_rel,
            "session": f"shared-prepacked:{key.graph}" if shared else "per-bucket",
            "free_dimension_overrides": {} if shared else {key.dim: key.bucket},
            "graph_optimization_level": "ORT_ENABLE_ALL",
            "session_config": {"session.disable_prepacking": "0" if shared else "1"},
            "threads": thread_settings(key.graph), "providers": ["CPUExecutionProvider"]}


class SharedSession:
    """One prepacked, shape-dynamic session of a graph, shared by the runners of its larger buckets.

    Created on first use, freed when the last runner using it deactivates.

    Args:
        graph_path (Path): the canonical graph.
        graph (str): its name (threading settings).
        weights (WeightStore): shared raw weights (the session adds its own packed copy).
        threads (int): intra-op threads; 0 = ORT's choice.
    """

    def __init__(self, graph_path: Path, graph: str, weights: "WeightStore", threads: int = 0):
        self.graph_path, self.graph, self.weights, self.threads = Path(graph_path), graph, weights, threads
        self.session: ort.InferenceSession | None = None
        self._users = 0

    def acquire(self) -> ort.InferenceSession:
        if self.session is None:
            self.session = _create_session(self.graph_path, session_options({}, self.threads, self.graph, prepack=True),
                                           self.weights, f"the shared prepacked {self.graph} session")
        self._users += 1
        return self.session

    def release(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0:
            self.session = None


def _create_session(graph_path: Path, so: ort.SessionOptions, weights: "WeightStore", what: str):
    for name in weights.names_for(graph_path):
        so.add_initializer(name, weights.value(name))
    if weights.uses_cpu_ops(graph_path):
        cpu_ops.register(so)
    try:
        return ort.InferenceSession(str(graph_path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... types
        raise EngineDirError(f"{graph_path}: ONNX Runtime could not load the graph for {what} "
                             f"({type(e).__name__}: {e})") from e


class OrtRunner(EngineRunner):
    """Runs one engine. A context manager: `activate` creates the session, `deactivate` frees it.

    Args:
        graph_path (Path): the canonical graph.
        key (EngineKey): which bucket this engine serves (its dim is fixed to key.bucket).
        weights (WeightStore): shared weights.
        threads (int): intra-op threads; 0 lets ORT choose (all cores). Defaults to 0.
        shared (SharedSession | None): run on this shared prepacked session instead of an own
            per-bucket one (the feed is still padded to the bucket by the runtime).
    """

    def __init__(self, graph_path: Path, key: EngineKey, weights: WeightStore, threads: int = 0,
                 shared: SharedSession | None = None):
        self.graph_path, self.key, self.weights, self.threads = Path(graph_path), key, weights, threads
        self.shared = shared
        self.session: ort.InferenceSession | None = None
        self.last_latency_ms = 0.0
        self._meta: dict[str, tuple[type, int]] = {}

    def activate(self) -> "OrtRunner":
        if self.session is None:
            if self.shared is not None:
                self.session = self.shared.acquire()
            else:
                self.session = _create_session(self.graph_path,
                                               session_options({self.key.dim: self.key.bucket}, self.threads,
                                                               self.key.graph),
                                               self.weights, f"engine {self.key.path}")
            self._meta = {i.name: (_NP[i.type], len(i.shape)) for i in self.session.get_inputs()}
            self._outputs = [o.name for o in self.session.get_outputs()]
        return self

    def padded_rows(self, rows: int) -> int:
        """On a shared session (no free-dimension override: any row count runs), `rows` itself (at least 1, at
        most the bucket): a 9-row verification runs 9 rows, not 16, and a 130-row prefill 130, not 256. Why:
        the int4 pass costs about linearly in rows (R = 4 requests at 200 cached keys: 7.0 ms for 8 rows, 7.8
        for 9, 11.9 for 16; reports/runtime_split/s41/), and padding rows are inert (engines.packing), so real
        rows' outputs do not change. A per-bucket session keeps its bucket."""
        bucket = super().padded_rows(rows)
        if self.shared is None:
            return bucket
        return min(bucket, max(int(rows), 1))

    def deactivate(self) -> None:
        if self.session is not None and self.shared is not None:
            self.shared.release()
        self.session = None

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the engine. Checks names, dtypes and ranks first; records `last_latency_ms`.

        Raises:
            RequestError: a missing/unexpected input, or a wrong dtype or rank.
        """
        if self.session is None:
            self.activate()
        self.check_feed(feed)
        t0 = time.perf_counter()
        values = self.session.run(self._outputs, dict(feed))
        self.last_latency_ms = (time.perf_counter() - t0) * 1e3
        return dict(zip(self._outputs, values))
