"""Quality evidence for the bundled tiny SDAR pair (written up in ``tools/TRAINING.md``).

    python tools/eval_tiny_sdar.py [--target DIR] [--draft DIR] [--prompts N] [--json OUT]

* held-out loss of both models: the training objective (``tools/train_tiny_sdar.py``) on the
  held-out CHAMP / HumanEval chat documents, fixed noise seed, float32 weights as loaded by
  :func:`simsd.models.loading.load_checkpoint` from the bf16 files;
* greedy vanilla continuations (``simsd.decoding.vanilla.vanilla_generate``, static strategy,
  ``max_new_tokens=64``) of three held-out prompts in the chat template;
* draft/target agreement: vanilla greedy decoding with the target; at every denoising step the
  draft sees the same block state (over its own cache of the same committed tokens) and we count
  the positions the target reveals at which the draft's argmax equals the target's token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from simsd.decoding.config import DecodeConfig, check_prompt  # noqa: E402
from simsd.decoding.layouts import RowLayouts  # noqa: E402
from simsd.decoding.step import denoise_step  # noqa: E402
from simsd.decoding.vanilla import vanilla_generate  # noqa: E402
from simsd.engine.batching import BatchEngine, round_capacity  # noqa: E402
from simsd.engine.scheduler import Request, run_requests  # noqa: E402
from simsd.entrypoints.prompts import bundled_prompts  # noqa: E402
from simsd.models.loading import load_checkpoint  # noqa: E402

ASSETS = ROOT / "simsd" / "assets"


def chat_ids(tok, text: str) -> list:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def heldout_loss_of(ck, L: int = 256) -> tuple[float, int]:
    import bd_objective
    import corpus

    import train_tiny_sdar as T

    docs = corpus.documents("heldout")
    tok, eot = ck.tokenizer, ck.tokenizer.eos_token_id
    streams = {}
    for name, texts in docs.items():
        ids = []
        for d in texts:
            ids.extend(tok(d, add_special_tokens=False)["input_ids"] + [eot])
        streams[name] = {"ids": torch.tensor(ids)}
    windows = T.heldout_windows(streams, L)
    return bd_objective.heldout_loss(ck.model, windows, ck.config.block_size, ck.mask_token_id), len(windows)


def agreement(target, draft, prompt_ids: list, cfg: DecodeConfig) -> dict:
    """Greedy vanilla target decoding; compare the draft's argmax on the same block states (one
    :mod:`simsd.engine.batching` row holding both models' caches of the same committed tokens)."""
    block_length = cfg.block_length
    cap = check_prompt(prompt_ids, target.model.config, cfg.max_new_tokens, block_length)
    engine = BatchEngine({"target": target.model, "draft": draft.model}, block_length, 1, round_capacity(cap),
                         2 * block_length)
    mask_id, stops = target.mask_token_id, set(target.stop_ids)
    c = {"same": 0, "total": 0, "same_all_masked": 0, "total_all_masked": 0}

    def program(row, tail):
        row, generated = RowLayouts(row), []
        while True:
            block = torch.tensor(list(tail) + [mask_id] * (block_length - len(tail)), device=target.model.device)
            first, tail, step = len(block) - int((block == mask_id).sum()), [], 0
            while bool((block == mask_id).any()):
                t_logits = yield row.denoise("target", block)
                d_logits = yield row.denoise("draft", block)
                masked = block == mask_id
                d_arg, t_arg = d_logits.argmax(-1), t_logits.argmax(-1)
                block, revealed, _ = denoise_step(t_logits, block, mask_id, cfg, step, None)
                c["same"] += int((d_arg[revealed] == block[revealed]).sum())
                c["total"] += int(revealed.sum())
                c["same_all_masked"] += int((d_arg[masked] == t_arg[masked]).sum())
                c["total_all_masked"] += int(masked.sum())
                step += 1
            new = block[first:].tolist()
            generated.extend(new)
            if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
                return generated
            yield row.commit("target", block)
            yield row.commit("draft", block)

    req = Request(prompt_ids, program, cap)
    run_requests(engine, [req])
    return dict(c, tokens=req.result)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(ASSETS / "tiny-sdar-target"))
    ap.add_argument("--draft", default=str(ASSETS / "tiny-sdar-draft"))
    ap.add_argument("--prompts", type=int, default=20, help="bundled held-out prompts for the agreement")
    ap.add_argument("--samples", default="0,1,10", help="indices of the bundled prompts to print")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_checkpoint(args.target, dtype="float32"), load_checkpoint(args.draft, dtype="float32")
    for ck in (target, draft):
        ck.model.attention_backend = "torch"
    tok = target.tokenizer
    report = {"heldout_loss": {}}
    for name, ck in (("target", target), ("draft", draft)):
        loss, n = heldout_loss_of(ck)
        report["heldout_loss"][name] = loss
        print(f"held-out loss {name}: {loss:.3f} ({n} windows of 256 tokens)", flush=True)
    cfg = DecodeConfig(block_length=target.config.block_size, strategy="static", max_new_tokens=args.max_new_tokens)
    prompts = bundled_prompts()
    report["samples"] = []
    for i in [int(x) for x in args.samples.split(",")]:
        p = prompts[i]
        for name, ck in (("target", target), ("draft", draft)):
            res = vanilla_generate(ck.model, chat_ids(tok, p.text), cfg, ck.mask_token_id, ck.stop_ids)
            text = tok.decode(res.token_ids)
            report["samples"].append({"id": p.id, "model": name, "prompt": p.text, "continuation": text,
                                      "tokens_per_second": res.stats["tokens_per_second"]})
            print(f"--- {p.id} [{name}] ({res.stats['new_tokens']} tokens, "
                  f"{res.stats['tokens_per_second']:.0f} tok/s)\n{text}", flush=True)
    t0 = time.time()
    agg = {"same": 0, "total": 0, "same_all_masked": 0, "total_all_masked": 0}
    for p in prompts[:args.prompts]:
        ids = chat_ids(tok, p.text)
        r = agreement(target, draft, ids, cfg)
        ref = vanilla_generate(target.model, ids, cfg, target.mask_token_id, target.stop_ids).token_ids
        assert r["tokens"][:len(ref)] == ref, "the agreement loop must reproduce vanilla target decoding"
        for k in agg:
            agg[k] += r[k]
    report["agreement"] = dict(agg, prompts=min(args.prompts, len(prompts)),
                               revealed_rate=agg["same"] / max(agg["total"], 1),
                               all_masked_rate=agg["same_all_masked"] / max(agg["total_all_masked"], 1))
    print(f"draft/target greedy agreement at revealed positions: {agg['same']}/{agg['total']} = "
          f"{report['agreement']['revealed_rate']:.3f}; at all masked positions: "
          f"{report['agreement']['all_masked_rate']:.3f} ({time.time() - t0:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return report


if __name__ == "__main__":
    main()
