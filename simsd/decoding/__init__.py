"""Decoding: SDAR block decoding with one model (the baseline, docs/design.md §3).

Holds the decode configuration and prompt checks (``config``), sampling (``sampling``:
temperature, top-k, top-p, confidences, the exponential race), the keyed sampling noise
shared by vanilla decoding, the draft and exact verification (``noise``), the remasking strategies
(``strategies``: sequential, static, dynamic, entropy; the transfer schedule), one denoising
step and its batched request form (``step``) and vanilla decoding as an engine program
(``vanilla``).

May import: :mod:`simsd.engine`, :mod:`simsd.models`, :mod:`simsd_kernels`, torch. Never
:mod:`simsd.speculative` or :mod:`simsd.entrypoints`.
"""
from .config import DecodeConfig, GenerationResult, check_prompt
from .sampling import SamplingParams
from .step import Step, denoise_step
from .vanilla import vanilla_generate, vanilla_generate_batch

__all__ = ["DecodeConfig", "GenerationResult", "check_prompt", "SamplingParams", "Step", "denoise_step",
           "vanilla_generate", "vanilla_generate_batch"]
