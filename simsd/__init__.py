"""simsd: speculative decoding for block-diffusion language models (SDAR family).

The package is laid out in rooms, each importing only the rooms below it::

    entrypoints/   the Python API (LLM), the OpenAI-compatible server, the ``simsd`` command line
    speculative/   SimSD: verification layouts and verdicts, the row program, optimistic drafting
    decoding/      decode configuration, sampling, remasking strategies, vanilla decoding
    engine/        batch engine, CUDA graphs, tensor parallelism, host-sync accounting
    models/        checkpoint config and loading, the SDAR model, the KV cache
    config/        every setting declared once and its rules (torch-free)
    simsd_kernels  (a separate package) the attention op family

The Python API (:class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`) lives in
``entrypoints`` and is re-exported here. ``simsd.SamplingParams`` (a request's parameters,
:mod:`simsd.config.request`) is a :class:`simsd.config.fields.StepSampling` (a denoising step's
sampling) with the request fields added, so it also fits ``DecodeConfig(sampling=...)``.

``testing`` holds helpers for tests and examples (random SDAR checkpoints); ``assets`` the
bundled tiny pair and held-out prompts.
"""
from importlib import import_module

#: the public names and their modules, imported on first use (PEP 562): ``simsd --help`` and a
#: mistyped option answer before torch loads
EXPORTS = {
    **dict.fromkeys(["LLM", "RequestOutput", "CompletionOutput", "RequestHandle", "RequestError", "RequestCancelled"],
                    "entrypoints.api"),
    "SamplingParams": "config", "EngineArgs": "config", "ParamError": "config", "SimsdWarning": "entrypoints.errors",
    **dict.fromkeys(["CheckpointError", "ModelConfig", "Checkpoint", "load_checkpoint", "load_model",
                     "SDARForCausalLM"], "models"),
    **dict.fromkeys(["DecodeConfig", "GenerationResult", "vanilla_generate", "vanilla_generate_batch"], "decoding"),
    **dict.fromkeys(["SpecConfig", "speculative_generate", "speculative_generate_batch"], "speculative"),
}
__all__ = list(EXPORTS)


def __getattr__(name):
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{EXPORTS[name]}"), name)


__version__ = "0.1.0"
