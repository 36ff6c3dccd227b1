"""What SimSD costs on a mixture-of-experts target, in device-independent counts.

    python bench/bench_moe.py [--modes vanilla,paper,exact] [--drafts bundled,self] [--prompts 4]
        [--max-new-tokens 32] [--block-length 4] [--json F]

Target: a random SDAR-MoE checkpoint (``moe-h256-l4-e64`` of ``bench/benchlib.py``: the bundled
target's attention shape and tokenizer, 4 MoE layers of 64 experts, 8 routed per token, expert
width 96), since no trained MoE checkpoint can be bundled; its routing is a random router's, not a
trained one's. Drafts: ``bundled`` (the bundled tiny dense draft: it does not know the random
target, so nearly every draft step is rejected: the cost side of SimSD) and ``self`` (the target
as its own draft, a second instance of the same weights: every step accepted, the most a
draft could save).

Per mode and draft, single runs (batch 1) over the first ``--prompts`` bundled held-out prompts
(chat template), greedy, static strategy. A forward pre-hook on the target tells its forwards
apart by mask mode: ``denoise`` (``bidirectional``: vanilla's steps and the target's own steps in
SimSD), ``verify`` (``exact`` / ``paper``: one forward checks a round of draft steps) and
``prefill/commit`` (``block_causal``); forward hooks on the routers record the experts every
token chose. Columns: ``tgt fwd/tok`` target forwards per new token (the decoders' own
counter); per forward kind: how many, the mean query tokens and the mean experts touched per
MoE layer (distinct experts any of the forward's tokens was routed to; the weights a MoE forward
reads grow with it, so a verify forward of many copies costs more than a denoise forward of one
block), as a share of the experts too. ``--json F`` writes the rows.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import benchlib  # noqa: E402
from simsd import DecodeConfig, SpecConfig, load_checkpoint, speculative_generate, vanilla_generate  # noqa: E402
from simsd.models.moe import SparseMoeBlock  # noqa: E402

MODES = ("vanilla", "paper", "exact")
DRAFTS = ("bundled", "self")
SHAPE = "moe-h256-l4-e64"
KINDS = {"bidirectional": "denoise", "exact": "verify", "paper": "verify", "block_causal": "prefill/commit"}


class ExpertProbe:
    """Hooks on a target: per forward, its kind (mask mode), query tokens per row and the distinct
    experts each MoE layer's router chose for any of its tokens."""

    def __init__(self, model):
        self.forwards: list = []  # (kind, query tokens, [distinct experts per MoE layer])
        self.handles = [model.register_forward_pre_hook(self._start)]
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._routed))

    def _start(self, module, args):
        ids, mask_mode = args[0], args[3]
        self.forwards.append((KINDS[mask_mode], ids.shape[1], []))

    def _routed(self, module, args, out):
        self.forwards[-1][2].append(int(torch.unique(out[1]).numel()))

    def remove(self):
        for h in self.handles:
            h.remove()


def summarise(forwards: list, num_experts: int) -> dict:
    """Per forward kind: count, mean query tokens, mean distinct experts per MoE layer and their share."""
    by = defaultdict(list)
    for kind, tokens, experts in forwards:
        by[kind].append((tokens, sum(experts) / len(experts)))
    out = {}
    for kind, rows in by.items():
        mean_experts = sum(e for _, e in rows) / len(rows)
        out[kind] = {"forwards": len(rows), "query_tokens": sum(t for t, _ in rows) / len(rows),
                     "experts_touched": mean_experts, "experts_share": mean_experts / num_experts}
    return out


def run(mode: str, target, draft, prompts: list, cfg: DecodeConfig) -> dict:
    probe = ExpertProbe(target.model)
    tokens = target_forwards = accepted = proposed = 0
    try:
        for prompt in prompts:
            if mode == "vanilla":
                r = vanilla_generate(target.model, prompt, cfg, target.mask_token_id, target.stop_ids)
            else:
                r = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode=mode))
                accepted += r.stats["accepted"]
                proposed += r.stats["proposed"]
            tokens += len(r.token_ids)
            target_forwards += r.stats["target_forwards"]
    finally:
        probe.remove()
    E = target.config.num_experts
    return {"new_tokens": tokens, "target_forwards": target_forwards,
            "target_forwards_per_token": target_forwards / max(tokens, 1),
            "acceptance_rate": accepted / proposed if proposed else None,
            "kinds": summarise(probe.forwards, E), "num_experts": E,
            "experts_per_token": target.config.num_experts_per_tok}


def table(rows: list) -> str:
    head = (f"{'mode':8} {'draft':8} {'tgt fwd/tok':>11} {'accept':>6} | {'kind':15} {'fwds':>5} {'q tok':>6} "
            f"{'experts/layer':>13} {'share':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        first = True
        for kind in ("prefill/commit", "denoise", "verify"):
            k = r["kinds"].get(kind)
            if k is None:
                continue
            left = (f"{r['mode']:8} {r['draft']:8} {r['target_forwards_per_token']:11.3f} {acc:>6}" if first
                    else " " * 36)
            lines.append(f"{left} | {kind:15} {k['forwards']:5d} {k['query_tokens']:6.1f} {k['experts_touched']:13.1f} "
                         f"{k['experts_share']:6.2f}")
            first = False
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: vanilla, paper, exact")
    p.add_argument("--drafts", default=",".join(DRAFTS), help="comma-separated: bundled, self")
    p.add_argument("--prompts", type=int, default=4, help="the first N bundled held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--block-length", type=int, default=4)
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    for name, allowed in (("modes", MODES), ("drafts", DRAFTS)):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            p.error(f"--{name}: {', '.join(bad) or 'nothing given'} (choose from {', '.join(allowed)})")
        setattr(args, name, values)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    benchlib.set_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = benchlib.random_checkpoint(Path(tmp) / "moe", SHAPE)
        # the self draft is a second instance, so that the probe on the target sees the target's forwards only
        target, self_draft = (load_checkpoint(path, dtype="float32") for _ in range(2))
    bundled_draft = benchlib.bundled_pair()[1]
    prompts, names = benchlib.prompt_ids(target.tokenizer, args.prompts)
    cfg = DecodeConfig(block_length=args.block_length, strategy="static", max_new_tokens=args.max_new_tokens)
    rows = []
    for mode in args.modes:
        for draft_name in (args.drafts if mode != "vanilla" else ["-"]):
            draft = {"bundled": bundled_draft, "self": self_draft}.get(draft_name)
            row = run(mode, target, draft, prompts, cfg)
            rows.append({"mode": mode, "draft": draft_name, **row})
    print(table(rows))
    if args.json:
        meta = {"shape": SHAPE, "prompts": names, "max_new_tokens": args.max_new_tokens,
                "block_length": args.block_length, "strategy": "static", "temperature": 0.0,
                **benchlib.environment()}
        benchlib.write_json(args.json, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
