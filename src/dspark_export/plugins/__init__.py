"""The ``dspark`` custom ops: ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify`` (version 1).

One folder per op holds every form of it: its contract (``schema.py``, the single source of truth), its
numpy reference (``reference.py``, the spec), its ONNX function of standard ops (``onnx_function.py``, so
ONNX Runtime runs it with no custom-op library), its Triton kernel (``triton_kernel.py``, the fast path,
optional behind ``common.triton_support.has_triton()``; also its TensorRT-order entry) and its TensorRT
plugin form (``tensorrt.py``, data). ``common/`` holds what both ops share and imports no op folder.
The modules here gather the ops: ``registry.py`` (``OP_REGISTRY``, ``PLUGIN_SPECS``), ``graph.py``
(``make_op_model``, standalone single-node models such as ``verify.onnx``), ``tensorrt_kernels.py``
(ahead-of-time compilation for TensorRT) and ``tensorrt_plugins.py`` (registration with TensorRT).
See docs/ARCHITECTURE.md, "The two ops".
"""
