"""An engine's settings (:class:`EngineArgs`, the keywords of :class:`simsd.LLM` and the options
of ``simsd serve``), each declared once with its :class:`~simsd.config.vocabulary.Setting`, and
their rules: the ranges, the settings a mode does not use, and the combinations refused (the
speculative ones in :mod:`simsd.config.speculative`). The command line's options and the Python
API's keywords are these fields under the same names. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from .fields import SETTINGS
from .speculative import SPECULATIVE_RULES, parse_draft
from .vocabulary import SPECULATIVE, Rule, Setting, check_fields, check_modes, check_rules, opt, settings_of

DTYPES = ("float32", "bfloat16", "float16", "float64")
BACKENDS = ("auto", "cuda", "triton", "torch")
GENERATION_CONFIGS = ("auto", "none")


@dataclass(frozen=True)
class EngineArgs:
    """The settings of an :class:`~simsd.entrypoints.api.LLM`, fixed when its engine is built
    (each field's help is the command line's ``--help``).

    Raises:
        ParamError: a field of the wrong type or out of range, a setting the mode does not use
            (``draft`` ... in vanilla mode, ``rope_copy=False`` outside paper mode),
            ``scheduler_thread`` with ``tp > 1``, ``invariant`` with ``cuda_graphs``,
            ``fold_commit`` with optimistic drafting.
    """
    target: object = Setting(Path, "target SDAR checkpoint directory (HF format; the Python API also takes a read "
                                   "CheckpointInfo or a loaded Checkpoint); default: the bundled tiny "
                                   "target").field(None)
    draft: object = Setting(object, "draft SDAR checkpoint, as the target (paper/exact modes), or 'self': the "
                                    "target proposes its own next steps, no draft model (exact mode); a directory "
                                    "named self is ./self; default: the bundled tiny draft with the bundled target, "
                                    "'self' with any other target",
                            modes=SPECULATIVE, parse=parse_draft,
                            text="a checkpoint directory, 'self', or a read or loaded checkpoint").field(None)
    mode: str = SETTINGS["mode"].field("exact")
    device: object = Setting(object, "device of the target: cpu, cuda, cuda:1 ... (default: cuda if available, "
                                     "else cpu; ignored for a loaded checkpoint)").field(None)
    draft_device: object = Setting(object, "device of the draft (default: the target's)",
                                   modes=SPECULATIVE).field(None)
    dtype: str | None = Setting(str, "weights and activations dtype (default: bfloat16 on cuda, float32 on cpu)",
                                choices=DTYPES).field(None)
    batch_size: int = Setting(int, "the most requests decoded together (engine rows)", low=1).field(8)
    max_model_len: int | None = Setting(int, "positions per request, prompt + max_tokens (default: the models' "
                                             "maximum); each row's KV cache holds this many", low=1).field(None)
    kv_cache_memory: float | None = Setting(float, "memory the KV caches (target and draft) may take; fewer rows "
                                                   "than batch_size if they do not fit (default: batch_size rows)",
                                            low=0, open_low=True, unit="bytes").field(None)
    page_size: int | None = Setting(int, "KV cache page size in tokens, a whole number of blocks: the rows share "
                                         "one pool of pages per model (kv_cache_memory, default batch_size rows' "
                                         "worth), taken as a request grows and returned when it ends; requests "
                                         "are admitted while pages are free and the latest is preempted (started "
                                         "over, the same tokens) when they run out (default: none, every row owns "
                                         "max_model_len positions)", low=1, unit="tokens").field(None)
    enable_prefix_caching: bool = Setting(bool, "share the KV pages of prompt prefixes already computed between "
                                                "requests (whole pages; a prompt's cached part is not prefilled "
                                                "again); needs page_size").field(False)
    gpu_memory_utilization: float | None = Setting(float, "the share of the device's total memory the run may "
                                                          "take (vLLM's meaning): the KV caches get what the "
                                                          "weights and the workspace leave (instead of "
                                                          "kv_cache_memory)", low=0, open_low=True,
                                                   high=1).field(None)
    max_prefill_tokens: int | None = Setting(int, "the most prompt tokens one prefill forward writes, a whole "
                                                  "number of blocks: a longer prompt is prefilled in chunks "
                                                  "interleaved with the other rows' forwards, which then pause for "
                                                  "one chunk at a time (default: no limit, a prompt's "
                                                  "block-aligned part in one forward)", low=1,
                                             unit="tokens").field(None)
    max_waiting: int = Setting(int, "requests that may wait for a row; beyond it submit raises QueueFull (the "
                                    "server answers 503)", low=0).field(64)
    block_length: int | None = SETTINGS["block_length"].field(None)
    mask_token_id: int | None = Setting(int, "the mask token's id, for checkpoints that name none (default: "
                                             "mask_token_id in config.json or the tokenizer's mask_token)",
                                        low=0).field(None)
    fold_commit: bool = SETTINGS["fold_commit"].field(False)
    on_reject: str = SETTINGS["on_reject"].field("redraft")
    rope_copy: bool = SETTINGS["rope_copy"].field(True)
    paper_variant: str = SETTINGS["paper_variant"].field("described")
    optimistic: bool | None = SETTINGS["optimistic"].field(None)
    speculation_width: object = SETTINGS["speculation_width"].field("auto")
    max_gamma: int | None = Setting(int, "the most draft steps a request verifies per round, and the gamma of "
                                         "requests that give none (default: the block length); the caches hold "
                                         "its verify forwards", low=1, modes=SPECULATIVE).field(None)
    attention_backend: str | None = Setting(str, "attention kernels: auto picks cuda > triton > torch on a GPU, "
                                                 "torch on the CPU (SIMSD_ATTENTION_BACKEND overrides auto; "
                                                 "default: auto, a loaded checkpoint keeps its own)",
                                            choices=BACKENDS).field(None)
    cuda_graphs: bool = Setting(bool, "replay the per-shape forwards as CUDA graphs (CUDA devices only)").field(False)
    invariant: bool | None = Setting(bool, "shape-invariant numerics for the target (norms, projections and MLP "
                                           "per block-sized unit): exact mode then equals vanilla bit for bit in "
                                           "every dtype on the torch backend; slower verify forwards (default: "
                                           "off, a loaded checkpoint keeps its own)").field(None)
    tp: int = Setting(int, "shard the target tensor-parallel over N ranks (torch.distributed; the command line "
                           "spawns them or runs under torchrun)", low=1).field(1)
    threads: int | None = Setting(int, "CPU threads for torch's intra-op work (default: OMP_NUM_THREADS if set, "
                                       "else chosen from the model size: 1 for models as small as the bundled "
                                       "pair)", low=1).field(None)
    scheduler_thread: bool | None = Setting(bool, "run the scheduler on its own thread (default, unless tp > 1: "
                                                  "simsd serve --tp leads the ranks' rounds from rank 0's thread "
                                                  "itself); off: on the thread that waits for a result").field(None)
    generation_config: str = Setting(str, "auto: the temperature, top_k and top_p of the target's "
                                          "generation_config.json are the defaults of requests that do not give "
                                          "them (vLLM's --generation-config auto); none: simsd's own (greedy)",
                                     choices=GENERATION_CONFIGS).field("auto")

    def __post_init__(self):
        check_fields(self)
        defaults = {f.name: f.default for f in fields(self)}
        check_modes({n: s for n, s in settings_of(self).items() if getattr(self, n) != defaults[n]}, [self.mode])
        apart = None
        if self.mode != "vanilla" and self.fold_commit and self.draft_device is not None \
                and not same_device(self.draft_device, self.device):  # torch is imported only then
            apart = f"{self.draft_device} != {self.device or 'the default device'}"
        check_rules(SPECULATIVE_RULES + ENGINE_RULES, self, {"apart": apart})


#: The refused combinations of an engine's settings besides the speculative ones
#: (:data:`~simsd.config.speculative.SPECULATIVE_RULES`), as :class:`~simsd.config.vocabulary.Rule`
ENGINE_RULES = (
    Rule("scheduler_thread", lambda s: s.scheduler_thread and s.tp > 1,
         lambda s: f"{opt('tp')} > 1 needs {opt('scheduler_thread', False)} (the ranks must run the same rounds; "
                   f"simsd serve --tp runs rank 0's scheduler on its thread and sends each round's inputs to the "
                   f"other ranks)",
         ({"scheduler_thread": True, "tp": 2}, {})),
    Rule("invariant", lambda s: s.invariant and s.cuda_graphs,
         lambda s: f"{opt('invariant')} is not available with {opt('cuda_graphs')} (the graph runner does not run "
                   f"the per-unit path)",
         ({"invariant": True, "cuda_graphs": True}, {})),
)


def same_device(a, b) -> bool:
    """Whether two device settings name the same device (None: the default, cuda if available)."""
    import torch
    dev = lambda d: torch.device(d or ("cuda" if torch.cuda.is_available() else "cpu"))  # noqa: E731
    try:
        x, y = dev(a), dev(b)
    except (RuntimeError, TypeError):
        return a == b  # a bad name is refused by the device check
    return x.type == y.type and (x.type == "cpu" or (x.index or 0) == (y.index or 0))


#: the fields of :class:`EngineArgs`
ENGINE_SETTINGS = tuple(f.name for f in fields(EngineArgs))
