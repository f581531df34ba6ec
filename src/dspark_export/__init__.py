"""dspark-export: DSpark speculative decoding as deployable engines.

Stages (one subpackage each): ``modeling`` (PyTorch reference modules, checkpoint loading),
``exporter`` (ONNX graphs), ``plugins`` (the ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify``
ops), ``engines`` (per-bucket engines, profiler, manifest), ``runtime`` (the speculative loop).
See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
