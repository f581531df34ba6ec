"""TensorRT plugins of ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify`` (``tensorrt.plugin``, >= 10.9).

Each op is a quickly-deployable Python plugin with three definitions (TensorRT's ``tensorrt.plugin``
module: ``register``, ``aot_impl``, ``impl``):

- ``register``: the output shapes and types, from ``registry.PLUGIN_SPECS`` (the same rules the
  lowering writes into the ONNX graph, tested equal to the ONNX schema and to ONNX shape inference);
  attributes = the plugin fields (``has_markov``, ``has_confidence``, ``block_v``, ``num_probes``), each
  annotated ``numpy.typing.NDArray[np.int32]``: the ONNX parser passes an INT attribute as a one-element
  INT32 field, and TensorRT's plugin creator converts a field with a numpy annotation by ``data.astype``
  but one with a builtin annotation by calling it on the array (``int(array([v]))``, a TypeError from
  NumPy 2.4 on); the definitions read each field with ``_field_value`` and check them (``check_fields``);
- ``aot_impl``: the Triton kernel compiled ahead of time (``tensorrt_kernels.compile_aot``: PTX for the
  building GPU's compute capability (``device_capability``), entry = inputs, int32 scalars, outputs), one
  program per request (grid_x = R), 32·num_warps threads, the kernel's shared memory, and the scalars as
  symbolic int32 expressions of the input shapes. The PTX is baked into the engine, so a serialized engine runs from
  C++ (``trtexec``, our C++ API) without Python; TensorRT does not serialize AOT attributes;
- ``impl``: the same kernel launched from Python through Triton's own launcher on TensorRT's stream
  (the just-in-time implementation, for a node without ``aot`` = 1).

The lowered graphs ask for the AOT implementation per node (attribute ``aot`` = 1; the builder passes no
network or parser flag for it, see ``engines/trt/builder.py``).

The AOT kernels are compiled for exactly one architecture (Triton's PTX for capability 90 targets
``sm_90a``, which no other GPU runs), so the capability is never guessed: ``device_capability()`` reads
the environment variable ``DSPARK_TRT_SM`` (e.g. ``90``) when set, else asks the current CUDA device
through torch or cuda-python, else raises BuildError.

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
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Tuple, Union

import numpy as np
import numpy.typing as npt

from dspark_export.errors import BuildError, PluginError
from dspark_export.plugins.common.tensorrt_spec import PluginSpec
from dspark_export.plugins.registry import PLUGIN_SPECS

log = logging.getLogger(__name__)

__all__ = ["register_plugins", "plugin_functions", "device_capability", "FieldArray", "SM_ENV"]

FieldArray = npt.NDArray[np.int32]
"""Annotation of every plugin field: a one-element INT32 array, as the ONNX parser passes an INT attribute
(the form NVIDIA's circular-padding AOT sample uses for its ``pads`` attribute)."""
SM_ENV = "DSPARK_TRT_SM"
"""Environment variable naming the compute capability × 10 to compile the AOT kernels for (e.g. ``90``)."""


def _field_value(name: str, value) -> int:
    """The integer a plugin field holds: a one-element (or 0-d) integer array, or an int.

    Raises:
        PluginError: anything else (names the field, expected vs found).
    """
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "iub":
        raise PluginError(f"plugin field {name!r}: expected one integer (a one-element INT32 field), found "
                          f"{arr.dtype} of shape {arr.shape}")
    return int(arr.reshape(-1)[0])


def _fields(op: str, raw: Mapping[str, object]) -> dict[str, int]:
    """The fields TensorRT passed (arrays), as checked ints (``PluginSpec.check_fields``)."""
    return PLUGIN_SPECS[op].check_fields({name: _field_value(name, value) for name, value in raw.items()})


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


def _aot(trt, trtp, op: str, inputs: Mapping[str, object], fields: Mapping[str, int],
         capability: int | Callable[[], int]):
    """(kernel name, PTX, launch params, extra args) of ``op`` for the given input descriptors."""
    if callable(capability):
        capability = capability()  # BuildError when it cannot be determined, before Triton is imported
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


def plugin_functions(trt, trtp, capability: int | Callable[[], int] | None = None) -> dict[str, dict[str, object]]:
    """The undecorated ``register`` / ``aot_impl`` / ``impl`` functions of both plugins, per op.

    Args:
        trt: the ``tensorrt`` module (for ``trt.int64`` / ``trt.float32``).
        trtp: the ``tensorrt.plugin`` module (for ``TensorDesc`` ... used in annotations and bodies).
        capability: CUDA compute capability × 10 the AOT kernels are compiled for, or a function returning
            it (called when ``aot_impl`` runs); None: ``device_capability`` then.
    Returns:
        {"MarkovDraft": {"register": f, "aot_impl": g, "impl": h}, "SpeculativeVerify": {...}}; parameter
        names and order follow ``tensorrt.plugin``: inputs (schema order), attributes (field order),
        then ``outputs, tactic`` (aot_impl) or ``outputs, stream`` (impl). Fields are annotated
        ``FieldArray`` (module docstring) and may be given as one-element arrays or ints.
    Raises (when called):
        PluginError: a field that is not one integer or is out of range (``PluginSpec.check_fields``).
    """
    TD, T, F = trtp.TensorDesc, trtp.Tensor, FieldArray
    if capability is None:
        capability = device_capability
    md, sv = PLUGIN_SPECS["MarkovDraft"], PLUGIN_SPECS["SpeculativeVerify"]

    def markov_draft_register(
        base_logits: TD, hidden: TD, anchor_ids: TD, temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        confidence_temperature: TD, markov_w1: TD, markov_w2: TD, confidence_weight: TD, confidence_bias: TD,
        has_markov: F, has_confidence: F, block_v: F, num_probes: F,
    ) -> Tuple[TD, TD, TD]:
        return _output_descs(trt, trtp, md, locals())

    def markov_draft_aot_impl(
        base_logits: TD, hidden: TD, anchor_ids: TD, temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        confidence_temperature: TD, markov_w1: TD, markov_w2: TD, confidence_weight: TD, confidence_bias: TD,
        has_markov: F, has_confidence: F, block_v: F, num_probes: F,
        outputs: Tuple[TD, TD, TD], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        inputs = dict(base_logits=base_logits, hidden=hidden, anchor_ids=anchor_ids, temperature=temperature,
                      top_k=top_k, top_p=top_p, uniforms=uniforms, confidence_temperature=confidence_temperature,
                      markov_w1=markov_w1, markov_w2=markov_w2, confidence_weight=confidence_weight,
                      confidence_bias=confidence_bias)
        fields = _fields("MarkovDraft", dict(has_markov=has_markov, has_confidence=has_confidence,
                                             block_v=block_v, num_probes=num_probes))
        return _aot(trt, trtp, "MarkovDraft", inputs, fields, capability)

    def markov_draft_impl(
        base_logits: T, hidden: T, anchor_ids: T, temperature: T, top_k: T, top_p: T, uniforms: T,
        confidence_temperature: T, markov_w1: T, markov_w2: T, confidence_weight: T, confidence_bias: T,
        has_markov: F, has_confidence: F, block_v: F, num_probes: F,
        outputs: Tuple[T, T, T], stream: int,
    ) -> None:
        inputs = dict(base_logits=base_logits, hidden=hidden, anchor_ids=anchor_ids, temperature=temperature,
                      top_k=top_k, top_p=top_p, uniforms=uniforms, confidence_temperature=confidence_temperature,
                      markov_w1=markov_w1, markov_w2=markov_w2, confidence_weight=confidence_weight,
                      confidence_bias=confidence_bias)
        fields = _fields("MarkovDraft", dict(has_markov=has_markov, has_confidence=has_confidence,
                                             block_v=block_v, num_probes=num_probes))
        _jit("MarkovDraft", inputs, fields, outputs, stream)

    def speculative_verify_register(
        target_logits: TD, query_start: TD, draft_ids: TD, draft_logits: TD, verify_lens: TD,
        temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        block_v: F, num_probes: F,
    ) -> Tuple[TD, TD]:
        return _output_descs(trt, trtp, sv, locals())

    def speculative_verify_aot_impl(
        target_logits: TD, query_start: TD, draft_ids: TD, draft_logits: TD, verify_lens: TD,
        temperature: TD, top_k: TD, top_p: TD, uniforms: TD,
        block_v: F, num_probes: F,
        outputs: Tuple[TD, TD], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        inputs = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids,
                      draft_logits=draft_logits, verify_lens=verify_lens, temperature=temperature, top_k=top_k,
                      top_p=top_p, uniforms=uniforms)
        fields = _fields("SpeculativeVerify", dict(block_v=block_v, num_probes=num_probes))
        return _aot(trt, trtp, "SpeculativeVerify", inputs, fields, capability)

    def speculative_verify_impl(
        target_logits: T, query_start: T, draft_ids: T, draft_logits: T, verify_lens: T,
        temperature: T, top_k: T, top_p: T, uniforms: T,
        block_v: F, num_probes: F,
        outputs: Tuple[T, T], stream: int,
    ) -> None:
        inputs = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids,
                      draft_logits=draft_logits, verify_lens=verify_lens, temperature=temperature, top_k=top_k,
                      top_p=top_p, uniforms=uniforms)
        _jit("SpeculativeVerify", inputs, _fields("SpeculativeVerify", dict(block_v=block_v, num_probes=num_probes)),
             outputs, stream)

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
        capability: compute capability × 10 to compile the AOT kernels for; default: ``device_capability()``,
            asked when TensorRT first calls an ``aot_impl`` (building an engine), so loading a built engine
            never needs it.
    Raises:
        BuildError: TensorRT does not import here, or is older than 10.9 (no ``tensorrt.plugin.aot_impl``).
    """
    from dspark_export.plugins.common.tensorrt_support import require_tensorrt

    require_tensorrt("registering the dspark TensorRT plugins")
    import tensorrt as trt
    import tensorrt.plugin as trtp

    for op, fns in plugin_functions(trt, trtp, capability).items():
        plugin_id = PLUGIN_SPECS[op].plugin_id
        trtp.register(plugin_id)(fns["register"])
        trtp.aot_impl(plugin_id)(fns["aot_impl"])
        trtp.impl(plugin_id)(fns["impl"])
        log.info("registered TensorRT plugin %s (AOT kernels for %s)", plugin_id,
                 f"sm_{capability}" if capability is not None else "the building GPU")
    return tuple(spec.plugin_id for spec in PLUGIN_SPECS.values())


def device_capability() -> int:
    """CUDA compute capability × 10 (e.g. 90 for H100/H200) to compile the AOT kernels for.

    In order: the environment variable ``DSPARK_TRT_SM`` (an explicit choice, e.g. building on one GPU for
    another of the same architecture); the current CUDA device through torch; through cuda-python (the CUDA
    runtime bindings TensorRT's own samples use). Never a default: a kernel compiled for the wrong
    architecture does not load (Triton's PTX for 90 targets ``sm_90a``).

    Raises:
        BuildError: ``DSPARK_TRT_SM`` is not an integer in [50, 200), or no probe found a CUDA device
            (the message lists what each probe said).
    """
    override = os.environ.get(SM_ENV, "").strip()
    if override:
        try:
            value = int(override)
        except ValueError:
            value = -1
        if not 50 <= value < 200:
            raise BuildError(f"{SM_ENV}: expected a CUDA compute capability × 10 such as 90 (H100/H200) or 89 "
                             f"(L4/L40), found {override!r}")
        return value
    tried = []
    for probe in (_torch_capability, _cuda_python_capability):
        found, why = probe()
        if found is not None:
            return found
        tried.append(why)
    raise BuildError("the GPU's compute capability could not be determined, and the TensorRT plugins' AOT kernels "
                     f"are compiled for exactly one architecture ({'; '.join(tried)}); run on the GPU the engines "
                     f"are for, or set {SM_ENV} (e.g. {SM_ENV}=90 for H100/H200)")


def _torch_capability() -> tuple[int | None, str]:
    try:
        import torch
    except ImportError as e:
        return None, f"torch: not importable ({e})"
    try:
        if not torch.cuda.is_available():
            return None, "torch: no CUDA device (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability()
    except (RuntimeError, AssertionError) as e:  # a CPU-only build raises AssertionError
        return None, f"torch: {e}"
    return 10 * int(major) + int(minor), "torch"


def _cuda_python_capability() -> tuple[int | None, str]:
    for name in ("cuda.bindings.runtime", "cuda.cudart"):  # cuda-python >= 12.6, and the older layout
        try:
            cudart = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        return None, "cuda-python: not installed"
    ok = cudart.cudaError_t.cudaSuccess
    err, device = cudart.cudaGetDevice()
    if err != ok:
        return None, f"cuda-python: cudaGetDevice failed ({err})"
    values = []
    for attr in (cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor,
                 cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor):
        err, value = cudart.cudaDeviceGetAttribute(attr, device)
        if err != ok:
            return None, f"cuda-python: cudaDeviceGetAttribute({attr}) failed ({err})"
        values.append(int(value))
    return 10 * values[0] + values[1], "cuda-python"
