"""Divergence rate of exact-mode verify copies from denoise forwards (docs/design.md §4.2).

    python bench/bench_invariance.py [--device cuda] [--backends torch,triton,cuda] [--trials 20]
        [--target DIR] [--out bench/results/invariance.jsonl]

For each attention backend available on the device, dtype (bf16, fp16, fp32) and numerics
(``invariant`` off / on), runs ``--trials`` random block states of the target (default: the
bundled tiny target) over a random prefilled cache, once inside an exact verify forward of
``copies`` states and once as a denoise forward of that state alone, and counts the copies whose
logits differ in any bit (``bit_rate``) and whose argmax differs (``argmax_rate``). On the torch
backend with ``invariant`` both rates must be 0 (the tests assert it); on a GPU the Triton / CUDA
kernels and cuBLAS are not promised invariant and this script measures how far they are.
Rows (JSON lines with device, versions, git sha) go to ``--out`` when given.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from simsd import load_checkpoint  # noqa: E402
from simsd.decoding.layouts import exact_layout  # noqa: E402
from simsd.entrypoints.bench import git_sha  # noqa: E402
from simsd.models.model import labels_for  # noqa: E402


def rates(model, B: int, copies: int, trials: int, vocab: int, mask_id: int, device) -> tuple:
    g = torch.Generator().manual_seed(0)
    bits = argmax = total = 0
    for _ in range(trials):
        P = B * int(torch.randint(1, 64, (1,), generator=g))
        cache = model.new_cache(1, P + (copies + 2) * B)
        pos = torch.arange(P, device=device)[None]
        model(torch.randint(0, vocab, (1, P), generator=g).to(device), pos, labels_for(P, device, grp=pos // B),
              "block_causal", cache, num_write=P, logits_slice=None)
        states = []
        for _ in range(copies):
            s = torch.randint(0, vocab, (B,), generator=g)
            states.append(torch.where(torch.rand(B, generator=g) < 0.5, mask_id, s).to(device))
        ids, positions, labels = exact_layout(states, P)
        p = torch.tensor([positions], device=device)
        lab = torch.tensor([labels], dtype=torch.int32, device=device)
        verify = model(ids[None], p, lab, "exact", cache, unit=B)[0].view(copies, B, -1)
        for c, s in enumerate(states):
            alone = model(s[None], p[:, :B], labels_for(B, device), "bidirectional", cache, unit=B)[0]
            total += 1
            bits += int(not torch.equal(alone, verify[c]))
            argmax += int(not torch.equal(alone.argmax(-1), verify[c].argmax(-1)))
    return bits / total, argmax / total, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default="torch,triton,cuda")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--block-length", type=int, default=4)
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.target is None:
        import simsd.assets
        args.target = os.path.join(os.path.dirname(simsd.assets.__file__), "tiny-sdar-target")
    device = torch.device(args.device)
    for backend in args.backends.split(","):
        if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            print("skip triton on the CPU (set TRITON_INTERPRET=1 to interpret it)", file=sys.stderr)
            continue
        for dtype in args.dtypes.split(","):
            ck = load_checkpoint(args.target, dtype=dtype, device=str(device), with_tokenizer=False)
            model = ck.model
            model.attention_backend = backend
            try:  # the model says what its attention runs on
                model.attention_backend_class()
            except ValueError as exc:
                print(f"skip {backend}: {exc}", file=sys.stderr)
                break
            for invariant in (False, True):
                model.invariant = invariant
                bit, am, n = rates(model, args.block_length, args.copies, args.trials, ck.config.vocab_size,
                                   ck.mask_token_id, device)
                row = {"backend": backend, "dtype": dtype, "invariant": invariant, "copies": n,
                       "bit_rate": bit, "argmax_rate": am, "block_length": args.block_length,
                       "copies_per_forward": args.copies, "device": torch.cuda.get_device_name(device)
                       if device.type == "cuda" else platform.processor() or platform.machine(),
                       "torch": torch.__version__, "git_sha": git_sha()}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
