"""The ``dspark`` Triton kernels in TensorRT's launch order, compiled ahead of time for a plugin's ``aot_impl``.

A TensorRT ahead-of-time Python plugin returns (kernel name, PTX, launch parameters, extra scalar
arguments), and TensorRT launches the kernel with its arguments in this order: the plugin's input
pointers, then the extra scalar arguments (int32 symbolic expressions), then the output pointers
(NVIDIA's quickly-deployable-plugins sample, ``circ_pad_plugin_aot_impl``: signature ``*fp32, i32 x 13,
*fp32``; the ``tensorrt.plugin.aot_impl`` reference). The kernels of ``plugins/<op>/triton_kernel.py``
take outputs before scalars, so each op has a thin ``@triton.jit`` wrapper there (``<op>_trt_kernel``) that
takes TensorRT's order and calls the kernel (Triton inlines it: the same code, one entry point).

Triton 3.3+ appends two pointer parameters to every compiled kernel (global and profile scratch), which
the Triton launcher fills and TensorRT knows nothing of. ``compile_aot`` therefore compiles the wrapper,
checks the compiled kernel needs no scratch memory (size 0) and never reads those two parameters, and
removes them from the PTX entry, so the entry takes exactly inputs + scalars + outputs. The trimmed PTX
is assembled again with the ``ptxas`` Triton ships (``assemble``), which proves it is valid PTX for the
target without a GPU.

Importing this module imports triton and the kernel modules (not torch's CUDA, not tensorrt).
Dimension letters: R requests, γ draft slots, V vocab, H hidden size, r Markov rank.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import triton

from dspark_export.errors import PluginError
from dspark_export.plugins.common.triton_support import next_power_of_2
from dspark_export.plugins.markov_draft import tensorrt as markov_draft_trt
from dspark_export.plugins.markov_draft.tensorrt import PLUGIN_SCHEMA as MARKOV_DRAFT_SCHEMA
from dspark_export.plugins.markov_draft.triton_kernel import markov_draft_trt_kernel
from dspark_export.plugins.registry import PLUGIN_SPECS
from dspark_export.plugins.speculative_verify import tensorrt as verify_trt
from dspark_export.plugins.speculative_verify.schema import SCHEMA as VERIFY_SCHEMA
from dspark_export.plugins.speculative_verify.triton_kernel import speculative_verify_trt_kernel

__all__ = ["AotKernel", "SCALARS", "GRID_SOURCE", "compile_aot", "assemble", "entry_params", "launch_plan",
           "launch_trt_order", "markov_draft_trt_kernel", "speculative_verify_trt_kernel", "MAX_BLOCK_H"]

MAX_BLOCK_H = 256
"""Hidden-size block of MarkovDraft's confidence dot product (the kernel loops over H in such blocks)."""

#: per op, the int32 scalar arguments TensorRT passes between inputs and outputs, and where each comes from:
#: (input name, axis) of a plugin input's shape (``plugins/<op>/tensorrt.py``)
SCALARS: dict[str, tuple[tuple[str, tuple[str, int]], ...]] = {"MarkovDraft": markov_draft_trt.SCALARS,
                                                               "SpeculativeVerify": verify_trt.SCALARS}
#: per op, the plugin input whose axis 0 is the request count R (one program per request)
GRID_SOURCE = {"MarkovDraft": markov_draft_trt.GRID_SOURCE, "SpeculativeVerify": verify_trt.GRID_SOURCE}


_WRAPPERS = {"MarkovDraft": markov_draft_trt_kernel, "SpeculativeVerify": speculative_verify_trt_kernel}
_SCHEMAS = {"MarkovDraft": MARKOV_DRAFT_SCHEMA, "SpeculativeVerify": VERIFY_SCHEMA}


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """One compiled kernel as a TensorRT ahead-of-time plugin hands it over.

    Attributes:
        op: "MarkovDraft" or "SpeculativeVerify".
        name: the PTX entry name.
        ptx: the PTX text, entry trimmed to inputs + scalars + outputs (see the module docstring).
        num_warps: threads per program / 32 (the launch's block_x = 32 · num_warps).
        shared_mem: dynamic shared memory bytes per program.
        scalars: names of the int32 scalar arguments, in launch order, and their sources (``SCALARS``).
        constexprs: the compile-time constants the kernel was built with.
        num_params: parameters of the trimmed entry (= inputs + scalars + outputs).
    """

    op: str
    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    scalars: tuple[tuple[str, tuple[str, int]], ...]
    constexprs: Mapping[str, object]
    num_params: int

    @property
    def block_x(self) -> int:
        return 32 * self.num_warps


def _constexprs(op: str, fields: Mapping[str, int], static_dims: Mapping[str, int]) -> dict[str, object]:
    if op == "SpeculativeVerify":
        return {"BLOCK_V": fields["block_v"], "NUM_PROBES": fields["num_probes"]}
    has_markov, has_confidence = bool(fields["has_markov"]), bool(fields["has_confidence"])
    rank = static_dims.get("RANK") if has_markov else 0
    if has_markov and rank is None:
        raise PluginError("dspark::MarkovDraft: the Markov rank (axis 1 of markov_w1) must be known when the kernel "
                          "is compiled (it sizes BLOCK_R); found a dynamic dimension")
    hidden = static_dims.get("H")
    block_h = min(next_power_of_2(hidden), MAX_BLOCK_H) if hidden else MAX_BLOCK_H  # the kernel loops over H
    return {"HAS_MARKOV": has_markov, "HAS_CONFIDENCE": has_confidence, "BLOCK_V": fields["block_v"],
            "BLOCK_H": block_h, "BLOCK_R": next_power_of_2(rank or 1), "NUM_PROBES": fields["num_probes"]}


def _signature(op: str, constexprs: Mapping[str, object]) -> dict[str, str]:
    schema = _SCHEMAS[op]
    sig = {f"{s.name}_ptr": "*i64" if s.dtype.kind == "i" else "*fp32" for s in schema.inputs}
    sig.update({name: "i32" for name, _ in SCALARS[op]})
    sig.update({f"{s.name}_ptr": "*i64" if s.dtype.kind == "i" else "*fp32" for s in schema.outputs})
    sig.update({name: "constexpr" for name in constexprs})
    return sig


_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+[^,]*?\b(\w+_param_(\d+))\s*$")


def entry_params(ptx: str) -> tuple[str, list[str]]:
    """(entry name, parameter declarations) of the single ``.entry`` in ``ptx``.

    Raises:
        PluginError: no entry, or more than one.
    """
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise PluginError(f"expected one .entry in the PTX, found {len(entries)}")
    name, params = entries[0]
    return name, [p.strip() for p in params.split(",") if p.strip()]


def _trim_scratch(ptx: str, metadata, expected: int) -> tuple[str, int]:
    """Remove the trailing scratch parameters Triton adds, after checking the kernel never uses them."""
    name, params = entry_params(ptx)
    extra = len(params) - expected
    if extra < 0:
        raise PluginError(f"{name}: the PTX entry has {len(params)} parameters, fewer than the {expected} "
                          "inputs + scalars + outputs")
    for what in ("global_scratch_size", "profile_scratch_size"):
        if int(getattr(metadata, what, 0) or 0) != 0:
            raise PluginError(f"{name}: the compiled kernel needs {what} = {getattr(metadata, what)} bytes, which a "
                              "TensorRT plugin launch does not provide")
    body = ptx[ptx.index(")", ptx.index(".entry")) + 1:]
    for decl in params[expected:]:
        match = _PARAM.search(decl)
        if match is None:
            raise PluginError(f"{name}: unexpected parameter declaration {decl!r}")
        if re.search(rf"\b{match.group(1)}\b", body):
            raise PluginError(f"{name}: trailing parameter {match.group(1)} is read by the kernel; it cannot be "
                              "dropped")
    if extra == 0:
        return ptx, len(params)
    head_start = ptx.index("(", ptx.index(f".entry {name}")) + 1
    head_end = ptx.index(")", head_start)
    kept = ",\n\t".join(params[:expected])
    return ptx[:head_start] + "\n\t" + kept + "\n" + ptx[head_end:], expected


def compile_aot(op: str, fields: Mapping[str, int], static_dims: Mapping[str, int] | None = None,
                capability: int = 90) -> AotKernel:
    """Compile the TensorRT-order kernel of ``op`` for ``capability`` (e.g. 90 = sm_90a), without a GPU.

    Args:
        op: "MarkovDraft" or "SpeculativeVerify".
        fields: the plugin fields (``registry.PLUGIN_SPECS[op]``), e.g. {"block_v": 1024, ...}.
        static_dims: scalar values known at build time: "RANK" (required with Markov weights), "H" (sizes
            the hidden block; without it the widest block is used, correct for any H).
        capability: CUDA compute capability × 10 of the target GPU.
    Returns:
        AotKernel with the trimmed PTX.
    Raises:
        PluginError: unknown op, invalid fields, an unknown Markov rank, or a kernel that needs scratch memory.
    """
    if op not in _WRAPPERS:
        raise PluginError(f"no TensorRT kernel for op {op!r}; kernels exist for {sorted(_WRAPPERS)}")
    fields = PLUGIN_SPECS[op].check_fields(fields)
    constexprs = _constexprs(op, fields, dict(static_dims or {}))
    # TensorRT asks once per profile and tactic; the kernel depends only on these constants
    return _compile(op, tuple(constexprs.items()), capability)


@functools.lru_cache(maxsize=64)
def _compile(op: str, constexpr_items: tuple, capability: int) -> AotKernel:
    constexprs = dict(constexpr_items)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(_WRAPPERS[op], _signature(op, constexprs), constexprs),
                              target=GPUTarget("cuda", capability, 32))
    schema = _SCHEMAS[op]
    expected = len(schema.inputs) + len(SCALARS[op]) + len(schema.outputs)
    ptx, num_params = _trim_scratch(compiled.asm["ptx"], compiled.metadata, expected)
    return AotKernel(op, compiled.metadata.name, ptx, int(compiled.metadata.num_warps),
                     int(compiled.metadata.shared), SCALARS[op], constexprs, num_params)


def assemble(kernel: AotKernel, capability: int = 90) -> bytes:
    """Assemble ``kernel.ptx`` into a cubin with the ptxas Triton ships; raises PluginError if ptxas rejects it."""
    from triton import knobs

    ptxas = knobs.nvidia.ptxas.path
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(kernel.ptx)
        result = subprocess.run([ptxas, f"--gpu-name={arch}", str(src), "-o", str(out)], capture_output=True,
                                text=True, timeout=600)
        if result.returncode != 0:
            raise PluginError(f"{kernel.name}: ptxas rejected the trimmed PTX: {result.stderr.strip()[-2000:]}")
        return out.read_bytes()


def launch_plan(op: str, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """What a plugin launch computes from concrete input shapes: grid, scalar values, output shapes.

    The same sources ``aot_impl`` turns into symbolic expressions (``SCALARS``, ``GRID_SOURCE``, the
    output rules of ``registry.PLUGIN_SPECS``), evaluated on numbers.

    Args:
        op: "MarkovDraft" or "SpeculativeVerify".
        shapes: every plugin input (schema order; placeholders included) → its shape.
    Returns:
        {"grid": R, "scalars": {name: int}, "outputs": {name: shape}}.
    """
    def at(src: str, axis: int) -> int:
        return int(shapes[src][axis])

    return {"grid": at(*GRID_SOURCE[op]), "scalars": {name: at(*source) for name, source in SCALARS[op]},
            "outputs": {k: tuple(int(d) for d in v) for k, v in PLUGIN_SPECS[op].output_shapes(shapes).items()}}


def launch_trt_order(op: str, feeds: Mapping[str, "torch.Tensor"], fields: Mapping[str, int],
                     outputs: Mapping[str, "torch.Tensor"] | None = None) -> dict[str, "torch.Tensor"]:
    """Run the TensorRT-order kernel of ``op`` the way a plugin launch does, through Triton's launcher.

    Inputs are the plugin's (every schema input; an absent optional input becomes a one-element zero
    placeholder, as in the lowered graph), scalars come from ``launch_plan``, outputs are allocated from
    the output rules unless given. No value checks: this is the plugin's path, not the checked wrapper of
    ``triton_kernel.py``. Tensors on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.

    Returns:
        output name → tensor.
    """
    import torch

    spec = PLUGIN_SPECS[op]
    fields = spec.check_fields(fields)
    unknown = sorted(set(feeds) - set(spec.schema.input_names))
    if unknown:
        raise PluginError(f"{spec.plugin_id}: unknown inputs {unknown}")
    device = feeds[spec.schema.inputs[0].name].device
    tensors = {}
    for s in spec.schema.inputs:
        if s.name in feeds:
            tensors[s.name] = feeds[s.name].contiguous()
        elif s.name in spec.placeholders:
            tensors[s.name] = torch.zeros((1,) * spec.placeholders[s.name], dtype=torch.float32, device=device)
        else:
            raise PluginError(f"{spec.plugin_id}: required input {s.name!r} is missing")
    plan = launch_plan(op, {k: tuple(v.shape) for k, v in tensors.items()})
    dtypes = {rule.name: torch.int64 if rule.dtype.kind == "i" else torch.float32 for rule in spec.outputs}
    outs = dict(outputs) if outputs is not None else {
        name: torch.empty(shape, dtype=dtypes[name], device=device) for name, shape in plan["outputs"].items()}
    static = {"H": plan["scalars"].get("H"), "RANK": plan["scalars"].get("RANK")}
    constexprs = _constexprs(op, fields, {k: v for k, v in static.items() if v is not None})
    if plan["grid"] > 0:
        _WRAPPERS[op][(plan["grid"],)](*tensors.values(), *plan["scalars"].values(),
                                       *(outs[rule.name] for rule in spec.outputs), **constexprs)
    return outs
