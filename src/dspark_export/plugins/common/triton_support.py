"""Host-side support of the Triton fast paths of the ``dspark`` ops: the gate, the boundary checks, PTX.

``has_triton()`` is the single gate of the Triton kernels (STYLE B6): it says whether ``triton``
imports, and logs the reason once when it does not; callers then use the numpy reference or the ONNX
function instead. Nothing here imports triton or torch at module import, so the op registry can name
the kernels without loading either.

The kernels themselves live in ``plugins/<op>/triton_kernel.py`` and share the device-side warping
and sampling of ``triton_sampling.py``. Their wrappers check torch tensors against the op schema with
``shape_proxies`` (zero-copy numpy stand-ins with the tensors' shapes and dtypes, so no device copy
is made), and ``compile_ptx`` compiles a kernel ahead of time for a CUDA target with no GPU present
(the PTX a TensorRT ``aot_impl`` plugin would embed).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from dspark_export.errors import PluginError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"torch.float32": np.dtype(np.float32), "torch.int64": np.dtype(np.int64),
                 "torch.float64": np.dtype(np.float64), "torch.int32": np.dtype(np.int32)}


@functools.cache
def has_triton() -> bool:
    """Whether the Triton kernels can run (``triton`` imports); logs the reason once when not.

    This is the only fallback gate of the Triton fast paths: when it is False, use the op's numpy
    reference (``OpEntry.reference``) or its ONNX function. Install with ``pip install 'dspark-export[triton]'``.
    """
    try:
        import triton  # noqa: F401
    except ImportError as error:  # also covers a broken install (missing shared library)
        log.warning("Triton kernels of the dspark ops are disabled: cannot import triton (%s); "
                    "use the numpy reference or the ONNX function instead", error)
        return False
    return True


def require_triton(op: str) -> None:
    """Raise PluginError naming ``op`` unless ``has_triton()``."""
    if not has_triton():
        raise PluginError(f"{op}: the Triton kernel needs the triton package, which does not import here; "
                          "install dspark-export[triton] or use the numpy reference")


def shape_proxies(op: str, tensors: Mapping[str, torch.Tensor | None]) -> dict[str, np.ndarray | None]:
    """Zero-copy numpy stand-ins with each tensor's shape and dtype, for ``OpSchema.check_inputs``.

    Args:
        op: the op's qualified name, for messages.
        tensors: input name -> torch tensor or None (absent optional input).

    Returns:
        input name -> read-only numpy array of the same shape and dtype (all elements alias one zero),
        or None. A dtype numpy lacks (e.g. bfloat16) raises PluginError here, naming the input.
    """
    import torch

    proxies: dict[str, np.ndarray | None] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            proxies[name] = None
            continue
        if not isinstance(tensor, torch.Tensor):
            raise PluginError(f"{op} input {name!r}: expected a torch tensor, found {type(tensor).__name__}")
        dtype = _NUMPY_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise PluginError(f"{op} input {name!r}: expected float32 or int64, found shape "
                              f"{tuple(tensor.shape)} {tensor.dtype}")
        proxy = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=tuple(tensor.shape),
                                                strides=(0,) * tensor.dim(), writeable=False)
        proxies[name] = proxy
    return proxies


def host_values(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Host numpy copies of the (small) inputs ``names`` whose values the boundary checks read."""
    return {name: tensors[name].detach().cpu().numpy() for name in names}


def check_same_device(op: str, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Raise PluginError unless every present tensor lies on one device."""
    devices = {name: tensor.device for name, tensor in tensors.items() if tensor is not None}
    if len(set(devices.values())) > 1:
        found = {name: str(device) for name, device in devices.items()}
        raise PluginError(f"{op}: expected every input on one device, found {found}")


def check_blocks(op: str, block_v: int, num_probes: int) -> None:
    """block_v must be a power of two >= 16 and num_probes a power of two (``tl.arange`` needs powers of two)."""
    for name, value, least in (("block_v", block_v, 16), ("num_probes", num_probes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
            raise PluginError(f"{op}: {name} must be a power of two >= {least}, found {value!r}")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def compile_ptx(kernel, signature: Mapping[str, str], constexprs: Mapping[str, object], capability: int = 90) -> str:
    """PTX of ``kernel`` for CUDA compute capability ``capability``, compiled without a GPU or driver.

    Args:
        kernel: a ``@triton.jit`` function (not an interpreter-mode one: import the kernel module
            without ``TRITON_INTERPRET=1``).
        signature: argument name -> Triton type (``"*fp32"``, ``"i32"``, ``"constexpr"``, ...), every argument.
        constexprs: values of the ``constexpr`` arguments.
        capability: e.g. 90 for sm_90 (H100/H200).

    Returns:
        The PTX text (``.target sm_90a`` for capability 90: Triton targets the arch-specific variant).
    """
    require_triton("compile_ptx")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.JITFunction):
        raise PluginError(f"compile_ptx: expected a @triton.jit kernel, found {type(kernel).__name__} "
                          "(was the module imported with TRITON_INTERPRET=1?)")
    compiled = triton.compile(ASTSource(kernel, dict(signature), dict(constexprs)),
                              target=GPUTarget("cuda", capability, 32))
    return compiled.asm["ptx"]
