"""``simsd generate`` and the preparation it shares with ``simsd bench``: a thin layer over the
Python API (:class:`~simsd.entrypoints.api.LLM`), which turns the options into tokens.

A run is prepared in an order that fails early and cheaply (:func:`prepare`): option values
and combinations (:func:`simsd.entrypoints.cli.check_options`), the prompt sources (read, not
encoded), then as the API checks an engine (:func:`simsd.entrypoints.builder.check_engine`)
devices, attention backends, the checkpoints' small files and tensor headers (no weights), the
block length, then the request settings against them (:func:`simsd.decoding.config.resolve`,
as for every request of the API), every prompt (encoded as the API encodes it,
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
import warnings
from dataclasses import dataclass

import torch

from ..config.engine import EngineArgs
from ..config.request import SEED_MAX, SamplingParams
from ..config.speculative import is_self_draft
from ..config.vocabulary import ParamError, opt
from ..decoding.config import DecodeConfig, resolve
from ..models.loading import CheckpointInfo
from .api import LLM
from .arguments import warn_without_effect
from .builder import check_engine, default_params_of
from .errors import SimsdWarning
from .run_modes import RUN_MODES


def parse_ids(text: str) -> list[int]:
    items = text.replace(" ", "").split(",")
    try:
        if any(t == "" for t in items):
            raise ValueError("an empty item")
        return [int(t) for t in items]
    except ValueError as exc:
        raise ParamError("prompt_ids", f"{opt('prompt_ids')} must be comma-separated integers, got {text!r}") from exc


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
    return {"prompt": opt("prompt"), "prompt-ids": opt("prompt_ids")}.get(p.id, f"prompt {p.id or i + 1}")


def read_prompts(args) -> list:
    """The prompts of a command as :class:`simsd.entrypoints.prompts.Prompt` objects, read (not
    yet encoded: :func:`encode_prompts`). Sources: ``--prompt-ids``, ``--prompt``,
    ``--prompts-file``, ``--prompt-set`` (bundled held-out prompts, or CHAMP / HumanEval
    held-out problems from their packages); with none of them, the first bundled held-out
    prompt (``simsd bench``: 8 of them)."""
    from .prompts import Prompt, load_prompts, read_jsonl
    if args.limit is None and args.command == "bench" and args.prompts_file is None \
            and args.prompt is None and args.prompt_ids is None:
        args.limit = 8
        args.prompt_set = args.prompt_set or "bundled"
    if args.prompt_ids is not None:
        prompts = [Prompt(ids=parse_ids(args.prompt_ids), id="prompt-ids")]
    elif args.prompt is not None:
        if not args.prompt:  # whitespace is text, taken as it is (as the API and the server take it)
            raise ParamError("prompt", f"{opt('prompt')} is empty")
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
    if args.raw and all(p.ids is not None for p in prompts):
        raise ParamError("raw", f"{opt('raw')} applies to text prompts; these prompts are token ids (they bypass "
                                f"the tokenizer and its chat template)")
    return prompts


def encode_prompts(prompts: list, args, tokenizer, mask_id: int) -> list:
    """``prompts`` with ``ids`` and ``request`` (the form given to the API, :func:`request_form`)
    set: texts get the chat template unless ``--raw``, encoded by
    :func:`simsd.entrypoints.encoding.encode_prompt` (a text that spells the mask token is
    refused there); the ids are checked against the models by :func:`check_prompts`."""
    from .encoding import ChatTemplateError, encode_prompt
    for i, p in enumerate(prompts):
        p.request = request_form(p, tokenizer, args.raw)
        try:
            p.ids, _ = encode_prompt(p.request, tokenizer, mask_id)
        except ChatTemplateError as exc:
            raise ParamError("raw", f"{exc}; pass {opt('raw')} to use the text as it is") from exc
        except ParamError as exc:
            raise exc.of(prompt_label(p, i)) from exc
    return prompts


def check_prompts(prompts: list, models: list, cfg: DecodeConfig, mask_id: int | None = None) -> None:
    """Check every prompt against every model (objects with ``.config``: checkpoints or
    :class:`CheckpointInfo`) before anything is decoded; the error names the prompt."""
    from ..decoding.config import check_prompt
    for i, p in enumerate(prompts):
        for m in models:
            try:
                check_prompt(p.ids, m.config, cfg.max_new_tokens, cfg.block_length, mask_id=mask_id)
            except ParamError as exc:
                raise exc.of(prompt_label(p, i)) from exc


def vanilla_params(params: SamplingParams) -> SamplingParams:
    """``params`` without the draft's settings (a vanilla run next to speculative ones in bench)."""
    return dataclasses.replace(params, gamma=None, draft_strategy=None, draft_threshold=None)


@dataclass
class Run:
    """A prepared run: everything checked, nothing but small files read. ``config``: the
    engine's settings as :func:`~simsd.entrypoints.builder.check_engine` resolved them."""
    args: object
    modes: list
    config: EngineArgs
    target: CheckpointInfo
    draft: CheckpointInfo | None
    cfg: DecodeConfig
    prompts: list
    params: SamplingParams

    def params_of(self, mode: str) -> list:
        """The :class:`SamplingParams` of every prompt in ``mode``: prompt ``i`` samples with the
        seed ``(--seed + i) mod 2**63`` (whatever the batch size)."""
        base = self.params if mode != "vanilla" else vanilla_params(self.params)
        seed = base.seed or 0
        return [dataclasses.replace(base, seed=(seed + i) % (SEED_MAX + 1)) for i in range(len(self.prompts))]


def prepare(args, modes: list) -> Run:
    """Check a command's devices, checkpoints (without weights), request settings against them,
    prompts and memory (its options were checked by :func:`simsd.entrypoints.cli.check_options`);
    see the module doc. ``modes``: the run's ``--modes`` labels
    (:data:`~simsd.entrypoints.run_modes.RUN_MODES`; ``generate``: its ``--mode``). Raises
    :class:`ParamError` / :class:`CheckpointError`."""
    from simsd_kernels.backends import resolve_backend

    from ..engine.threads import apply_threads
    from .resources import RunShape, check_run_memory
    prompts = read_prompts(args)  # (a prompt file's errors before the checkpoints are read)
    config, infos = check_engine(args.engine)
    target, draft = infos["target"], infos.get("draft")
    threads = config.threads
    if threads is not None and threads > (os.cpu_count() or 1):
        warnings.warn(f"{args.typed.get('threads', '--threads')} {threads} exceeds this machine's "
                      f"{os.cpu_count()} CPU cores (oversubscribed threads wait for each other)", SimsdWarning)
    apply_threads([c.config for c in infos.values()], threads)
    if args.command == "generate":  # the options not typed: the target's generation config (bench, eval: simsd's)
        args.params = default_params_of(config, target, args.params, args.typed)
        warn_without_effect(args, args.params, config)
    cfg = resolve(args.params, config, target.config.vocab_size)[0]
    encode_prompts(prompts, args, target.tokenizer, target.mask_token_id)
    check_prompts(prompts, list(infos.values()), cfg, target.mask_token_id)
    tok = target.tokenizer
    if any(p.text is not None for p in prompts) and not args.raw and not getattr(tok, "chat_template", None):
        print(f"simsd: note: {target.path.name} has no chat template; text prompts are used as they are",
              file=sys.stderr)
    models = {}
    for role, device in (("target", config.device), ("draft", config.draft_device)):
        if role in infos:
            dense = resolve_backend(config.attention_backend or "auto", device).name == "torch"
            models[role] = (infos[role].config, config.dtype, str(device), dense)
    if len(prompts) < config.batch_size:
        print(f"simsd: {args.typed.get('batch_size', '--batch-size')} {config.batch_size} > {len(prompts)} "
              f"prompts: batches of {len(prompts)}", file=sys.stderr)
    engines = [RUN_MODES[m]._replace(draft=RUN_MODES[m].draft or config.draft) for m in modes]
    check_run_memory(RunShape(models, [len(p.ids) for p in prompts], cfg.max_new_tokens, cfg.block_length,
                              args.params.gamma, min(config.batch_size, len(prompts)), engines,
                              config.speculation_width))
    return Run(args, modes, config, target, draft, cfg, prompts, args.params)


def loading_line(run: Run) -> str:
    from ..engine.memory import parameter_count
    devices = (("target", run.target, run.config.device), ("draft", run.draft, run.config.draft_device))
    parts = [f"{role} {info.path.name} ({parameter_count(info.config) / 1e6:.1f}M parameters, {dev})"
             for role, info, dev in devices if info is not None]
    from ..engine.tp import world
    tp = world()[1]
    sharded = f", the target tensor-parallel over {tp} ranks" if tp > 1 else ""
    return (f"simsd: loading {' and '.join(parts)} in {run.config.dtype}, {torch.get_num_threads()} CPU "
            f"thread{'s' if torch.get_num_threads() > 1 else ''}{' per rank' if tp > 1 else ''}{sharded}")


def build_llm(run: Run, mode: str, loaded: dict | None = None) -> LLM:
    """The :class:`~simsd.entrypoints.api.LLM` of a prepared run in ``mode``: ``--batch-size``
    rows (at most one per prompt) of the positions the longest prompt needs, the caches sized
    for the run's ``--gamma``, the scheduler on this thread. ``loaded``: checkpoints loaded by an
    LLM of another mode, to share (``{"target": ..., "draft": ...}``; updated with those this
    one loads). The first LLM of a run says on stderr what it loads."""
    from ..engine.tp import world
    loaded = {} if loaded is None else loaded
    if not loaded and world()[0] == 0:
        print(loading_line(run), file=sys.stderr, flush=True)
    config, spec, block_length = run.config, mode != "vanilla", run.cfg.block_length
    limit = min(m.config.max_position_embeddings for m in (run.target, run.draft) if m is not None)
    need = max(len(p.ids) for p in run.prompts) + run.cfg.max_new_tokens
    own = spec and not is_self_draft(config.draft)  # a draft model of its own
    draft = config.draft if is_self_draft(config.draft) else loaded.get("draft", run.draft)
    config = dataclasses.replace(
        config, target=loaded.get("target", run.target), draft=draft if spec else None,
        mode=mode, draft_device=config.draft_device if own else None,
        on_reject=config.on_reject if spec else "redraft",
        rope_copy=config.rope_copy or mode != "paper", optimistic=config.optimistic if own else None,
        speculation_width=config.speculation_width if mode == "exact" else "auto",
        paper_variant=config.paper_variant if mode == "paper" else "described",
        max_gamma=run.params.gamma if spec else None, batch_size=min(config.batch_size, len(run.prompts)),
        max_model_len=min(limit, max(need, block_length + 1)), max_waiting=len(run.prompts), scheduler_thread=False)
    llm = LLM.from_config(config)
    loaded.update({"target": llm.target, **({"draft": llm.draft} if llm.draft is not None else {})})
    return llm


def build_llms(run: Run, labels: list, loaded: dict | None = None) -> dict:
    """``{label: LLM}``: one :func:`build_llm` per ``--modes`` label
    (:data:`~simsd.entrypoints.run_modes.RUN_MODES`: its mode, paper variant and draft), the
    checkpoints loaded once and shared (``loaded``, as in :func:`build_llm`)."""
    loaded = {} if loaded is None else loaded
    out = {}
    for label in labels:
        rm = RUN_MODES[label]
        own = {} if rm.draft is None else {"draft": rm.draft, "draft_device": None, "optimistic": None,
                                           "speculation_width": getattr(run.args, "self_width", "auto")
                                           if not is_self_draft(run.config.draft) else run.config.speculation_width}
        config = dataclasses.replace(run.config, paper_variant=rm.paper_variant or run.config.paper_variant, **own)
        out[label] = build_llm(dataclasses.replace(run, config=config), rm.mode, loaded)
    return out


def summary_line(stats: dict) -> str:
    line = (f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['decode_seconds']:.3f} s "
            f"({stats['tokens_per_second']:.1f} tokens/s), target forwards/token "
            f"{stats['target_forwards'] / max(stats['new_tokens'], 1):.3f}")
    if "acceptance_rate" in stats:
        line += (f", acceptance {stats['acceptance_rate']:.3f}, draft share {stats['draft_share']:.3f}, "
                 f"accepted/round {stats['accepted_per_round']:.2f}")
    return line


def print_output(prompt, out, args, many: bool) -> None:
    """One prompt's result as ``simsd generate`` prints it: a JSON line with ``--json``, else
    its text (``### id`` first when the run has several prompts) and its statistics."""
    if args.json:
        print(json.dumps({"id": prompt.id, "prompt": prompt.text, "text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                          "stats": out.stats}), flush=True)
        return
    if many:
        print(f"### {prompt.id}")
    print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    print(summary_line(out.stats), flush=True)


def run_generate(args) -> int:
    from ..engine.scheduler import decode_span
    run = prepare(args, [args.mode])
    llm = build_llm(run, args.mode)
    prompts, n = run.prompts, llm.batch_size
    outs = []
    for prompt, out in zip(prompts, llm.generate_iter([p.request for p in prompts], run.params_of(args.mode),
                                                      use_tqdm=len(prompts) > n)):
        outs.append(out)
        print_output(prompt, out, args, len(prompts) > 1)
    if n > 1 and not args.json:  # the run as a whole: its tokens over its decode time
        tokens, seconds = sum(len(o.token_ids) for o in outs), decode_span(outs)
        print(f"[{len(prompts)} prompts, batch size {n}] {tokens} tokens in {seconds:.3f} s "
              f"({tokens / seconds if seconds > 0 else float('nan'):.1f} tokens/s)", flush=True)
    return 0
