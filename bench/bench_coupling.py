"""Acceptance of coupled step matching (exact mode) against rejection sampling, on one prompt set.

    python bench/bench_coupling.py [--limit 20] [--max-new-tokens 64] [--temperatures 0.7,1.0]
        [--strategy static] [--dtype float32] [--out bench/results/coupling_cpu.json]

Decodes the bundled held-out prompts (chat template) with the bundled tiny pair, for each
temperature, four ways:

* ``vanilla``: the target alone (the reference for identity);
* ``exact``: exact mode, coupled matching: the draft samples with the target's keyed noise and
  a draft step is accepted when it is the target's own step at that state (docs/design.md §4.2);
* ``exact_rs``: the same exact verify forward, each draft token judged on its own by
  speculative rejection sampling against the copy it was revealed from (what exact mode did
  before keyed noise: the reveal order comes from the draft unverified, so it is not exact);
  the draft samples from a stream of its own, fresh every round;
* ``paper``: paper mode (paired layout, rejection sampling).

Per method: ``acceptance`` = accepted / proposed draft tokens (the ``Stats`` counters:
``proposed`` counts the proposals of the draft steps up to the first rejected one),
``committed_per_round`` = generated tokens / verify rounds, ``target_forwards_per_token``,
and ``identical_to_vanilla`` (prompts). Device-independent counters only: no timing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from simsd import DecodeConfig, SamplingParams, load_checkpoint  # noqa: E402
from simsd.decoding.noise import (  # noqa: E402
    ACCEPT,
    RESIDUAL,
    step_noise,  # noqa: E402
    uniform,  # noqa: E402
)
from simsd.decoding.step import denoise_step, without_mask_token_  # noqa: E402
from simsd.decoding.vanilla import vanilla_generate_batch  # noqa: E402
from simsd.entrypoints.bench import git_sha  # noqa: E402
from simsd.entrypoints.prompts import load_prompts  # noqa: E402
from simsd.speculative.decoder import SpecConfig, SpeculativeDecoder  # noqa: E402
from simsd.speculative.verification import accept_in_order, token_verdicts  # noqa: E402
from simsd.speculative.verifiers import ExactVerifier, Verdict  # noqa: E402


class RejectionVerifier(ExactVerifier):
    """Exact verify forward, per-token rejection sampling (the pre-§4.2 rule, for comparison)."""
    rejection_sampling = True

    def request(self, layouts, rnd):
        fwd = super().request(layouts, rnd)
        fwd.step = None  # the judge reads the copies' logits
        return fwd

    def judge(self, rnd, logits):
        draft = rnd.draft
        chain = rnd.layout
        bonus = draft.remaining > 0
        C, L = chain.shape[0] - 1 + int(bonus), chain.shape[1]
        logits = logits.view(C, L, -1)
        at = logits[(draft.tau - 1).clamp(0, draft.n - 1), torch.arange(L, device=logits.device)]
        at = without_mask_token_(at, self.mask_id)
        r = rnd.index
        rng = (uniform([self.key(rnd.start, ACCEPT, r)], 0, L, 1, at.device)[0, :, 0],
               step_noise([self.key(rnd.start, RESIDUAL, r)], 0, L, at.shape[-1], at.device)[0])
        ok, repl = token_verdicts(at, draft.final, draft.probs, self.cfg.sampling, rng)
        new, rejected, taken, acc = accept_in_order(chain[0], draft.final, draft.tau, draft.n, ok, repl)
        if bonus:
            step = rnd.step + draft.n
            noise = step_noise([self.key(rnd.start)], step, L, logits.shape[-1], logits.device)[0]
            mine, _, _ = denoise_step(logits[draft.n], draft.final, self.mask_id, self.cfg, step, noise)
            new = torch.where(rejected, new, mine)
            taken = torch.where(rejected, taken, draft.n + 1)
        return Verdict(new, taken, acc)


def run(target, draft, prompts, cfg, method):
    if method == "vanilla":
        return vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids).results
    dec = SpeculativeDecoder(target, draft, cfg, SpecConfig(mode="paper" if method == "paper" else "exact"))
    if method == "exact_rs":
        dec.verifier_class = RejectionVerifier
    return dec.generate_batch(prompts).results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--strategy", default="static")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import simsd.assets
    root = os.path.dirname(simsd.assets.__file__)
    target = load_checkpoint(os.path.join(root, "tiny-sdar-target"), dtype=args.dtype)
    draft = load_checkpoint(os.path.join(root, "tiny-sdar-draft"), dtype=args.dtype)
    target.model.invariant = True
    tok = target.tokenizer
    chosen = load_prompts("bundled")[: args.limit]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in chosen]
    rows = []
    for T in [float(t) for t in args.temperatures.split(",")]:
        cfg = DecodeConfig(block_length=4, strategy=args.strategy, max_new_tokens=args.max_new_tokens, seed=0,
                           sampling=SamplingParams(temperature=T))
        outs = {}
        for method in ("vanilla", "exact", "exact_rs", "paper"):
            results = []
            for i in range(0, len(prompts), args.batch_size):
                batch = run(target, draft, prompts[i:i + args.batch_size], cfg, method)
                results += batch
            outs[method] = [r.token_ids for r in results]
            tot = lambda k: sum(r.stats.get(k, 0) for r in results)  # noqa: E731
            tokens = tot("new_tokens")
            row = {"temperature": T, "method": method, "prompts": len(results), "new_tokens": tokens,
                   "target_forwards_per_token": tot("target_forwards") / max(tokens, 1),
                   "identical_to_vanilla": sum(a == b for a, b in zip(outs[method], outs["vanilla"]))}
            if method != "vanilla":
                row.update(proposed=tot("proposed"), accepted=tot("accepted"),
                           acceptance=tot("accepted") / max(tot("proposed"), 1),
                           committed_per_round=tokens / max(tot("rounds"), 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        meta = {"strategy": args.strategy, "block_length": 4, "dtype": args.dtype,
                "max_new_tokens": args.max_new_tokens, "prompts": [p.id for p in chosen],
                "torch": torch.__version__, "python": platform.python_version(),
                "git_sha": git_sha(), "seed": 0, "invariant_target": True}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
