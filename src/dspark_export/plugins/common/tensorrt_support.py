"""The TensorRT gate: whether a TensorRT with ahead-of-time Python plugins imports here (``has_tensorrt``,
``require_tensorrt``). The plugins and the TensorRT backend (``engines/trt/``) import ``tensorrt`` only
behind it, lazily, so everything else runs (and is tested) without TensorRT or a GPU.
"""

from __future__ import annotations

import functools
import logging

from dspark_export.errors import BuildError

log = logging.getLogger(__name__)

__all__ = ["has_tensorrt", "require_tensorrt", "tensorrt_unavailable_reason"]


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a ``tensorrt.__version__`` string such as "10.9.0.34", else None."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


@functools.cache
def tensorrt_unavailable_reason() -> str | None:
    """None when ``tensorrt`` imports, has a builder API and ahead-of-time Python plugins, else why not (one line).

    Ahead-of-time Python plugins (``tensorrt.plugin.aot_impl``, ``KernelLaunchParams``, ``SymInt32``) arrived in
    TensorRT 10.9 (its release notes; CHANGELOG 10.9 "Added support for Python AOT plugins"), and our plugins
    are defined through them, so an older TensorRT is reported as unavailable, not left to fail later.
    """
    from dspark_export.plugins.common.tensorrt_spec import MIN_TRT_VERSION

    try:
        import tensorrt as trt
    except ImportError as e:  # also a bindings wheel whose libnvinfer / libnvonnxparser is missing
        return f"cannot import tensorrt ({e})"
    except OSError as e:
        return f"cannot load the TensorRT libraries ({e})"
    if not hasattr(trt, "Builder"):
        return f"the tensorrt module at {getattr(trt, '__file__', '?')} has no Builder (not the TensorRT bindings)"
    version = str(getattr(trt, "__version__", "?"))
    floor = ".".join(map(str, MIN_TRT_VERSION))
    release = _release(version)
    if release is not None and release < MIN_TRT_VERSION:
        return f"TensorRT {version} is older than {floor} (the first release with ahead-of-time Python plugins)"
    try:
        import tensorrt.plugin as trtp
    except ImportError as e:
        return f"TensorRT {version} has no tensorrt.plugin module ({e}); the plugins need TensorRT >= {floor}"
    missing = [name for name in ("aot_impl", "KernelLaunchParams", "SymInt32") if not hasattr(trtp, name)]
    if missing:
        return (f"TensorRT {version}: tensorrt.plugin has no {', '.join(missing)} (ahead-of-time Python plugins "
                f"arrived in TensorRT {floor})")
    return None


def has_tensorrt() -> bool:
    """Whether a TensorRT with ahead-of-time Python plugins imports here (logs the reason once when not).

    A GPU is still needed to build."""
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        log.info("TensorRT backend unavailable: %s", reason)
    return reason is None


def require_tensorrt(what: str) -> None:
    """Raise BuildError naming ``what`` unless a TensorRT >= 10.9 (with ``tensorrt.plugin.aot_impl``) imports."""
    from dspark_export.plugins.common.tensorrt_spec import MIN_TRT_VERSION

    reason = tensorrt_unavailable_reason()
    if reason is not None:
        floor = ".".join(map(str, MIN_TRT_VERSION))
        raise BuildError(f"{what} needs TensorRT >= {floor} with its Python bindings and libraries (install the "
                         f"NVIDIA wheels or container; `pip install 'dspark-export[tensorrt]'`): {reason}")
