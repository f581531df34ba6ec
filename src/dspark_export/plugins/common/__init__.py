"""What the two ``dspark`` ops share: the opset constants (here), numpy sampling (``sampling.py``), tensor
contracts (``contract.py``), ONNX building blocks (``onnx_builder.py``, ``onnx_sampling.py``), Triton building
blocks (``triton_sampling.py``, ``triton_support.py``), the TensorRT plugin data types (``tensorrt_spec.py``) and
the TensorRT gate (``tensorrt_support.py``).
Nothing here imports an op folder.
"""

DOMAIN = "dspark"
"""ONNX domain of the custom ops."""
OPSET_VERSION = 1
"""Version of the ``dspark`` opset (every op is at version 1)."""
ONNX_OPSET = 21
"""Default-domain opset of the function bodies and of the models ``graph.py`` builds."""
IR_VERSION = 10
"""IR version of the models ``graph.py`` builds (opset 21; IR 10 is the first with function overloads)."""
