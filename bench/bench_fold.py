"""Does folding a finished block's commit into the next block's first forward change the logits?

    python bench/bench_fold.py [--checkpoint bundled|random] [--dtypes float32,bfloat16]
        [--block-lengths 1,2,4,8] [--states 12] [--json F]

Per setting (dtype, block length ``L``, numerics default or ``--invariant``), on the torch backend,
one thread: a prompt is prefilled; then (a) the commit forward of a clean block X (``L`` tokens,
bidirectional, stored) and the first denoise forward of the next block Y (``L`` tokens, half of
them MASK, not stored), against (b) one block-causal forward of X then Y that stores X and gives
Y's logits (``DecodeConfig.fold_commit``, :meth:`simsd.engine.batching.Row.commit_and_denoise`).
Counted: states whose Y logits are the same bits, states whose cached K of X (first and last
layer) are the same bits, and the largest logit difference; states differ in prompt length
(13, 16, 40, 101 tokens) and random ids. The folded forward has ``2 L`` rows instead of ``L``, so
its matrix products may round differently unless ``--invariant`` runs them per block-sized unit
(docs/design.md §4.2): the measurement behind keeping the fold an option (docs/design.md §3).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import benchlib  # noqa: E402
from simsd import load_checkpoint  # noqa: E402
from simsd_kernels import KIND_KNOWN  # noqa: E402

PROMPT_LENGTHS = (13, 16, 40, 101)


def labels(groups: list) -> torch.Tensor:
    """``(1, len, 3)`` int32 labels of known tokens with the given group ids."""
    return torch.tensor([[(KIND_KNOWN, 0, g) for g in groups]], dtype=torch.int32)


def one_state(model, L: int, prompt_len: int, seed: int) -> tuple:
    """``(logits equal, cache equal, max |difference|)`` of one state, separate vs folded commit."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt, X, Y = (torch.randint(0, V - 10, (1, n), generator=g) for n in (prompt_len, L, L))
    Y[0, L // 2:] = V - 1  # the rest of the block still MASK-like ids
    got = []
    for fold in (False, True):
        cache = model.new_cache(1, prompt_len + 2 * L + 8)
        n = prompt_len
        model(prompt, torch.arange(n)[None], labels([0] * n), "block_causal", cache, n, None, unit=L)
        if fold:
            logits = model(torch.cat([X, Y], 1), torch.arange(n, n + 2 * L)[None], labels([0] * L + [1] * L),
                           "block_causal", cache, L, slice(L, 2 * L), unit=L)
        else:
            model(X, torch.arange(n, n + L)[None], labels([0] * L), "bidirectional", cache, L, None, unit=L)
            logits = model(Y, torch.arange(n + L, n + 2 * L)[None], labels([0] * L), "bidirectional", cache, 0,
                           slice(None), unit=L)
        got.append((logits, [cache.k[i][0, :n + L].clone() for i in (0, -1)]))
    (a, ka), (b, kb) = got
    return torch.equal(a, b), all(torch.equal(x, y) for x, y in zip(ka, kb)), (a - b).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", choices=("bundled", "random"), default="bundled")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--block-lengths", default="1,2,4,8")
    p.add_argument("--states", type=int, default=12, help="states per setting (prompt lengths x seeds)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    benchlib.set_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = benchlib.DEFAULT_TARGET if args.checkpoint == "bundled" else \
            benchlib.random_checkpoint(Path(tmp) / "target", "h512-l8-d128")
        for dtype in args.dtypes.split(","):
            model = load_checkpoint(path, dtype=dtype, with_tokenizer=False).model
            model.attention_backend = "torch"
            for L in (int(x) for x in args.block_lengths.split(",")):
                for invariant in (False, True):
                    model.invariant = invariant
                    res = [one_state(model, L, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], i) for i in range(args.states)]
                    row = {"checkpoint": args.checkpoint, "dtype": dtype, "block_length": L,
                           "numerics": "invariant" if invariant else "default", "states": len(res),
                           "logits_equal": sum(r[0] for r in res), "cache_equal": sum(r[1] for r in res),
                           "max_abs_diff": max(r[2] for r in res)}
                    rows.append(row)
                    n = len(res)
                    print(f"{dtype:<9} L={L:<2} {row['numerics']:<9} logits equal {row['logits_equal']}/{n}  "
                          f"cache equal {row['cache_equal']}/{n}  max diff {row['max_abs_diff']:.3g}", flush=True)
    if args.json:
        benchlib.write_json(args.json, {"script": "bench_fold", **vars(args), **benchlib.environment()}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
