"""All engines of an engine directory, loaded through its manifest (no globbing)."""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

from ..errors import EngineDirError, RequestError
from .manifest import EngineKey, Manifest
from .onnxruntime import OrtRunner, WeightStore

log = logging.getLogger(__name__)

__all__ = ["EngineSet"]


class EngineSet:
    """The runners of one engine directory, keyed by (graph, bucket), sharing one WeightStore.

    Args:
        manifest (Manifest): a loaded, verified manifest.
        threads (int): intra-op threads per session; 0 = ORT's choice. Defaults to 0.
    """

    def __init__(self, manifest: Manifest, threads: int = 0):
        self.manifest = manifest
        self.weights = WeightStore()
        self._runners: dict[tuple[str, int], OrtRunner] = {}
        for key in manifest.engine_keys():
            if key.backend != "onnxruntime":
                raise EngineDirError(f"{manifest.root}: engine {key.path}: backend {key.backend!r} is not "
                                     "available in this runtime (expected 'onnxruntime')")
            spec = json.loads(manifest.path_of(key.path, "engines.path").read_text())
            graph = manifest.path_of(spec["graph"], f"{key.path}: graph")
            self._runners[(key.graph, key.bucket)] = OrtRunner(graph, key, self.weights, threads)
        self._buckets = {}
        for graph, bucket in self._runners:
            self._buckets.setdefault(graph, []).append(bucket)
        for b in self._buckets.values():
            b.sort()
        self._latency_ms: dict[str, dict[int, float]] = {}
        self._load_profile_latencies()

    def _load_profile_latencies(self) -> None:
        """Median latency per bucket from profile/sps.json, when the directory has one."""
        rel = self.manifest.data.get("profile", {}).get("path")
        path = self.manifest.path_of(rel, "profile.path") if rel else None
        if path is None or not path.is_file():
            return
        try:
            sps = json.loads(path.read_text())
            self._latency_ms = {"target": {int(r["B"]): float(r["median_ms"]) for r in sps["target"]},
                                "drafter_block": {int(r["R"]): float(r["median_ms"]) for r in sps["drafter_block"]}}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise EngineDirError(f"{path}: unreadable throughput profile ({e!r})") from e

    @classmethod
    def open(cls, engine_dir: Path, verify: bool = True, threads: int = 0) -> "EngineSet":
        return cls(Manifest.load(Path(engine_dir), verify=verify), threads)

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

    def runner(self, graph: str, size: int) -> OrtRunner:
        return self._runners[(graph, self.bucket_for(graph, size))]

    def runner_exact(self, graph: str, bucket: int) -> OrtRunner:
        """The engine of exactly this bucket (the profiler times each one)."""
        return self._runners[(graph, bucket)]
