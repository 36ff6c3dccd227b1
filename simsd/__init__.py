"""simsd: speculative decoding for block-diffusion language models (SDAR family).

The package is laid out in rooms, each importing only the rooms below it::

    entrypoints/   the Python API (LLM), the OpenAI-compatible server, the ``simsd`` command line
    speculative/   SimSD: verification layouts and verdicts, the row program, optimistic drafting
    decoding/      decode configuration, sampling, remasking strategies, vanilla decoding
    engine/        batch engine, CUDA graphs, tensor parallelism, host-sync accounting
    models/        checkpoint config and loading, the SDAR model, the KV cache
    simsd_kernels  (a separate package) the attention op family

The Python API (:class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`) lives in
``entrypoints`` and is re-exported here. ``simsd.SamplingParams`` (a request's parameters) is a
:class:`simsd.decoding.SamplingParams` (a step's sampling) with the request fields added, so it
also fits ``DecodeConfig(sampling=...)``.

``testing`` holds helpers for tests and examples (random SDAR checkpoints); ``assets`` the
bundled tiny pair and held-out prompts.
"""
from .decoding import DecodeConfig, GenerationResult, vanilla_generate, vanilla_generate_batch
from .entrypoints.api import LLM, RequestCancelled, RequestError, RequestHandle, RequestOutput
from .entrypoints.errors import ParamError, SimsdWarning
from .entrypoints.params import SamplingParams
from .models import Checkpoint, CheckpointError, ModelConfig, SDARForCausalLM, load_checkpoint, load_model
from .speculative import SpecConfig, speculative_generate, speculative_generate_batch

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestHandle", "RequestError", "RequestCancelled",
           "ParamError", "SimsdWarning", "CheckpointError", "ModelConfig", "DecodeConfig", "GenerationResult", "Checkpoint",
           "load_checkpoint", "load_model", "SDARForCausalLM", "vanilla_generate",
           "vanilla_generate_batch", "SpecConfig", "speculative_generate", "speculative_generate_batch"]
__version__ = "0.1.0"
