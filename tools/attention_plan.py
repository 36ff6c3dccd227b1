"""The split plan of both attention backends on the verify shapes, with a model estimate of the
fraction of copy bandwidth (no GPU involved: static figures only).

    python tools/attention_plan.py [--sms 132] [--bandwidth 4e12] [--fixed-us 3]

Shapes: SDAR-8B (32 / 8 heads) and SDAR-1.7B (16 / 8), head_dim 128, bf16; the SimSD layouts
(denoise / paper / exact at block length 4 and 8) at batch 1, 8, 16, 64 and caches 4k-32k.
Per row: the plan (query tile, splits, least tiles per split), its wave efficiency and partial
traffic, and ``est`` = the fraction of a ``--bandwidth`` copy the launch can reach by the plan's
model -- K/V bytes once at full bandwidth, stretched by ``max(1 + partial traffic, m-tiles / 2.5)``
(L2 re-reads) over the wave efficiency, plus ``--fixed-us`` of fixed cost (RoPE pre-pass, merge,
pipeline fill). It assumes a CTA's cp.async pipeline keeps its SM's share of the bandwidth busy;
that and the fixed cost are unmeasured (bench/bench_attention.py measures on a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simsd_kernels.split_plan import (  # noqa: E402
    CUDA_FIGURES,
    TRITON_FIGURES,
    DeviceLimits,
    estimated_time,
    plan_attention,
    residency,
)

MODELS = {"8b": (32, 8), "1.7b": (16, 8)}
LAYOUTS = {"denoise4": 4, "paper4": 8, "exact4": 16, "denoise8": 8, "paper8": 16, "exact8": 64}
SHAPES = [(1, 4096), (1, 16384), (1, 32768), (8, 4096), (8, 16384), (8, 32768), (16, 4096), (64, 4096)]


def rows(sms=132, bandwidth=4e12, fixed_us=3.0):
    limits = DeviceLimits(num_sms=sms)
    for backend, figures in (("cuda", CUDA_FIGURES), ("triton", TRITON_FIGURES)):
        res = residency(figures, 128, limits)
        for model, (hq, hkv) in MODELS.items():
            for layout, lq in LAYOUTS.items():
                for batch, cache in SHAPES:
                    p = plan_attention(batch=batch, q_len=lq, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                       cache_capacity=cache, num_sms=sms, ctas_per_sm=res)
                    kv_bytes = 2 * batch * cache * hkv * 128 * 2
                    ideal_us = kv_bytes / bandwidth * 1e6
                    est_us = ideal_us * estimated_time(p.wave_efficiency, p.partial_traffic, p.m_tiles) + fixed_us
                    yield dict(backend=backend, model=model, layout=layout, rows=lq * hq // hkv, batch=batch,
                               cache=cache, block_m=p.block_m, splits=p.num_splits, min_tiles=p.min_tiles,
                               ctas=p.ctas, wave_eff=p.wave_efficiency, traffic=p.partial_traffic,
                               kv_mb=kv_bytes / 1e6, est=ideal_us / est_us)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--bandwidth", type=float, default=4e12, help="copy bandwidth, bytes/s")
    ap.add_argument("--fixed-us", type=float, default=3.0)
    args = ap.parse_args(argv)
    print("| backend | model | layout | Lq*G | B | cache | tile | splits | min tiles | CTAs | wave eff | "
          "partials | K/V MB | est. of BW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows(args.sms, args.bandwidth, args.fixed_us):
        print(f"| {r['backend']} | {r['model']} | {r['layout']} | {r['rows']} | {r['batch']} | {r['cache']} | "
              f"{r['block_m']} | {r['splits']} | {r['min_tiles']} | {r['ctas']} | {r['wave_eff']:.2f} | "
              f"{r['traffic']:.3f} | {r['kv_mb']:.0f} | {r['est']:.2f} |")


if __name__ == "__main__":
    main()
