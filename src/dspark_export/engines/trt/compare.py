"""`dspark-export trt compare`: TensorRT engines against ONNX Runtime on the same inputs (Polygraphy Comparator).

For every (graph, bucket) TensorRT engine of a directory, one feed shaped as the runtime shapes it
(``engines/profiler.engine_feed``, greedy sampling, seeded values) runs through Polygraphy's
``OnnxrtRunner`` on the canonical graph (CPU, the reference the ONNX Runtime engines run) and through
Polygraphy's ``TrtRunner`` on the bucket's profile of the TensorRT plan; ``Comparator.compare_accuracy``
with ``SimpleCompareFunc(atol, rtol)`` decides per output (integer outputs such as draft ids and next
ids must match exactly: any difference is >= 1 > atol). NOT RUN on real hardware so far.

A drafter block with an int8 LM head is the exception: ONNX Runtime's engine quantizes each row of h,
TensorRT's lowered form multiplies fp32 h by the dequantized weights (``trt.lowering``), and the two
differ by ~0.3 on logits of magnitude ~15 (measured on SmolLM2's drafter). The reference for such a
graph is therefore the canonical graph with the same weight-only rewrite, run by ONNX Runtime at the
basic optimization level (the extended level fuses DequantizeLinear + MatMul back into a dynamically
quantized MatMul): `reference_session`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ...errors import BuildError
from ..manifest import Manifest
from . import require_tensorrt

log = logging.getLogger(__name__)

__all__ = ["compare_backends", "compare_runners", "reference_session"]


def reference_session(graph_path: Path, name: str) -> Callable:
    """The loader (a callable Polygraphy's ``OnnxrtRunner`` takes) of the ONNX Runtime reference for one
    canonical graph.

    A graph without an int8 LM head: the file itself, default optimizations. With one: the graph with
    its int8 heads rewritten as TensorRT's lowering rewrites them, from bytes, at ``ORT_ENABLE_BASIC``.
    Either way the session knows the dspark.cpu ops the graph uses (``plugins.cpu_ops``).
    """
    import onnx
    import onnxruntime as ort

    from ...plugins import cpu_ops
    from ..ort.runner import base_session_options
    from .lowering import lower_int8_heads

    header = onnx.load(str(graph_path), load_external_data=False)
    source, level = str(graph_path), ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if any("/lm_head_int8/" in n.name for n in header.graph.node):
        model = onnx.load(str(graph_path))
        lower_int8_heads(model.graph, name)
        source, level = model.SerializeToString(), ort.GraphOptimizationLevel.ORT_ENABLE_BASIC

    def load() -> ort.InferenceSession:
        so = base_session_options()
        so.graph_optimization_level = level
        cpu_ops.register_for(so, header)
        return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])

    return load


def compare_backends(engine_dir: Path, *, atol: float = 1e-3, rtol: float = 1e-3, context_len: int = 16,
                     graphs: tuple[str, ...] | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Compare every TensorRT engine of ``engine_dir`` with ONNX Runtime on one runtime-shaped feed each.

    Returns:
        {"rows": [{"graph", "bucket", "passed", "outputs": {name: {"max_abs", "max_rel"}}}], "passed": bool,
        "atol", "rtol"}.
    Raises:
        BuildError: TensorRT missing, or the directory has no TensorRT engines.
    """
    require_tensorrt("dspark-export trt compare")
    import json

    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.backend.trt import TrtRunner

    from ..profiler import engine_feed
    from .runner import PlanStore

    say = progress or (lambda msg: None)
    manifest = Manifest.load(Path(engine_dir), verify=True)
    keys = [k for k in manifest.engine_keys() if k.backend == "tensorrt" and (graphs is None or k.graph in graphs)]
    if not keys:
        raise BuildError(f"{engine_dir}: no TensorRT engines to compare; run `dspark-export trt build` first")
    store, rows, sessions = PlanStore(), [], {}
    for key in keys:
        spec = json.loads(manifest.path_of(key.path, "engines.path").read_text())
        feed = engine_feed(manifest.data["graphs"], key.graph, key.bucket, context_len)
        if key.graph not in sessions:  # the canonical graph (with its function bodies), dynamic shapes, CPU
            sessions[key.graph] = reference_session(manifest.graph_path(key.graph), key.graph)
        runners = [OnnxrtRunner(sessions[key.graph], name="onnxruntime"),
                   TrtRunner(store.engine(manifest.path_of(spec["plan"], "plan")), name="tensorrt",
                             optimization_profile=spec["profile_index"])]
        say(f"compare {key.graph} {key.dim}={key.bucket}")
        passed, outputs = compare_runners(runners, feed, atol=atol, rtol=rtol)
        rows.append({"graph": key.graph, "bucket": key.bucket, "passed": passed, "outputs": outputs})
    return {"rows": rows, "passed": all(r["passed"] for r in rows), "atol": atol, "rtol": rtol}


def compare_runners(runners: list, feed: dict, *, atol: float, rtol: float) -> tuple[bool, dict]:
    """Run two Polygraphy runners on ``feed`` and compare the second's outputs with the first's.

    Returns:
        (Polygraphy's verdict, {output: {"max_abs", "max_rel"}} of runner 2 against runner 1).
    """
    import numpy as np
    from polygraphy import comparator

    simple = getattr(comparator, "SimpleCompareFunc", None)  # CompareFunc.simple before Polygraphy 0.50
    compare_func = simple(atol=atol, rtol=rtol) if simple else comparator.CompareFunc.simple(atol=atol, rtol=rtol)
    results = comparator.Comparator.run(runners, data_loader=[feed])
    accuracy = comparator.Comparator.compare_accuracy(results, compare_func=compare_func)
    (ref_out,), (got_out,) = (iterations for _, iterations in results)
    outputs = {}
    for name, ref in ref_out.items():
        ref, got = np.asarray(ref), np.asarray(got_out[name])
        if got.shape != ref.shape:
            outputs[name] = {"max_abs": None, "max_rel": None, "shapes": [list(ref.shape), list(got.shape)]}
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        outputs[name] = {"max_abs": float(diff.max(initial=0.0)),
                         "max_rel": float((diff / (np.abs(ref.astype(np.float64)) + 1e-12)).max(initial=0.0))}
    return bool(accuracy), outputs
