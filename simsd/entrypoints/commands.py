"""Implementation of the ``simsd generate`` and ``simsd bench`` commands."""
from __future__ import annotations

import json
import sys

import torch

from ..decoding.config import DecodeConfig
from ..decoding.sampling import SamplingParams
from ..models.loading import load_checkpoint
from .errors import UsageError


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc


def encode(tokenizer, text: str, raw: bool) -> list[int]:
    if tokenizer is None:
        raise UsageError("this checkpoint has no tokenizer: pass --prompt-ids or prompt_ids in the JSONL file")
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def collect_prompts(args, tokenizer, vocab_size: int) -> list:
    """The prompts of a command as :class:`simsd.entrypoints.prompts.Prompt` objects with ``ids`` set.

    Sources: ``--prompt-ids``, ``--prompt``, ``--prompts-file``, ``--prompt-set`` (bundled
    held-out prompts, or CHAMP / HumanEval held-out problems from their packages); with none of
    them, the first bundled held-out prompt. Texts get the chat template unless ``--raw``.
    """
    from .prompts import Prompt, load_prompts, read_jsonl
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.limit is not None and (args.prompt is not None or args.prompt_ids is not None):
        raise UsageError("--limit applies to --prompts-file and --prompt-set, not to a single prompt")
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
    for p in prompts:
        if p.ids is not None:
            bad = [t for t in p.ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise UsageError(f"prompt {p.id}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        else:
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


def check_prompts(prompts: list, models: list, cfg: DecodeConfig) -> None:
    """Check every prompt against every model before anything is decoded; the error names the
    prompt (its id, e.g. ``FILE:LINE``)."""
    from ..decoding.config import check_prompt
    for i, p in enumerate(prompts):
        for m in models:
            try:
                check_prompt(p.ids, m.config, cfg.max_new_tokens, cfg.block_length)
            except ValueError as exc:
                raise UsageError(f"prompt {p.id or i + 1}: {exc}") from exc


SPEC_OPTIONS = {"draft": "--draft", "draft_device": "--draft-device", "gamma": "--gamma",
                "on_reject": "--on-reject", "draft_strategy": "--draft-strategy", "optimistic": "--optimistic"}


def check_option_use(args, cfg: DecodeConfig, modes) -> None:
    """Options that the chosen settings would ignore are errors (nothing is silently dropped);
    speculative options are validated here, before any prompt is read."""
    if args.threshold is not None and cfg.strategy not in ("dynamic", "entropy"):
        raise UsageError(f"--threshold applies to the dynamic and entropy strategies, not {cfg.strategy}")
    if not {"paper", "exact"} & set(modes):
        given = [flag for key, flag in SPEC_OPTIONS.items() if getattr(args, key, None) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: used by the paper and exact modes only (this run is vanilla)")
    if args.gamma is not None and args.gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {args.gamma}")
    if args.draft_strategy is not None:
        from ..decoding.strategies import parse_strategy
        parse_strategy(args.draft_strategy)
    if args.no_rope_copy and "paper" not in modes:
        raise UsageError("--no-rope-copy is an ablation of paper mode")
    if args.gamma is not None and args.gamma > cfg.block_length:
        raise UsageError(f"--gamma {args.gamma} exceeds the block length {cfg.block_length} "
                         f"(a block is finished in at most {cfg.block_length} steps)")


def decode_config(args, target_config) -> DecodeConfig:
    if args.block_length is not None and args.block_length < 1:
        raise UsageError(f"--block-length must be >= 1, got {args.block_length}")
    B = args.block_length if args.block_length is not None else (target_config.block_size or 4)
    limit = target_config.max_position_embeddings
    if B >= limit:
        raise UsageError(f"--block-length {B} leaves no room in the model's maximum length {limit}")
    cfg = DecodeConfig(
        block_length=B, steps=args.steps, strategy=args.strategy, threshold=args.threshold,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        max_new_tokens=args.max_new_tokens, seed=args.seed, fold_commit=args.fold_commit,
    )
    if args.block_length is not None and args.block_length != target_config.block_size:
        print(f"simsd: warning: --block-length {args.block_length} differs from the checkpoint's block_size "
              f"{target_config.block_size} (SDAR checkpoints are trained for one block length)", file=sys.stderr)
    return cfg


def check_engine_args(args, device: str) -> None:
    """``UsageError`` for engine options this machine or build cannot honour."""
    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if tp > 1:
        from ..engine.tp import world
        if world()[1] != tp:
            raise UsageError(f"--tp {tp}: this process group has {world()[1]} rank(s); launch with torchrun "
                             f"--nproc-per-node {tp} or let simsd spawn the ranks")
    if getattr(args, "batch_size", 1) < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if getattr(args, "cuda_graphs", False):
        if getattr(args, "invariant", False):
            raise UsageError("--invariant is not available with --cuda-graphs (the graph runner does not run "
                             "the per-unit path)")
        devices = {device, args.draft_device or device}
        if any(torch.device(d).type != "cuda" for d in devices) or not torch.cuda.is_available():
            raise UsageError(f"--cuda-graphs needs CUDA devices, got {', '.join(sorted(devices))}")


def load_models(args, need_draft: bool):
    from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
    device, dtype = resolve_device_dtype(args)
    tp = getattr(args, "tp", 1)
    if tp > 1:
        from ..engine.tp import rank_device
        device = rank_device(args.device)
    check_engine_args(args, device)
    target = load_checkpoint(args.target or DEFAULT_TARGET, dtype=dtype, device=device)
    target.model.attention_backend = args.attention_backend
    target.model.invariant = getattr(args, "invariant", False)
    if tp > 1:
        from ..engine.tp import shard_model, world
        shard_model(target.model, world()[0], tp)
    draft = None
    if need_draft:
        draft = load_checkpoint(args.draft or DEFAULT_DRAFT, dtype=dtype, device=args.draft_device or device)
        draft.model.attention_backend = args.attention_backend
    return target, draft


def make_batch_decoder(mode: str, args, target, draft, cfg: DecodeConfig):
    """A callable ``(prompts, first_index) -> BatchResult`` for ``mode`` (prompt ``first_index + i``
    of the set samples with ``cfg.seed + first_index + i``)."""
    graphs = getattr(args, "cuda_graphs", False)
    if mode == "vanilla":
        from ..decoding.vanilla import vanilla_generate_batch
        return lambda prompts, first: vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                             target.stop_ids, first, cuda_graphs=graphs)
    from ..speculative.decoder import SpecConfig, speculative_generate_batch
    spec = SpecConfig(mode=mode, gamma=args.gamma, on_reject=args.on_reject or "redraft",
                      rope_copy=not args.no_rope_copy, draft_strategy=args.draft_strategy,
                      optimistic={None: None, "auto": None, "on": True, "off": False}[getattr(args, "optimistic", None)])
    return lambda prompts, first: speculative_generate_batch(target, draft, prompts, cfg, spec, first,
                                                             cuda_graphs=graphs)


def summary_line(stats: dict) -> str:
    line = (f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['decode_seconds']:.3f} s "
            f"({stats['tokens_per_second']:.1f} tokens/s), target forwards/token "
            f"{stats['target_forwards'] / max(stats['new_tokens'], 1):.3f}")
    if "acceptance_rate" in stats:
        line += (f", acceptance {stats['acceptance_rate']:.3f}, accepted/round "
                 f"{stats['accepted_per_round']:.2f}")
    return line


def decode_text(tokenizer, ids, stop_ids) -> str | None:
    if tokenizer is None:
        return None
    if ids and ids[-1] in set(stop_ids):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def run_generate(args) -> int:
    target, draft = load_models(args, need_draft=args.mode != "vanilla")
    cfg = decode_config(args, target.config)
    check_option_use(args, cfg, [args.mode])
    prompts = collect_prompts(args, target.tokenizer, target.config.vocab_size)
    check_prompts(prompts, [m for m in (target, draft) if m is not None], cfg)
    decoder = make_batch_decoder(args.mode, args, target, draft, cfg)
    n = args.batch_size
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

