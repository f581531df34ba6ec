"""`dspark-export trt plan | build`: TensorRT engines for an existing engine directory, through Polygraphy.

Per graph: the lowered graph (``lowering.py``) is written beside the canonical one as
``graphs/<graph>.trt.onnx`` (it shares the canonical graph's external data file), parsed into a strongly
typed network (types come from the graph; TensorRT 11 has no other mode), and built into ONE plan file
``engines/tensorrt/<graph>.plan`` with one optimization profile per bucket (``profiles.py``), so the
weights are stored and loaded once per graph. Each bucket gets ``engines/tensorrt/<graph>.<dim><b>.json``
(plan, profile index, the profile's shapes, versions), listed in the manifest's ``engines`` with backend
"tensorrt". Then the same profiler as ONNX Runtime's (``engines/profiler.py``) times the TensorRT
engines into ``profile/tensorrt/sps.json`` (same format), recorded under ``manifest.backends.tensorrt``,
and the manifest is re-sealed (new files listed with size and sha256; the ONNX Runtime engines and
profile stay as they were).

``plan_build`` is the part that needs no TensorRT: the lowering and every profile, checked; ``trt plan``
prints it. ``build_trt_engines`` needs TensorRT >= 10.9 and a GPU. NOT RUN on real hardware so far.

The AOT implementation is chosen per plugin node by the node attribute ``aot`` = 1 the lowering writes (a
node-level choice overrides any network-level preference), so the build passes no flags of its own to the
ONNX parser: Polygraphy's ``NetworkFromOnnxPath(flags=...)`` takes ``trt.OnnxParserFlag`` values (it ORs
``1 << int(flag)`` into ``parser.flags``), and a ``NetworkDefinitionCreationFlag`` passed there turns on an
unrelated parser flag of the same number (``PREFER_AOT_PYTHON_PLUGINS`` = 3 is ``ENABLE_PLUGIN_OVERRIDE`` in
10.15/10.16, which lets a loaded plugin named like an ONNX op type replace that op, i.e. sends our Split
nodes to TensorRT's own "Split" plugin; in 11.x it is 2, ``REPORT_CAPABILITY_DLA``, which needs a DLA
builder config).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ...errors import BuildError, ProfileError
from ..manifest import EngineKey, Manifest, write_json_atomic
from ..sps import write_sps
from . import require_tensorrt
from .lowering import LOWERED_SUFFIX, lower_model
from .profiles import ShapeProfile, profile_for

log = logging.getLogger(__name__)

__all__ = ["TrtBuildConfig", "plan_build", "build_trt_engines", "TRT_DIR", "TRT_PROFILE"]

TRT_DIR = "engines/tensorrt"
TRT_PROFILE = "profile/tensorrt/sps.json"
GRAPHS = ("target", "drafter_context", "drafter_block", "verify")

Progress = Callable[[str], None]


@dataclass
class TrtBuildConfig:
    """Settings of a TensorRT build.

    Attributes:
        engine_dir: an engine directory made by `dspark-export build`.
        context_len: past length the profiles' opt points and the SPS profile use (tokens).
        repeats: timed runs per bucket when profiling.
        builder_optimization_level: TensorRT builder optimization level (0-5; 3 is TensorRT's default).
        fields: per op type, plugin field overrides (``block_v``, ``num_probes``).
        overwrite: replace TensorRT engines already in the directory.
    """

    engine_dir: Path
    context_len: int = 128
    repeats: int = 10
    builder_optimization_level: int = 3
    fields: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    overwrite: bool = False


def _buckets(manifest: Manifest) -> dict[str, list[EngineKey]]:
    out: dict[str, list[EngineKey]] = {}
    for key in manifest.engine_keys():
        if key.backend == "onnxruntime":
            out.setdefault(key.graph, []).append(key)
    for keys in out.values():
        keys.sort(key=lambda k: k.bucket)
    return out


def plan_build(manifest: Manifest, context_len: int = 128,
               fields: Mapping[str, Mapping[str, int]] | None = None) -> dict:
    """What a TensorRT build of ``manifest``'s directory would do, checked, without TensorRT.

    Returns:
        {"graphs": {graph: {"lowering": LoweredGraph.summary(), "model": ModelProto (lowered),
        "profiles": [ShapeProfile per bucket, in bucket order], "keys": [EngineKey ...]}}}.
    Raises:
        BuildError: a graph that does not lower, or a profile that is inconsistent.
        ProfileError: a context length the directory's engines cannot serve.
    """
    runtime = manifest.runtime
    block, max_context = runtime["block_size"], runtime["max_context"]
    if not 1 <= context_len <= max_context - block - 1:
        raise ProfileError(f"context_len: expected a past length in [1, {max_context - block - 1}] tokens "
                           f"(max_context {max_context} minus one verification), found {context_len}")
    by_graph = _buckets(manifest)
    max_requests = max(k.bucket for k in by_graph["drafter_block"])
    out = {}
    for graph in GRAPHS:
        model = onnx.load(str(manifest.graph_path(graph)), load_external_data=False)
        lowered = lower_model(model, graph, fields=fields)
        profiles = [profile_for(lowered.model, graph, key.bucket, block_size=block, max_context=max_context,
                                max_requests=max_requests, context_len=context_len,
                                fixed={"V": int(runtime["vocab_size"])})
                    for key in by_graph[graph]]
        out[graph] = {"lowering": lowered.summary(), "model": lowered.model, "profiles": profiles,
                      "keys": [EngineKey(k.graph, "tensorrt", k.dim, k.bucket) for k in by_graph[graph]]}
    return {"graphs": out}


def _spec(key: EngineKey, graph_rel: str, plan_rel: str, index: int, profile: ShapeProfile, versions: dict) -> dict:
    return {"key": key.to_dict(), "graph": graph_rel, "plan": plan_rel, "profile_index": index,
            "profile": profile.to_dict(), "strongly_typed": True, "versions": versions}


def build_trt_engines(cfg: TrtBuildConfig, progress: Progress | None = None) -> dict:
    """Lower, build, profile and record TensorRT engines in ``cfg.engine_dir`` (see the module docstring).

    Returns:
        the TensorRT sps.json object.
    Raises:
        BuildError: TensorRT missing or older than 10.9, engines already present without ``overwrite``, the
            GPU's compute capability unknown (``tensorrt_plugins.device_capability``; nothing written), a
            graph that does not lower or parse, or a failed engine build (the files written so far are removed).
        EngineDirError: the directory is incomplete or altered (checked before anything is written).
    """
    require_tensorrt("dspark-export trt build")
    import tensorrt as trt
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath

    from ...plugins.tensorrt_plugins import device_capability, register_plugins
    from ..engine_set import EngineSet
    from ..profiler import measure_profile

    say = progress or (lambda msg: None)
    root = Path(cfg.engine_dir)
    manifest = Manifest.load(root, verify=True)
    existing = [k for k in manifest.engine_keys() if k.backend == "tensorrt"]
    if existing and not cfg.overwrite:
        raise BuildError(f"{root}: already has {len(existing)} TensorRT engines; pass --overwrite to rebuild them")
    plan = plan_build(manifest, cfg.context_len, cfg.fields)
    capability = device_capability()  # before anything is written: the AOT kernels are compiled for this GPU
    register_plugins()
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    versions = {"tensorrt": trt.__version__, "gpu": gpu, "sm": capability}
    written: list[str] = []
    trt_dir = root / TRT_DIR
    if existing:  # unlist the old TensorRT files first, so a failed rebuild leaves a valid ONNX Runtime directory
        _drop_tensorrt(manifest)
        if trt_dir.exists():
            shutil.rmtree(trt_dir)
    try:
        trt_dir.mkdir(parents=True, exist_ok=True)
        entries = []
        for graph, item in plan["graphs"].items():
            graph_rel = manifest.data["graphs"][graph]["path"].removesuffix(".onnx") + LOWERED_SUFFIX
            onnx.save(item["model"], str(root / graph_rel))
            written.append(graph_rel)
            plan_rel = f"{TRT_DIR}/{graph}.plan"
            say(f"TensorRT {graph}: {len(item['profiles'])} profiles (buckets "
                f"{[p.bucket for p in item['profiles']]})")
            t0 = time.perf_counter()
            # no parser flags: `aot` = 1 on each plugin node picks the AOT implementation (module docstring)
            network = NetworkFromOnnxPath(str(root / graph_rel), strongly_typed=True)
            config = CreateConfig(profiles=[p.polygraphy() for p in item["profiles"]],
                                  builder_optimization_level=cfg.builder_optimization_level)
            try:
                engine_bytes = EngineBytesFromNetwork(network, config=config)()
            except Exception as e:  # Polygraphy/TensorRT raise their own types
                raise BuildError(f"{root / graph_rel}: TensorRT engine build failed ({type(e).__name__}: {e})") from e
            (root / plan_rel).write_bytes(bytes(engine_bytes))
            written.append(plan_rel)
            say(f"TensorRT {graph}: built in {time.perf_counter() - t0:.1f} s")
            for index, (key, profile) in enumerate(zip(item["keys"], item["profiles"])):
                write_json_atomic(root / key.path, _spec(key, graph_rel, plan_rel, index, profile, versions))
                written.append(key.path)
                entries.append({"key": key.to_dict(), "path": key.path})
        manifest.data["engines"] = [e for e in manifest.data["engines"]
                                    if e["key"]["backend"] != "tensorrt"] + entries
        manifest.data.setdefault("backends", {})["tensorrt"] = {
            "graphs": {g: manifest.data["graphs"][g]["path"].removesuffix(".onnx") + LOWERED_SUFFIX for g in GRAPHS},
            "lowering": {g: item["lowering"] for g, item in plan["graphs"].items()},
            "versions": versions, "gpu": gpu}
        manifest.record_files(written)
        engines = EngineSet(manifest, backend="tensorrt")
        sps = measure_profile(engines, cfg.context_len, repeats=cfg.repeats, progress=say)
        del engines
        (root / TRT_PROFILE).parent.mkdir(parents=True, exist_ok=True)
        write_sps(root / TRT_PROFILE, sps)
        written.append(TRT_PROFILE)
        manifest.data["backends"]["tensorrt"]["profile"] = {"path": TRT_PROFILE, "context_len": cfg.context_len,
                                                            "warnings": sps["warnings"]}
        manifest.record_files(written)
        manifest.save()
        return sps
    except BaseException:
        for rel in written:
            (root / rel).unlink(missing_ok=True)
        raise


def _drop_tensorrt(manifest: Manifest) -> None:
    """Remove every TensorRT engine, lowered graph and profile from the manifest (saved), then the files."""
    root = manifest.root
    rels = [rel for rel in manifest.data["files"]
            if rel.startswith((TRT_DIR + "/", "profile/tensorrt/")) or rel.endswith(LOWERED_SUFFIX)]
    manifest.data["engines"] = [e for e in manifest.data["engines"] if e["key"]["backend"] != "tensorrt"]
    manifest.data.get("backends", {}).pop("tensorrt", None)
    for rel in rels:
        manifest.data["files"].pop(rel)
    manifest.save()
    for rel in rels:
        (root / rel).unlink(missing_ok=True)


def plan_summary(plan: dict) -> dict:
    """The JSON-able part of ``plan_build``'s result (no models)."""
    return {"graphs": {g: {"lowering": item["lowering"], "profiles": [p.to_dict() for p in item["profiles"]]}
                       for g, item in plan["graphs"].items()}}


def _dump(plan: dict) -> str:
    return json.dumps(plan_summary(plan))
