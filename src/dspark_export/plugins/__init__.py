"""The ``dspark`` custom ops: ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify`` (version 1).

Each op has one folder holding its contract (``schema.py``, the single source of truth), its numpy
reference (``reference.py``, the spec), its ONNX function of standard ops (``onnx_function.py``,
so ONNX Runtime runs it with no custom-op library) and its Triton kernel (``triton_kernel.py``, the
fast path; optional, behind ``triton_support.has_triton()``). Shared pieces: ``common.py`` (constants,
numpy warp and sample), ``contract.py`` (tensor specs, boundary checks), ``onnx_sampling.py`` and
``onnx_builder.py`` (ONNX twins of the sampling helpers), ``triton_sampling.py`` (Triton twins, on
the device) and ``triton_support.py`` (the gate, host-side checks, PTX), ``registry.py``
(``OP_REGISTRY``) and ``graph.py`` (``make_op_model``, standalone single-node models such as ``verify.onnx``).
See docs/ARCHITECTURE.md, "The two ops".
"""
