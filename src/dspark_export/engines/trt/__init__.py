"""The TensorRT backend: lowering of the canonical graphs, optimization profiles, engines, runner, comparison.

Everything that needs ``tensorrt`` imports it lazily behind ``has_tensorrt()`` / ``require_tensorrt()``;
the lowering (``lowering.py``) and the optimization-profile shapes (``profiles.py``) are pure ONNX/Python
and run (and are tested) without TensorRT or a GPU.
"""

from __future__ import annotations

import functools
import logging

from ...errors import BuildError

log = logging.getLogger(__name__)

__all__ = ["has_tensorrt", "require_tensorrt", "tensorrt_unavailable_reason"]


@functools.cache
def tensorrt_unavailable_reason() -> str | None:
    """None when ``tensorrt`` imports and has a builder API, else why not (one line)."""
    try:
        import tensorrt as trt
    except ImportError as e:  # also a bindings wheel whose libnvinfer / libnvonnxparser is missing
        return f"cannot import tensorrt ({e})"
    except OSError as e:
        return f"cannot load the TensorRT libraries ({e})"
    if not hasattr(trt, "Builder"):
        return f"the tensorrt module at {getattr(trt, '__file__', '?')} has no Builder (not the TensorRT bindings)"
    return None


def has_tensorrt() -> bool:
    """Whether TensorRT imports here (logs the reason once when not). A GPU is still needed to build."""
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        log.info("TensorRT backend unavailable: %s", reason)
    return reason is None


def require_tensorrt(what: str) -> None:
    """Raise BuildError naming ``what`` unless TensorRT imports."""
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise BuildError(f"{what} needs TensorRT >= 10.8 with its Python bindings and libraries (install the "
                         f"NVIDIA wheels or container; `pip install 'dspark-export[tensorrt]'`): {reason}")
