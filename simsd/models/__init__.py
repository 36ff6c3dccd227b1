"""Models: what a checkpoint is and how it runs one forward.

Holds the checkpoint configuration (``config``), loading of HF-format SDAR directories
(``loading``: safetensors weights, tokenizer, stop ids, mask id), the native SDAR/Qwen3
decoder (``model``: explicit positions and mask labels, attention through
:mod:`simsd_kernels`; ``moe``: the SDAR-MoE / Qwen3-MoE sparse block) and its static KV cache with per-row
lengths (``cache``).

May import: :mod:`simsd_kernels`, torch, safetensors, transformers (configs, tokenizers).
Nothing else of simsd: every other room builds on this one.
"""
from .config import CheckpointError, ModelConfig
from .loading import Checkpoint, load_checkpoint, load_model
from .model import SDARForCausalLM, labels_for

__all__ = ["CheckpointError", "ModelConfig", "Checkpoint", "load_checkpoint", "load_model", "SDARForCausalLM",
           "labels_for"]
