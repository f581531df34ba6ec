"""The TensorRT backend: lowering of the canonical graphs, optimization profiles, engines, runner, comparison.

Everything that needs ``tensorrt`` imports it lazily behind ``has_tensorrt()`` / ``require_tensorrt()``
(``plugins/common/tensorrt_support.py``); the lowering (``lowering.py``), the operator table (``ops.py``) and
the optimization-profile shapes (``profiles.py``) are pure ONNX/Python and run (and are tested) without
TensorRT or a GPU.
"""

from __future__ import annotations

from ...plugins.common.tensorrt_support import has_tensorrt, require_tensorrt, tensorrt_unavailable_reason

__all__ = ["has_tensorrt", "require_tensorrt", "tensorrt_unavailable_reason"]
