"""``simsd generate`` and the preparation it shares with ``simsd bench``: a thin layer over the
Python API (:class:`~simsd.entrypoints.api.LLM`), which turns the options into tokens.

A run is prepared in an order that fails early and cheaply (:func:`prepare`): option values
and combinations (:mod:`simsd.entrypoints.options`), devices, engine options and attention
backends, the checkpoints' small files and tensor headers (no weights), the block-dependent
options and the request parameters (:func:`simsd.entrypoints.params.resolve`, as for every
request of the API), every prompt (encoded as the API encodes it,
:mod:`simsd.entrypoints.encoding`) against both models, and the memory the run will need
(:mod:`simsd.entrypoints.resources`). Only then is the :class:`LLM` built (:func:`build_llm`:
its weights load, announced by one line on stderr). Prompt ``i`` of the set samples with the
seed ``--seed + i``; the LLM runs its scheduler on this thread, so the prompts enter its
``--batch-size`` rows in order and every run batches the same rows together.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

import torch

from ..decoding.config import DecodeConfig
from ..models.loading import CheckpointInfo, read_checkpoint
from .errors import ParamError, UsageError
from .options import check_block_options, check_device, check_engine_options, check_options, option_name
from .params import MAX_SEED, SamplingParams, Settings, resolve


def parse_ids(text: str) -> list[int]:
    items = text.replace(" ", "").split(",")
    try:
        if any(t == "" for t in items):
            raise ValueError("an empty item")
        return [int(t) for t in items]
    except ValueError as exc:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc


def request_form(p, tokenizer, raw: bool):
    """What the API is given for prompt ``p``: its ids; its text as the user turn of the chat
    template (chat messages); or, with ``--raw`` or without a template, the text as it is."""
    if p.ids is not None:
        return list(p.ids)
    if raw or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return p.text
    return [{"role": "user", "content": p.text}]


def prompt_label(p, i: int = 0) -> str:
    """How errors name a prompt: the option for a single prompt, else ``prompt FILE:LINE`` / its id."""
    return {"prompt": "--prompt", "prompt-ids": "--prompt-ids"}.get(p.id, f"prompt {p.id or i + 1}")


def collect_prompts(args, tokenizer, vocab_size: int, mask_id: int) -> list:
    """The prompts of a command as :class:`simsd.entrypoints.prompts.Prompt` objects with ``ids``
    and ``request`` (the form given to the API, :func:`request_form`) set.

    Sources: ``--prompt-ids``, ``--prompt``, ``--prompts-file``, ``--prompt-set`` (bundled
    held-out prompts, or CHAMP / HumanEval held-out problems from their packages); with none of
    them, the first bundled held-out prompt. Texts get the chat template unless ``--raw``.
    Encoded by :func:`simsd.entrypoints.encoding.encode_prompt` (a text that spells the mask
    token is refused there); the ids are checked against the models by :func:`check_prompts`.
    """
    from .prompts import Prompt, load_prompts, read_jsonl
    if args.prompt_ids is not None:
        prompts = [Prompt(ids=parse_ids(args.prompt_ids), id="prompt-ids")]
    elif args.prompt is not None:
        if not args.prompt:  # whitespace is text, taken as it is (as the API and the server take it)
            raise UsageError("--prompt is empty")
        prompts = [Prompt(text=args.prompt, id="prompt")]
    elif args.prompts_file is not None:
        prompts = read_jsonl(args.prompts_file)
    else:
        prompts = load_prompts(args.prompt_set or "bundled")
        if args.prompt_set is None and args.limit is None:
            prompts = prompts[:1]
            from ..engine.tp import world
            if world()[0] == 0:
                print(f"simsd: no prompt given, using the held-out prompt {prompts[0].id}", file=sys.stderr)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    texts = [p for p in prompts if p.ids is None]
    if args.raw and not texts:
        raise UsageError("--raw applies to text prompts; these prompts are token ids (they bypass the tokenizer)")
    from .encoding import ChatTemplateError, encode_prompt
    for i, p in enumerate(prompts):
        if p.ids is None and tokenizer is None:
            raise UsageError("this checkpoint has no tokenizer: pass --prompt-ids or prompt_ids in the JSONL file")
        p.request = request_form(p, tokenizer, args.raw)
        try:
            p.ids, _ = encode_prompt(p.request, tokenizer, vocab_size, mask_id)
        except ChatTemplateError as exc:
            raise UsageError(f"{exc}; pass --raw to use the text as it is") from exc
        except ParamError as exc:
            raise UsageError(f"{prompt_label(p, i)}: {exc}") from exc
    return prompts


def resolve_device_dtype(args):
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device("--device", device)
    if getattr(args, "draft_device", None):
        check_device("--draft-device", args.draft_device)
    dtype = args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    return device, dtype


def check_prompts(prompts: list, models: list, cfg: DecodeConfig, mask_id: int | None = None) -> None:
    """Check every prompt against every model (objects with ``.config``: checkpoints or
    :class:`CheckpointInfo`) before anything is decoded; the error names the prompt."""
    from ..decoding.config import check_prompt
    for i, p in enumerate(prompts):
        for m in models:
            try:
                check_prompt(p.ids, m.config, cfg.max_new_tokens, cfg.block_length, mask_id=mask_id)
            except ValueError as exc:
                raise UsageError(f"{prompt_label(p, i)}: {exc}") from exc


def request_params(args) -> SamplingParams:
    """The options as the API's :class:`SamplingParams` (checked by :func:`check_options` before)."""
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_new_tokens, seed=args.seed or 0, steps=args.steps,
                              strategy=args.strategy, threshold=args.threshold, gamma=args.gamma,
                              draft_strategy=args.draft_strategy, draft_threshold=args.draft_threshold)
    except ParamError as exc:  # (the option checks come first: a safety net)
        raise UsageError(f"{option_name({'max_tokens': 'max_new_tokens'}.get(exc.param, exc.param))}: {exc}") \
            from None


def decode_config(args, target_config, params: SamplingParams) -> DecodeConfig:
    """The target's :class:`DecodeConfig` of the run, as :func:`resolve` makes it for every request
    (the block options checked first with their flag names)."""
    block_length = args.block_length if args.block_length is not None else target_config.block_size
    check_block_options(args, block_length, target_config.max_position_embeddings)
    try:
        return resolve(vanilla_params(params), Settings("vanilla", block_length, target_config.vocab_size,
                                                        args.fold_commit))[0]
    except ParamError as exc:
        raise UsageError(f"{option_name(exc.param)}: {exc}") from None


def vanilla_params(params: SamplingParams) -> SamplingParams:
    """``params`` without the draft's settings (a vanilla run next to speculative ones in bench)."""
    return dataclasses.replace(params, gamma=None, draft_strategy=None, draft_threshold=None)


def check_engine_args(args, device: str) -> None:
    """``UsageError`` for engine options this machine or build cannot honour."""
    tp = getattr(args, "tp", 1)
    if tp > 1:
        from ..engine.tp import world
        if world()[1] != tp:
            raise UsageError(f"--tp {tp}: this process group has {world()[1]} rank(s); launch with torchrun "
                             f"--nproc-per-node {tp} or let simsd spawn the ranks")
    check_engine_options([device, args.draft_device or device], getattr(args, "cuda_graphs", False),
                         getattr(args, "invariant", False))


def dense_attention(backend: str, device) -> bool:
    """Whether ``backend`` runs as the torch reference (dense masks) on ``device``; ``UsageError``
    when a requested backend cannot run there."""
    from simsd_kernels.backends import resolve_backend
    try:
        return resolve_backend(backend, torch.device(device)).name == "torch"
    except ValueError as exc:
        raise UsageError(f"--attention-backend {backend}: {exc}") from exc


@dataclass
class Run:
    """A prepared run: everything checked, nothing but small files read."""
    args: object
    modes: list
    device: str
    draft_device: str | None
    dtype: str
    target: CheckpointInfo
    draft: CheckpointInfo | None
    cfg: DecodeConfig
    prompts: list
    params: SamplingParams

    def params_of(self, mode: str) -> list:
        """The :class:`SamplingParams` of every prompt in ``mode``: prompt ``i`` samples with the
        seed ``(--seed + i) mod 2**63`` (whatever the batch size)."""
        base = self.params if mode != "vanilla" else vanilla_params(self.params)
        return [dataclasses.replace(base, seed=(base.seed + i) % MAX_SEED) for i in range(len(self.prompts))]


def prepare(args, modes: list) -> Run:
    """Check a command's options, devices, checkpoints (without weights), prompts and memory;
    see the module doc. Raises :class:`UsageError` / :class:`CheckpointError`."""
    from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..engine.threads import apply_threads
    check_options(args, modes)
    device, dtype = resolve_device_dtype(args)
    if getattr(args, "tp", 1) > 1:
        from ..engine.tp import rank_device
        device = rank_device(args.device)
    check_engine_args(args, device)
    speculative = any(m != "vanilla" for m in modes)
    draft_device = (args.draft_device or device) if speculative else None
    dense = {d: dense_attention(args.attention_backend, d) for d in {device, draft_device} if d is not None}
    declared = {"block_length": args.block_length, "mask_token_id": args.mask_token_id}
    target = read_checkpoint(args.target or DEFAULT_TARGET, **declared)
    draft = read_checkpoint(args.draft or DEFAULT_DRAFT, **declared) if speculative else None
    if draft is not None:
        from ..speculative.decoder import check_pair
        try:
            check_pair(target, draft)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    threads = getattr(args, "threads", None)
    if threads is not None and threads > (os.cpu_count() or 1):
        print(f"simsd: warning: --threads {threads} exceeds this machine's {os.cpu_count()} CPU cores "
              f"(oversubscribed threads wait for each other)", file=sys.stderr)
    apply_threads([c.config for c in (target, draft) if c is not None], threads)
    params = request_params(args)
    cfg = decode_config(args, target.config, params)
    if args.limit is None and getattr(args, "command", "generate") == "bench" and args.prompts_file is None \
            and args.prompt is None and args.prompt_ids is None:
        args.limit = 8
        args.prompt_set = args.prompt_set or "bundled"
    prompts = collect_prompts(args, target.tokenizer, target.config.vocab_size, target.mask_token_id)
    check_prompts(prompts, [m for m in (target, draft) if m is not None], cfg, target.mask_token_id)
    tok = target.tokenizer
    if any(p.text is not None for p in prompts) and not args.raw and not getattr(tok, "chat_template", None):
        print(f"simsd: note: {target.path.name} has no chat template; text prompts are used as they are",
              file=sys.stderr)
    from .resources import RunShape, check_run_memory
    models = {"target": (target.config, dtype, device, dense[device])}
    if draft is not None:
        models["draft"] = (draft.config, dtype, draft_device, dense[draft_device])
    check_run_memory(RunShape(models, [len(p.ids) for p in prompts], cfg.max_new_tokens, cfg.block_length,
                              args.gamma, min(args.batch_size, len(prompts)), modes))
    return Run(args, modes, device, draft_device, dtype, target, draft, cfg, prompts, params)


def loading_line(run: Run) -> str:
    from ..engine.memory import parameter_count
    parts = [f"{role} {info.path.name} ({parameter_count(info.config) / 1e6:.1f}M parameters, {dev})"
             for role, info, dev in (("target", run.target, run.device), ("draft", run.draft, run.draft_device))
             if info is not None]
    from ..engine.tp import world
    tp = world()[1]
    sharded = f", the target tensor-parallel over {tp} ranks" if tp > 1 else ""
    return (f"simsd: loading {' and '.join(parts)} in {run.dtype}, {torch.get_num_threads()} CPU "
            f"thread{'s' if torch.get_num_threads() > 1 else ''}{' per rank' if tp > 1 else ''}{sharded}")


def build_llm(run: Run, mode: str, loaded: dict | None = None):
    """The :class:`~simsd.entrypoints.api.LLM` of a prepared run in ``mode``: ``--batch-size``
    rows (at most one per prompt) of the positions the longest prompt needs, the scheduler on
    this thread. ``loaded``: checkpoints loaded by an LLM of another mode, to share
    (``{"target": ..., "draft": ...}``; updated with those this one loads). The first LLM of a
    run says on stderr what it loads."""
    from ..engine.tp import world
    from .api import LLM
    args = run.args
    loaded = {} if loaded is None else loaded
    if not loaded and world()[0] == 0:
        print(loading_line(run), file=sys.stderr, flush=True)
    block_length = run.cfg.block_length
    limit = min(m.config.max_position_embeddings for m in (run.target, run.draft) if m is not None)
    need = max(len(p.ids) for p in run.prompts) + run.cfg.max_new_tokens
    spec = mode != "vanilla"
    llm = LLM(loaded.get("target", run.target), loaded.get("draft", run.draft) if spec else None, mode,
              device=run.device, draft_device=run.draft_device if spec else None, dtype=run.dtype,
              batch_size=min(args.batch_size, len(run.prompts)), max_model_len=min(limit, max(need, block_length + 1)),
              max_waiting=len(run.prompts), block_length=block_length, mask_token_id=args.mask_token_id,
              fold_commit=args.fold_commit,
              on_reject=(args.on_reject or "redraft") if spec else "redraft",
              rope_copy=not (args.no_rope_copy and mode == "paper"),
              optimistic={None: None, "auto": None, "on": True, "off": False}[args.optimistic] if spec else None,
              max_gamma=args.gamma if spec else None,
              paper_variant=(getattr(args, "paper_variant", None) or "described") if mode == "paper" else "described",
              attention_backend=args.attention_backend, cuda_graphs=getattr(args, "cuda_graphs", False),
              invariant=getattr(args, "invariant", False), tp=getattr(args, "tp", 1),
              threads=getattr(args, "threads", None), scheduler_thread=False)
    loaded.update({"target": llm.target, **({"draft": llm.draft} if llm.draft is not None else {})})
    return llm


def summary_line(stats: dict) -> str:
    line = (f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['decode_seconds']:.3f} s "
            f"({stats['tokens_per_second']:.1f} tokens/s), target forwards/token "
            f"{stats['target_forwards'] / max(stats['new_tokens'], 1):.3f}")
    if "acceptance_rate" in stats:
        line += (f", acceptance {stats['acceptance_rate']:.3f}, draft share {stats['draft_share']:.3f}, "
                 f"accepted/round {stats['accepted_per_round']:.2f}")
    return line


def run_generate(args) -> int:
    from .outputs import run_decode_seconds
    run = prepare(args, [args.mode])
    llm = build_llm(run, args.mode)
    prompts, n = run.prompts, llm.batch_size
    if n < args.batch_size:
        print(f"simsd: --batch-size {args.batch_size} > {len(prompts)} prompts: batches of {n}", file=sys.stderr)
    outs = []
    for prompt, out in zip(prompts, llm.generate_iter([p.request for p in prompts], run.params_of(args.mode),
                                                      use_tqdm=len(prompts) > n)):
        outs.append(out)
        if args.json:
            print(json.dumps({"id": prompt.id, "prompt": prompt.text, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                              "stats": out.stats}), flush=True)
        else:
            if len(prompts) > 1:
                print(f"### {prompt.id}")
            print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
            print(summary_line(out.stats), flush=True)
    if n > 1 and not args.json:  # the run as a whole: its tokens over its decode time
        tokens, seconds = sum(len(o.token_ids) for o in outs), run_decode_seconds(outs)
        print(f"[{len(prompts)} prompts, batch size {n}] {tokens} tokens in {seconds:.3f} s "
              f"({tokens / seconds if seconds > 0 else float('nan'):.1f} tokens/s)", flush=True)
    return 0
