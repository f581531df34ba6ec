"""TensorRT plugins of ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify`` (``tensorrt.plugin``, >= 10.8).

Each op is a quickly-deployable Python plugin with three definitions (TensorRT's ``tensorrt.plugin``
module: ``register``, ``aot_impl``, ``impl``):

- ``register``: the output shapes and types, from ``tensorrt_spec.PLUGIN_SPECS`` (the same rules the
  lowering writes into the ONNX graph, tested equal to the ONNX schema and to ONNX shape inference);
  attributes = the plugin fields (``has_markov``, ``has_confidence``, ``block_v``, ``num_probes``);
- ``aot_impl``: the Triton kernel compiled ahead of time (``tensorrt_kernels.compile_aot``: PTX for the
  building GPU's compute capability, entry = inputs, int32 scalars, outputs), one program per request
  (grid_x = R), 32·num_warps threads, the kernel's shared memory, and the scalars as symbolic int32
  expressions of the input shapes. The PTX is baked into the engine, so a serialized engine runs from
  C++ (``trtexec``, our C++ API) without Python; TensorRT does not serialize AOT attributes;
- ``impl``: the same kernel launched from Python through Triton's own launcher on TensorRT's stream
  (a just-in-time fallback for engines built with ``PREFER_JIT_PYTHON_PLUGINS``).

The lowered graphs ask for the AOT implementation (node attribute ``aot`` = 1).

``register_plugins()`` imports tensorrt (``engines/trt.require_tensorrt``) and defines both plugins once
per process; nothing imports tensorrt at module import. This module must not use
``from __future__ import annotations``: ``tensorrt.plugin`` reads the definitions' annotations as
classes when they are decorated.

NOT RUN: no part of this module has run against a real TensorRT (none can be installed on the machines
this project is built on, and none has a GPU). The tests hold the definitions to the documented
``tensorrt.plugin`` signatures and to the kernels' launch contract with a recording stand-in for the
``tensorrt.plugin`` API; ``scripts/gpu_check.sh`` builds and runs them where TensorRT and a GPU exist.
"""

import functools
import logging
from collections.abc import Mapping
from typing import Tuple, Union

from dspark_export.plugins.tensorrt_spec import PLUGIN_SPECS, PluginSpec

log = logging.getLogger(__name__)

__all__ = ["register_plugins", "plugin_functions"]


def _trt_dtype(trt, dtype):
    return trt.int64 if dtype.kind == "i" else trt.float32


def _output_descs(trt, trtp, spec: PluginSpec, inputs: Mapping[str, object]):
    """The outputs' TensorDescs: each axis is the shape expression of the input axis its rule names."""
    return tuple(trtp.from_shape_expr(tuple(inputs[src].shape_expr[axis] for src, axis in rule.dims),
                                      dtype=_trt_dtype(trt, rule.dtype))
                 for rule in spec.outputs)


def _static(expr) -> int | None:
    """The value of a build-time-constant shape expression, else None."""
    try:
        return int(expr.constant_value()) if (not expr.is_fake and expr.is_constant) else None
    except (RuntimeError, AttributeError):
        return None


def _aot(trt, trtp, op: str, inputs: Mapping[str, object], fields: Mapping[str, int], capability: int):
    """(kernel name, PTX, launch params, extra args) of ``op`` for the given input descriptors."""
    from dspark_export.plugins.tensorrt_kernels import GRID_SOURCE, SCALARS, compile_aot

    kernel_scalars = SCALARS[op]
    exprs = {name: inputs[src].shape_expr[axis] for name, (src, axis) in kernel_scalars}
    static = {name: _static(e) for name, e in exprs.items()}
    kernel = compile_aot(op, fields, {k: v for k, v in static.items() if v is not None}, capability)
    params = trtp.KernelLaunchParams()
    src, axis = GRID_SOURCE[op]
    params.grid_x = inputs[src].shape_expr[axis]  # one program per request
    params.block_x = kernel.block_x
    params.shared_mem = kernel.shared_mem
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(exprs[name]) for name, _ in kernel_scalars])
    return kernel.name, kernel.ptx, params, extra


def _jit(op: str, inputs: Mapping[str, object], fields: Mapping[str, int], outputs, stream: int) -> None:
    """Launch the TensorRT-order kernel through Triton's launcher on TensorRT's stream (``impl``)."""
    import torch

    from dspark_export.plugins.tensorrt_kernels import launch_trt_order

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        feeds = {name: torch.as_tensor(t, device="cuda") for name, t in inputs.items()}
        outs = {rule.name: torch.as_tensor(t, device="cuda") for rule, t in zip(PLUGIN_SPECS[op].outputs, outputs)}
        launch_trt_order(op, feeds, fields, outs)


def plugin_functions(trt, trtp, capability: int = 90) -> dict[str, dict[str, object]]:
    """The undecorated ``register`` / ``aot_impl`` / ``impl`` functions of both plugins, per op.

    Args:
        trt: the ``tensorrt`` module (for ``trt.int64`` / ``trt.float32``).
        trtp: the ``tensorrt.plugin`` module (for ``TensorDesc`` ... used in annotations and bodies).
        capability: CUDA compute capability × 10 the AOT kernels are compiled for.
    Returns:
        {"MarkovDraft": {"register": f, "aot_impl": g, "impl": h}, "SpeculativeVerify": {...}}; parameter
        names and order follow ``tensorrt.plugin``: inputs (schema order), attributes (field order),
        then ``outputs, tactic`` (aot_impl) or ``outputs, stream`` (impl).
    """
    TD, T = trtp.TensorDesc, trtp.Tensor
    md, sv = PLUGIN_SPECS["MarkovDraft"], PLUGIN_SPECS["SpeculativeVerify"]

    def markov_draft_register(
        base_logits: TD, hidden: TD, anchor_ids: TD, temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        confidence_temperature: TD, markov_w1: TD, markov_w2: TD, confidence_weight: TD, confidence_bias: TD,
        has_markov: int, has_confidence: int, block_v: int, num_probes: int,
    ) -> Tuple[TD, TD, TD]:
        return _output_descs(trt, trtp, md, locals())

    def markov_draft_aot_impl(
        base_logits: TD, hidden: TD, anchor_ids: TD, temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        confidence_temperature: TD, markov_w1: TD, markov_w2: TD, confidence_weight: TD, confidence_bias: TD,
        has_markov: int, has_confidence: int, block_v: int, num_probes: int,
        outputs: Tuple[TD, TD, TD], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        inputs = dict(base_logits=base_logits, hidden=hidden, anchor_ids=anchor_ids, temperature=temperature,
                      top_k=top_k, top_p=top_p, uniforms=uniforms, confidence_temperature=confidence_temperature,
                      markov_w1=markov_w1, markov_w2=markov_w2, confidence_weight=confidence_weight,
                      confidence_bias=confidence_bias)
        fields = dict(has_markov=has_markov, has_confidence=has_confidence, block_v=block_v, num_probes=num_probes)
        return _aot(trt, trtp, "MarkovDraft", inputs, fields, capability)

    def markov_draft_impl(
        base_logits: T, hidden: T, anchor_ids: T, temperature: T, top_k: T, top_p: T, uniforms: T,
        confidence_temperature: T, markov_w1: T, markov_w2: T, confidence_weight: T, confidence_bias: T,
        has_markov: int, has_confidence: int, block_v: int, num_probes: int,
        outputs: Tuple[T, T, T], stream: int,
    ) -> None:
        inputs = dict(base_logits=base_logits, hidden=hidden, anchor_ids=anchor_ids, temperature=temperature,
                      top_k=top_k, top_p=top_p, uniforms=uniforms, confidence_temperature=confidence_temperature,
                      markov_w1=markov_w1, markov_w2=markov_w2, confidence_weight=confidence_weight,
                      confidence_bias=confidence_bias)
        fields = dict(has_markov=has_markov, has_confidence=has_confidence, block_v=block_v, num_probes=num_probes)
        _jit("MarkovDraft", inputs, fields, outputs, stream)

    def speculative_verify_register(
        target_logits: TD, query_start: TD, draft_ids: TD, draft_logits: TD, verify_lens: TD,
        temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        block_v: int, num_probes: int,
    ) -> Tuple[TD, TD]:
        return _output_descs(trt, trtp, sv, locals())

    def speculative_verify_aot_impl(
        target_logits: TD, query_start: TD, draft_ids: TD, draft_logits: TD, verify_lens: TD,
        temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        block_v: int, num_probes: int,
        outputs: Tuple[TD, TD], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        inputs = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids,
                      draft_logits=draft_logits, verify_lens=verify_lens, temperature=temperature, top_k=top_k,
                      top_p=top_p, uniforms=uniforms)
        return _aot(trt, trtp, "SpeculativeVerify", inputs, dict(block_v=block_v, num_probes=num_probes),
                    capability)

    def speculative_verify_impl(
        target_logits: T, query_start: T, draft_ids: T, draft_logits: T, verify_lens: T,
        temperature: T, top_k: T, top_p: T, uniforms: T,
        block_v: int, num_probes: int,
        outputs: Tuple[T, T], stream: int,
    ) -> None:
        inputs = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids,
                      draft_logits=draft_logits, verify_lens=verify_lens, temperature=temperature, top_k=top_k,
                      top_p=top_p, uniforms=uniforms)
        _jit("SpeculativeVerify", inputs, dict(block_v=block_v, num_probes=num_probes), outputs, stream)

    return {
        "MarkovDraft": {"register": markov_draft_register, "aot_impl": markov_draft_aot_impl,
                        "impl": markov_draft_impl},
        "SpeculativeVerify": {"register": speculative_verify_register, "aot_impl": speculative_verify_aot_impl,
                              "impl": speculative_verify_impl},
    }


@functools.cache
def register_plugins(capability: int | None = None) -> tuple[str, ...]:
    """Define both plugins in TensorRT's plugin registry (once per process); returns their ids.

    Args:
        capability: compute capability × 10 to compile the AOT kernels for; default: the current CUDA
            device's (via torch), else 90.
    Raises:
        BuildError: TensorRT does not import here.
    """
    from dspark_export.engines.trt import require_tensorrt

    require_tensorrt("registering the dspark TensorRT plugins")
    import tensorrt as trt
    import tensorrt.plugin as trtp

    if capability is None:
        capability = _device_capability()
    for op, fns in plugin_functions(trt, trtp, capability).items():
        plugin_id = PLUGIN_SPECS[op].plugin_id
        trtp.register(plugin_id)(fns["register"])
        trtp.aot_impl(plugin_id)(fns["aot_impl"])
        trtp.impl(plugin_id)(fns["impl"])
        log.info("registered TensorRT plugin %s (AOT kernels for sm_%d)", plugin_id, capability)
    return tuple(spec.plugin_id for spec in PLUGIN_SPECS.values())


def _device_capability() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return 10 * major + minor
    except (ImportError, RuntimeError) as e:
        log.warning("could not read the CUDA device's compute capability (%s); compiling for sm_90", e)
    return 90
