"""The ONNX Runtime backend: one session per (graph, bucket) engine, weights shared across buckets
(``runner.py``). Its TensorRT twin is ``engines/trt/``."""
