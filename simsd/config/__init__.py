"""Config: every setting of simsd declared once, and every rule over them (torch-free, the
lowest room of the package: the command line checks its options before torch loads).

``vocabulary``: :class:`Setting`, :class:`ParamError`, :func:`opt`, the field checks;
``fields``: the decoding settings (:data:`SETTINGS`), the strategies, a step's sampling;
``speculative``: :class:`SpecConfig` and the speculative rules; ``engine``: :class:`EngineArgs`;
``request``: :class:`SamplingParams` and :func:`check_request`; ``serving``: the server's limits;
``vllm_names``: vLLM's and SGLang's spellings of the settings (mapped, or refused by name).

May import: nothing of simsd (and torch only inside a function that needs a device).
"""
from .engine import EngineArgs
from .request import SamplingParams, check_request
from .speculative import SpecConfig
from .vocabulary import ParamError, Setting, opt

__all__ = ["EngineArgs", "ParamError", "SamplingParams", "Setting", "SpecConfig", "check_request", "opt"]
