"""simsd: speculative decoding for block-diffusion language models (SDAR family).

Modules: ``config`` / ``loading`` (HF-format checkpoints), ``model`` (SDAR/Qwen3 decoder),
``cache`` (static KV cache), ``sampling`` / ``strategies`` (denoising steps), ``vanilla``
(baseline block decoding), ``cli`` (the ``simsd`` command).
"""
from .config import CheckpointError, ModelConfig
from .decoding import DecodeConfig, GenerationResult
from .loading import Checkpoint, load_checkpoint, load_model
from .model import SDARForCausalLM
from .sampling import SamplingParams
from .vanilla import vanilla_generate

__all__ = ["CheckpointError", "ModelConfig", "DecodeConfig", "GenerationResult", "Checkpoint",
           "load_checkpoint", "load_model", "SDARForCausalLM", "SamplingParams", "vanilla_generate"]
__version__ = "0.1.0"
