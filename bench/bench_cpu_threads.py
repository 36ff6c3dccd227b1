"""CPU intra-op threads: forward latency with 1 thread vs every core, per model size.

The measurement behind simsd's default thread count (``simsd.engine.threads``): for the
bundled tiny pair and larger random SDAR configs, the median latency of a denoise forward
(B = 4 query tokens over a 256-token cache) and of an exact verify forward (5 copies of the
block, 20 query tokens), with ``torch.set_num_threads(n)`` for each n in ``--threads``
(default: 1 and every core). Ratios are the numbers to read (other load on the machine
distorts absolute times; run it on an idle machine, and several times).

    python bench/bench_cpu_threads.py [--threads 1,2] [--reps 30] [--json bench/results/cpu_threads.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from simsd.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from simsd.engine.memory import parameter_count
from simsd.models.config import ModelConfig
from simsd.models.loading import load_model
from simsd.models.model import SDARForCausalLM, labels_for
from simsd.testing import config_dict

LARGER = {  # random weights; only the shapes matter for timing
    "h512-l8": dict(vocab_size=6144, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "h1024-l8": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=128),
}


def models():
    yield "bundled target", load_model(DEFAULT_TARGET)
    yield "bundled draft", load_model(DEFAULT_DRAFT)
    for name, kw in LARGER.items():
        cfg = ModelConfig.from_dict(config_dict(mask_token_id=5, **kw))
        yield name, SDARForCausalLM(cfg).eval()


def latency(model, n_query: int, reps: int) -> float:
    cache = model.new_cache(1, 256 + n_query)
    P = 256
    pos = torch.arange(P)[None]
    ids = torch.randint(0, model.config.vocab_size, (1, P))
    model(ids, pos, labels_for(P, "cpu", grp=pos // 4), "block_causal", cache, num_write=P, logits_slice=None)
    q = torch.randint(0, model.config.vocab_size, (1, n_query))
    qpos = (P + torch.arange(n_query) % 4)[None]
    lab = labels_for(n_query, "cpu", grp=torch.arange(n_query) // 4)
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        model(q, qpos, lab, "exact", cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    rows = []
    with torch.no_grad():
        for name, model in models():
            row = {"model": name, "parameters": parameter_count(model.config)}
            for nq, label in ((4, "denoise"), (20, "verify")):
                for n in counts:
                    torch.set_num_threads(n)
                    row[f"{label}_ms_{n}t"] = 1e3 * latency(model, nq, args.reps)
                row[f"{label}_ratio"] = row[f"{label}_ms_{counts[0]}t"] / row[f"{label}_ms_{counts[-1]}t"]
            rows.append(row)
            print(f"{name:15s} {row['parameters'] / 1e6:7.1f}M params  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("model", "parameters")), flush=True)
    print(f"# ratio = time with {counts[0]} thread(s) / time with {counts[-1]} (> 1: more threads are faster); "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": counts, "torch": torch.__version__, "cores": os.cpu_count(),
                       "loadavg": os.getloadavg()[0], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
