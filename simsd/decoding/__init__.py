"""Decoding: SDAR block decoding with one model (the baseline, docs/design.md §3).

Holds the decode configuration, prompt checks and results (``config``), sampling
(``sampling``: temperature, top-k, top-p, confidences, the exponential race), the keyed
sampling noise shared by vanilla decoding, the draft and exact verification (``noise``), the
remasking strategies (``strategies``: sequential, static, dynamic, entropy; the transfer
schedule), one denoising step and its batched request form (``step``), a request's block
decoding as an engine program with its statistics and the batch decoders' driver
(``program``) and vanilla decoding (``vanilla``).

May import: :mod:`simsd.engine`, :mod:`simsd.models`, :mod:`simsd_kernels`, torch. Never
:mod:`simsd.speculative` or :mod:`simsd.entrypoints`.
"""
from .config import BatchResult, DecodeConfig, GenerationResult, check_prompt
from .program import RowProgram
from .sampling import SamplingParams
from .step import Step, denoise_step
from .vanilla import VanillaRow, vanilla_generate, vanilla_generate_batch

__all__ = ["BatchResult", "DecodeConfig", "GenerationResult", "check_prompt", "RowProgram", "SamplingParams", "Step",
           "denoise_step", "VanillaRow", "vanilla_generate", "vanilla_generate_batch"]
