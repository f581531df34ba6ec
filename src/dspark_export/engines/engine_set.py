"""All engines of one backend of an engine directory, loaded through its manifest (no globbing).

An engine directory always has ONNX Runtime engines; `dspark-export trt build` adds TensorRT engines
(`engines/trt/`) and their own throughput profile. `EngineSet(manifest, backend=...)` picks one backend;
for "tensorrt" its `manifest` is a view whose `profile` entry is the TensorRT profile, so the runtime's
scheduler reads the SPS(B) of the engines it runs.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

from ..errors import EngineDirError, ProfileError, RequestError
from ..plugins import cpu_ops
from .manifest import Manifest
from .ort.runner import OrtRunner, SharedSession, WeightStore, uses_shared_session
from .sps import profile_path, read_sps

log = logging.getLogger(__name__)

__all__ = ["EngineSet"]


BACKENDS = ("onnxruntime", "tensorrt")


class EngineSet:
    """The runners of one backend of an engine directory, keyed by (graph, bucket), sharing their weights.

    Args:
        manifest (Manifest): a loaded, verified manifest.
        threads (int): intra-op threads per ONNX Runtime session; 0 = ORT's choice. Defaults to 0.
        backend (str): "onnxruntime" (default) or "tensorrt" (engines added by `dspark-export trt build`).
        prepack (bool): ONNX Runtime: run the larger buckets of the target and the drafter block on
            one shared prepacked session per graph (about 2× faster multi-row passes on CPU, one packed
            weight copy per graph; `engines/ort/runner.py`). False: per-bucket sessions, no packing.
    Raises:
        EngineDirError: an unknown backend, or one the directory has no engines for.
    """

    def __init__(self, manifest: Manifest, threads: int = 0, backend: str = "onnxruntime", prepack: bool = True):
        if backend not in BACKENDS:
            raise EngineDirError(f"backend: expected one of {list(BACKENDS)}, found {backend!r}")
        self.backend = backend
        self.manifest = manifest if backend == "onnxruntime" else _backend_view(manifest, backend)
        self.weights = WeightStore()
        self._runners: dict[tuple[str, int], object] = {}
        keys = [k for k in manifest.engine_keys() if k.backend == backend]
        if not keys:
            found = sorted({k.backend for k in manifest.engine_keys()})
            raise EngineDirError(f"{manifest.root}: no {backend} engines (the directory has {found}"
                                 + ("; add them with `dspark-export trt build`" if backend == "tensorrt" else "") + ")")
        plans = None
        shared: dict[str, SharedSession] = {}
        for key in keys:
            spec_path = manifest.path_of(key.path, "engines.path")
            try:
                spec = json.loads(spec_path.read_text())
                if not isinstance(spec, dict):
                    raise ValueError(f"expected a JSON object, found {type(spec).__name__}")
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise EngineDirError(f"{spec_path}: unreadable engine file ({type(e).__name__}: {e})") from e
            if backend == "onnxruntime":
                graph = manifest.path_of(spec["graph"], f"{key.path}: graph")
                session = None
                if uses_shared_session(key, prepack):
                    session = shared.setdefault(key.graph, SharedSession(graph, key.graph, self.weights, threads))
                self._runners[(key.graph, key.bucket)] = OrtRunner(graph, key, self.weights, threads, session)
            else:
                from .trt.runner import PlanStore, TrtEngineRunner

                plans = plans or PlanStore()
                plan = manifest.path_of(spec["plan"], f"{key.path}: plan")
                self._runners[(key.graph, key.bucket)] = TrtEngineRunner(plan, spec["profile_index"], key, plans)
        self._buckets = {}
        for graph, bucket in self._runners:
            self._buckets.setdefault(graph, []).append(bucket)
        for b in self._buckets.values():
            b.sort()
        self._latency_ms: dict[str, dict[int, float]] = {}
        self._load_profile_latencies()

    def _load_profile_latencies(self) -> None:  # reads self.manifest: the backend's own profile
        """Median latency per bucket from profile/sps.json, when the directory has one."""
        path = profile_path(self.manifest)
        if path is None or not path.is_file():
            return
        try:
            self._latency_ms = read_sps(path).latencies_ms()
        except ProfileError as e:
            raise EngineDirError(str(e)) from e

    @classmethod
    def open(cls, engine_dir: Path, verify: bool = True, threads: int = 0, backend: str = "onnxruntime",
             prepack: bool = True) -> "EngineSet":
        return cls(Manifest.load(Path(engine_dir), verify=verify), threads, backend, prepack)

    def device_info(self) -> dict:
        """What the engines run on, for profile/sps.json's `device` (backend, versions, providers or GPU)."""
        import platform

        info = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                "backend": self.backend}
        if self.backend == "onnxruntime":
            import onnxruntime as ort

            from .ort.runner import shared_thread_pool

            pool = shared_thread_pool()   # how the sessions were threaded: the drafter block's time depends on it
            info.update(onnxruntime=ort.__version__, providers=["CPUExecutionProvider"],
                        thread_pool="per-session" if pool is None else
                        f"shared ({'ORT default' if not pool else pool} thread{'' if pool == 1 else 's'})")
        else:
            import tensorrt as trt

            info.update(tensorrt=trt.__version__, providers=["TensorRT"],
                        gpu=self.manifest.data.get("backends", {}).get("tensorrt", {}).get("gpu"))
        return info

    def activate_all(self) -> "EngineSet":
        for runner in self._runners.values():
            runner.activate()
        return self

    def buckets(self, graph: str) -> list[int]:
        return list(self._buckets.get(graph, []))

    def bucket_for(self, graph: str, size: int) -> int:
        """The bucket that serves `size`: the smallest bucket ≥ size, or a larger one the profile
        measured as faster (real latency curves are staircases with the odd dip; `target` only, since
        the drafter block's R is also the KV slot count).

        Raises:
            RequestError: size exceeds the largest bucket.
        """
        buckets = self._buckets.get(graph)
        if not buckets:
            raise EngineDirError(f"{self.manifest.root}: no engines for graph {graph!r}")
        i = bisect.bisect_left(buckets, size)
        if i == len(buckets):
            raise RequestError(f"graph {graph!r}: size {size} exceeds the largest bucket {buckets[-1]}")
        latency = self._latency_ms.get(graph) if graph == "target" else None
        if latency and all(b in latency for b in buckets[i:]):
            return min(buckets[i:], key=lambda b: (latency[b], b))
        return buckets[i]

    def runs_exact_rows(self, graph: str) -> bool:
        """Whether `graph`'s engines run a feed's own row count rather than its bucket's (`OrtRunner.padded_rows`
        on a shared session): the policies then price a B between buckets by interpolation
        (`ThroughputProfile.exact_rows`)."""
        b = self._buckets.get(graph)
        return bool(b) and b[-1] > 1 and self.runner_exact(graph, b[-1]).padded_rows(b[-1] - 1) < b[-1]

    def ragged_attention(self, graph: str) -> bool:
        """Whether `graph`'s attention is `dspark.cpu::RaggedAttention` (ONNX Runtime engines of a graph built
        with `build --attention-kernel cpu`): it reads each request's live cache entries and its own packed rows
        in place, so a pass costs nothing for query padding and needs no cache room past the longest slot. Why
        the runtime asks: the ONNX-op attention pads every request's query to the longest ([R, Q]) and writes
        new keys into the cache buffer, which `EngineStages.split_passes` and `KVCache.feed(width=...)` work
        around; with this kernel those workarounds only cost (extra passes, cache growth)."""
        if self.backend != "onnxruntime" or not self._buckets.get(graph):
            return False
        runner = self._runners[(graph, self._buckets[graph][0])]
        return cpu_ops.RAGGED_ATTENTION in self.weights.cpu_op_types(runner.graph_path)

    def runner(self, graph: str, size: int) -> OrtRunner:
        return self._runners[(graph, self.bucket_for(graph, size))]

    def runner_exact(self, graph: str, bucket: int) -> OrtRunner:
        """The engine of exactly this bucket (the profiler times each one)."""
        return self._runners[(graph, bucket)]


def _backend_view(manifest: Manifest, backend: str) -> Manifest:
    """A manifest view for `backend`: `profile` is that backend's profile entry (or absent)."""
    entry = manifest.data.get("backends", {}).get(backend, {})
    data = dict(manifest.data)
    if entry.get("profile"):
        data["profile"] = entry["profile"]
    else:
        data.pop("profile", None)
    return Manifest(manifest.root, data)
