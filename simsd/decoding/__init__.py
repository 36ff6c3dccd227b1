"""Decoding: SDAR block decoding with one model (the baseline, docs/design.md §3).

Holds the decode configuration, prompt checks and results (``config``), sampling
(``sampling``: temperature, top-k, top-p, confidences, the exponential race), the keyed
sampling noise shared by vanilla decoding, the draft and exact verification (``noise``), the
remasking strategies (``strategies``: sequential, static, dynamic, entropy; the transfer
schedule), one denoising step and its batched request form (``step``), a request's block
decoding as an engine program with its statistics and the batch decoders' driver
(``program``), its forward layouts and folded commits (``layouts``) and vanilla decoding
(``vanilla``). The settings these take are declared in :mod:`simsd.config`.

May import: :mod:`simsd.engine`, :mod:`simsd.models`, :mod:`simsd.config`, :mod:`simsd_kernels`, torch. Never
:mod:`simsd.speculative` or :mod:`simsd.entrypoints`.
"""
from importlib import import_module

#: the re-exports and their modules, imported on first use (PEP 562)
EXPORTS = {"BatchResult": "config", "DecodeConfig": "config", "GenerationResult": "config", "check_prompt": "config",
           "RowProgram": "program", "StepSampling": "sampling", "Step": "step", "denoise_step": "step",
           "VanillaRow": "vanilla", "vanilla_generate": "vanilla", "vanilla_generate_batch": "vanilla"}
__all__ = list(EXPORTS)


def __getattr__(name):
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{EXPORTS[name]}"), name)
