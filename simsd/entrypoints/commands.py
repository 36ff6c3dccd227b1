"""Implementation of the ``simsd generate`` command and the preparation it shares with ``simsd bench``.

A run is prepared in an order that fails early and cheaply (:func:`prepare`): option values
and combinations (:mod:`simsd.entrypoints.options`), devices and attention backends, the
checkpoints' small files and tensor headers (no weights), the block-dependent options, every
prompt, and the memory the run will need (:mod:`simsd.entrypoints.resources`). Only then are
the weights loaded (:func:`load_models`, announced by one line on stderr).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field

import torch

from ..decoding.config import DecodeConfig
from ..decoding.sampling import SamplingParams
from ..models.loading import CheckpointInfo, load_checkpoint, read_checkpoint
from .errors import UsageError
from .options import check_block_options, check_options


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc


def apply_template(tokenizer, text: str) -> str:
    """``text`` as the user turn of the tokenizer's chat template, with the generation prompt."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors raised by the checkpoint's template
        raise UsageError(f"the chat template cannot render a user message ({' '.join(str(exc).split())}); "
                         f"pass --raw to use the text as it is") from exc


def encode(tokenizer, text: str, raw: bool) -> list[int]:
    if tokenizer is None:
        raise UsageError("this checkpoint has no tokenizer: pass --prompt-ids or prompt_ids in the JSONL file")
    if not raw and getattr(tokenizer, "chat_template", None):
        text = apply_template(tokenizer, text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_label(p, i: int = 0) -> str:
    """How errors name a prompt: the option for a single prompt, else ``prompt FILE:LINE`` / its id."""
    return {"prompt": "--prompt", "prompt-ids": "--prompt-ids"}.get(p.id, f"prompt {p.id or i + 1}")


def check_mask_in_text(p, tokenizer, mask_id: int, i: int = 0) -> None:
    """A prompt text that spells the mask token is refused (a prompt never changes: a MASK in it
    would be decoded over). Names the character position."""
    mask = tokenizer.convert_ids_to_tokens(mask_id) if tokenizer is not None else None
    if mask and p.text is not None and mask in p.text:
        raise UsageError(f"{prompt_label(p, i)}: the text spells the mask token {mask!r} at character "
                         f"{p.text.index(mask)}; a prompt cannot contain the mask token (remove it)")


def collect_prompts(args, tokenizer, vocab_size: int, mask_id: int | None = None) -> list:
    """The prompts of a command as :class:`simsd.entrypoints.prompts.Prompt` objects with ``ids`` set.

    Sources: ``--prompt-ids``, ``--prompt``, ``--prompts-file``, ``--prompt-set`` (bundled
    held-out prompts, or CHAMP / HumanEval held-out problems from their packages); with none of
    them, the first bundled held-out prompt. Texts get the chat template unless ``--raw``.
    A text that spells the mask token is refused (``mask_id``); ids are checked by
    :func:`check_prompts`.
    """
    from .prompts import Prompt, load_prompts, read_jsonl
    if args.prompt_ids is not None:
        prompts = [Prompt(ids=parse_ids(args.prompt_ids), id="prompt-ids")]
    elif args.prompt is not None:
        if not args.prompt.strip():
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
    for i, p in enumerate(prompts):
        if p.ids is not None:
            bad = [t for t in p.ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise UsageError(f"{prompt_label(p, i)}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        else:
            if mask_id is not None:
                check_mask_in_text(p, tokenizer, mask_id, i)
            p.ids = encode(tokenizer, p.text, args.raw)
    return prompts


def check_device(name: str, device: str) -> torch.device:
    """``torch.device`` of a ``--device``-style option; ``UsageError`` if unknown or absent here."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"{name} {device!r} is not a device name (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{name} {device}: no CUDA device is available (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{name} {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UsageError(f"{name} {device}: only cpu and cuda devices are supported")
    return dev


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


def decode_config(args, target_config) -> DecodeConfig:
    """The target's :class:`DecodeConfig` from the options (checked first with flag names)."""
    B = args.block_length if args.block_length is not None else (target_config.block_size or 4)
    check_block_options(args, B, target_config.max_position_embeddings)
    cfg = DecodeConfig(
        block_length=B, steps=args.steps, strategy=args.strategy, threshold=args.threshold,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        max_new_tokens=args.max_new_tokens, seed=args.seed or 0, fold_commit=args.fold_commit,
    )
    if args.block_length is not None and args.block_length != target_config.block_size:
        print(f"simsd: warning: --block-length {args.block_length} differs from the checkpoint's block_size "
              f"{target_config.block_size} (SDAR checkpoints are trained for one block length)", file=sys.stderr)
    return cfg


def check_engine_args(args, device: str) -> None:
    """``UsageError`` for engine options this machine or build cannot honour."""
    tp = getattr(args, "tp", 1)
    if tp > 1:
        from ..engine.tp import world
        if world()[1] != tp:
            raise UsageError(f"--tp {tp}: this process group has {world()[1]} rank(s); launch with torchrun "
                             f"--nproc-per-node {tp} or let simsd spawn the ranks")
    if getattr(args, "cuda_graphs", False):
        if getattr(args, "invariant", False):
            raise UsageError("--invariant is not available with --cuda-graphs (the graph runner does not run "
                             "the per-unit path)")
        devices = {device, args.draft_device or device}
        if any(torch.device(d).type != "cuda" for d in devices) or not torch.cuda.is_available():
            raise UsageError(f"--cuda-graphs needs CUDA devices, got {', '.join(sorted(devices))}")


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
    stop_ids: list = field(default_factory=list)


def modes_of(args) -> list:
    """The decoding modes of a command (``--mode``, or bench's ``--modes``)."""
    if getattr(args, "command", "generate") != "bench":
        return [args.mode]
    if getattr(args, "mode", None) is not None:
        raise UsageError("simsd bench takes --modes (comma-separated), not --mode")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("vanilla", "paper", "exact")]
    if bad:
        raise UsageError(f"unknown mode(s) in --modes: {', '.join(bad)} (choose from vanilla, paper, exact)")
    if not modes:
        raise UsageError("--modes names no mode (choose from vanilla, paper, exact)")
    if len(set(modes)) != len(modes):
        raise UsageError(f"--modes names a mode twice: {args.modes}")
    return modes


def prepare(args, modes: list) -> Run:
    """Check a command's options, devices, checkpoints (without weights), prompts and memory;
    see the module doc. Raises :class:`UsageError` / :class:`CheckpointError`."""
    from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..engine.threads import apply_threads
    from .encoding import role_markers
    check_options(args, modes)
    device, dtype = resolve_device_dtype(args)
    if getattr(args, "tp", 1) > 1:
        from ..engine.tp import rank_device
        device = rank_device(args.device)
    check_engine_args(args, device)
    speculative = any(m != "vanilla" for m in modes)
    draft_device = (args.draft_device or device) if speculative else None
    dense = {d: dense_attention(args.attention_backend, d) for d in {device, draft_device} if d is not None}
    target = read_checkpoint(args.target or DEFAULT_TARGET)
    draft = read_checkpoint(args.draft or DEFAULT_DRAFT) if speculative else None
    if draft is not None:
        from ..speculative.decoder import check_pair
        try:
            check_pair(target, draft)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    apply_threads([c.config for c in (target, draft) if c is not None], getattr(args, "threads", None))
    cfg = decode_config(args, target.config)
    if args.limit is None and getattr(args, "command", "generate") == "bench" and args.prompts_file is None \
            and args.prompt is None and args.prompt_ids is None:
        args.limit = 8
        args.prompt_set = args.prompt_set or "bundled"
    prompts = collect_prompts(args, target.tokenizer, target.config.vocab_size, target.mask_token_id)
    check_prompts(prompts, [m for m in (target, draft) if m is not None], cfg, target.mask_token_id)
    stop_ids = list(target.stop_ids)
    texts = [p for p in prompts if p.text is not None]
    tok = target.tokenizer
    if texts and not args.raw and tok is not None:
        if getattr(tok, "chat_template", None):  # a new turn's role marker ends the answer, as a stop id does
            stop_ids = sorted(set(stop_ids) | (set(role_markers(tok)) - {target.mask_token_id}))
        else:
            print(f"simsd: note: {target.path.name} has no chat template; text prompts are used as they are",
                  file=sys.stderr)
    from .resources import RunShape, check_run_memory
    models = {"target": (target.config, dtype, device, dense[device])}
    if draft is not None:
        models["draft"] = (draft.config, dtype, draft_device, dense[draft_device])
    check_run_memory(RunShape(models, [len(p.ids) for p in prompts], cfg.max_new_tokens, cfg.block_length,
                              args.gamma, min(args.batch_size, len(prompts)), modes))
    return Run(args, modes, device, draft_device, dtype, target, draft, cfg, prompts, stop_ids)


def loading_line(run: Run) -> str:
    from ..engine.memory import parameter_count
    parts = [f"{role} {info.path.name} ({parameter_count(info.config) / 1e6:.1f}M parameters, {dev})"
             for role, info, dev in (("target", run.target, run.device), ("draft", run.draft, run.draft_device))
             if info is not None]
    return (f"simsd: loading {' and '.join(parts)} in {run.dtype}, {torch.get_num_threads()} CPU "
            f"thread{'s' if torch.get_num_threads() > 1 else ''}")


def load_models(run: Run):
    """Load the prepared checkpoints' weights (one line on stderr); returns ``(target, draft)``."""
    from ..engine.tp import world
    args = run.args
    if world()[0] == 0:
        print(loading_line(run), file=sys.stderr, flush=True)
    target = load_checkpoint(run.target.path, dtype=run.dtype, device=run.device, info=run.target)
    target.model.attention_backend = args.attention_backend
    target = dataclasses.replace(target, stop_ids=run.stop_ids)
    target.model.invariant = getattr(args, "invariant", False)
    tp = getattr(args, "tp", 1)
    if tp > 1:
        from ..engine.tp import shard_model
        shard_model(target.model, world()[0], tp)
    draft = None
    if run.draft is not None:
        draft = load_checkpoint(run.draft.path, dtype=run.dtype, device=run.draft_device, info=run.draft)
        draft.model.attention_backend = args.attention_backend
    return target, draft


def spec_config(mode: str, args):
    from ..speculative.decoder import SpecConfig
    return SpecConfig(mode=mode, gamma=args.gamma, on_reject=args.on_reject or "redraft",
                      rope_copy=not args.no_rope_copy, draft_strategy=args.draft_strategy,
                      draft_threshold=args.draft_threshold,
                      optimistic={None: None, "auto": None, "on": True, "off": False}[getattr(args, "optimistic", None)])


def make_batch_decoder(mode: str, args, target, draft, cfg: DecodeConfig):
    """A callable ``(prompts, first_index) -> BatchResult`` for ``mode`` (prompt ``first_index + i``
    of the set samples with ``cfg.seed + first_index + i``)."""
    graphs = getattr(args, "cuda_graphs", False)
    if mode == "vanilla":
        from ..decoding.vanilla import vanilla_generate_batch
        return lambda prompts, first: vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                             target.stop_ids, first, cuda_graphs=graphs)
    from ..speculative.decoder import speculative_generate_batch
    spec = spec_config(mode, args)
    return lambda prompts, first: speculative_generate_batch(target, draft, prompts, cfg, spec, first,
                                                             cuda_graphs=graphs)


def summary_line(stats: dict) -> str:
    line = (f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['decode_seconds']:.3f} s "
            f"({stats['tokens_per_second']:.1f} tokens/s), target forwards/token "
            f"{stats['target_forwards'] / max(stats['new_tokens'], 1):.3f}")
    if "acceptance_rate" in stats:
        line += (f", acceptance {stats['acceptance_rate']:.3f}, draft share {stats['draft_share']:.3f}, "
                 f"accepted/round {stats['accepted_per_round']:.2f}")
    return line


def decode_text(tokenizer, ids, stop_ids) -> str | None:
    if tokenizer is None:
        return None
    if ids and ids[-1] in set(stop_ids):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def run_generate(args) -> int:
    run = prepare(args, [args.mode])
    target, draft = load_models(run)
    prompts, cfg = run.prompts, run.cfg
    decoder = make_batch_decoder(args.mode, args, target, draft, cfg)
    n = min(args.batch_size, len(prompts))
    if n < args.batch_size:
        print(f"simsd: --batch-size {args.batch_size} > {len(prompts)} prompts: batches of {n}", file=sys.stderr)
    chunks = [(i, prompts[i:i + n]) for i in range(0, len(prompts), n)]
    from tqdm import tqdm
    for first, chunk in tqdm(chunks, disable=len(chunks) < 2, file=sys.stderr, desc=args.mode):
        batch = decoder([p.ids for p in chunk], first)
        for prompt, result in zip(chunk, batch.results):
            text = decode_text(target.tokenizer, result.token_ids, target.stop_ids)
            if args.json:
                print(json.dumps({"id": prompt.id, "prompt": prompt.text, "text": text, "token_ids": result.token_ids,
                                  "stats": result.stats}), flush=True)
            else:
                if len(prompts) > 1:
                    print(f"### {prompt.id}")
                print(text if text is not None else " ".join(map(str, result.token_ids)))
                print(summary_line(result.stats), flush=True)
        if len(chunk) > 1 and not args.json:
            s = batch.stats
            print(f"[batch of {s['batch_size']}] {s['new_tokens']} tokens in {s['decode_seconds']:.3f} s "
                  f"({s['tokens_per_second']:.1f} tokens/s)", flush=True)
    return 0
