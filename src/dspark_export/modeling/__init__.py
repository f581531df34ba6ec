"""Stage ``load``: targets (transformers folder, GGUF, the embedded default), the architecture registry,
the DSpark drafter PyTorch module, and DeepSpec-format drafter checkpoints. Knows nothing of ONNX.

Modules: ``registry`` (model_type → ArchitectureSpec, RoPE tables), ``target`` (TargetModel,
load_target, default_target_path), ``config`` (DrafterConfig), ``layers`` (drafter building blocks),
``drafter`` (DSparkDrafter, init_drafter), ``checkpoint`` (load_drafter, save_drafter).
"""

from dspark_export.modeling.checkpoint import load_drafter, read_drafter_config, save_drafter
from dspark_export.modeling.config import DrafterConfig, default_mask_token_id, default_target_layer_ids
from dspark_export.modeling.drafter import DSparkDrafter, init_drafter
from dspark_export.modeling.registry import (
    SUPPORTED_MODEL_TYPES,
    ArchitectureSpec,
    RopeTables,
    compute_rope,
    get_architecture,
    read_rope,
)
from dspark_export.modeling.target import (
    TargetModel,
    convert_gguf_to_folder,
    default_cache_dir,
    default_target_path,
    load_target,
    wrap_target,
)

__all__ = [
    "ArchitectureSpec", "DSparkDrafter", "DrafterConfig", "RopeTables", "SUPPORTED_MODEL_TYPES", "TargetModel",
    "compute_rope", "convert_gguf_to_folder", "default_cache_dir", "default_mask_token_id",
    "default_target_layer_ids", "default_target_path", "get_architecture", "init_drafter", "load_drafter",
    "load_target", "read_drafter_config", "read_rope", "save_drafter", "wrap_target",
]
