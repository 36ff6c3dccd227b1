"""simsd: speculative decoding for block-diffusion language models (SDAR family).

The package is laid out in rooms, each importing only the rooms below it::

    entrypoints/   the ``simsd`` command line (generate, bench) and prompt sources
    speculative/   SimSD: verification layouts and verdicts, the row program, optimistic drafting
    decoding/      decode configuration, sampling, remasking strategies, vanilla decoding
    engine/        batch engine, CUDA graphs, tensor parallelism, host-sync accounting
    models/        checkpoint config and loading, the SDAR model, the KV cache
    simsd_kernels  (a separate package) the attention op family

``testing`` holds helpers for tests and examples (random SDAR checkpoints); ``assets`` the
bundled tiny pair and held-out prompts.
"""
from .decoding import DecodeConfig, GenerationResult, SamplingParams, vanilla_generate, vanilla_generate_batch
from .models import Checkpoint, CheckpointError, ModelConfig, SDARForCausalLM, load_checkpoint, load_model
from .speculative import SpecConfig, speculative_generate, speculative_generate_batch

__all__ = ["CheckpointError", "ModelConfig", "DecodeConfig", "GenerationResult", "Checkpoint",
           "load_checkpoint", "load_model", "SDARForCausalLM", "SamplingParams", "vanilla_generate",
           "vanilla_generate_batch", "SpecConfig", "speculative_generate", "speculative_generate_batch"]
__version__ = "0.1.0"
