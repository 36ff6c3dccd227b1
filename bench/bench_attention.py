"""Microbenchmark: temporal-mask attention of a short query over a long KV cache (GPU).

    python bench/bench_attention.py [--quick] [--models 8b,1.7b] [--caches 512,...] [--batches 1,...]

Shapes: SDAR-8B (Hq 32, Hkv 8, D 128) and SDAR-1.7B (Hq 16, Hkv 8, D 128), bf16. Query layouts
with block length Bk: ``paper`` (2*Bk tokens: D_1..D_Bk | M_1..M_Bk, four-quadrant mask),
``exact`` (Bk copies of the block, Bk*Bk tokens, copy-diagonal mask), ``denoise`` (Bk tokens,
bidirectional). Every row of the batch has the same cache length.

Providers (a provider that cannot run is reported and skipped):
* ``simsd-<name>``: every simsd backend available by name (``triton``, ``cuda`` once the
  compiled extension exists), RoPE fused (q, k un-rotated);
* ``flex``: compiled FlexAttention, block mask from ``simsd_kernels.flex.make_mask_mod``;
* ``sdpa-dense``: SDPA with a dense boolean mask (the torch backend's method);
* ``sdpa-nomask``: SDPA over the same keys with no mask, the speed-of-light for this token count
  (SDPA's ``is_causal`` is top-left aligned when Lq != Lk, so it is not a valid causal here);
* ``flash-kvcache``: ``flash_attn_with_kvcache`` (non-causal, over the cache), when importable.
Baselines get pre-rotated q/k and pre-concatenated K/V (untimed), so they do less work than ours.

Metrics: median time of ``triton.testing.do_bench``; bytes = K/V cache read
``2 * B * cache_len * Hkv * D * elt`` + q/k/v/out ``B * Lq * (2*Hq + 2*Hkv) * D * elt``;
GB/s = bytes / time; fractions of a 4 TB/s floor and of the measured device copy bandwidth;
TFLOP/s = ``4 * B * Hq * Lq * (cache_len + Lq) * D`` / time. ``max_diff`` is each provider's max
abs difference to ``sdpa-dense``. Rows (json lines, with GPU name, versions, git sha) are
appended to ``bench/results/attention.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {"8b": (32, 8, 128), "1.7b": (16, 8, 128)}
FLOOR_BYTES_PER_S = 4e12
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small subset (8B, cache 4096/16384, batch 1/8, Bk 4)")
    p.add_argument("--models", default="8b,1.7b")
    p.add_argument("--caches", default="512,2048,4096,8192,16384,32768")
    p.add_argument("--batches", default="1,4,8,16,64")
    p.add_argument("--blocks", default="4,8", help="block lengths Bk of the query layouts")
    p.add_argument("--layouts", default="paper,exact,denoise")
    p.add_argument("--providers", default="", help="comma list to restrict providers (default: all)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.caches, args.batches, args.blocks = "8b", "4096,16384", "1,8", "4"
    return args


def layout_labels(layout, bk, batch, device):
    """``(labels (batch, Lq, 3) int32, positions (batch, Lq) int64 offsets, MaskMode)``."""
    import torch
    from simsd_kernels.mask_rule import MaskMode

    blk = torch.arange(bk)
    if layout == "paper":  # D_k at tau k+1, M_k the RoPE copy
        kind = torch.cat([torch.ones(bk), torch.full((bk,), 2)])
        tau = torch.cat([blk + 1, blk + 1])
        grp, pos, mode = torch.zeros(2 * bk), torch.cat([blk, blk]), MaskMode.PAPER
    elif layout == "exact":  # one copy of the block per verified step
        kind = torch.zeros(bk * bk)
        tau = torch.zeros(bk * bk)
        grp, pos, mode = torch.arange(bk).repeat_interleave(bk), blk.repeat(bk), MaskMode.EXACT
    else:
        kind, tau, grp, pos, mode = torch.zeros(bk), torch.zeros(bk), torch.zeros(bk), blk, MaskMode.BIDIRECTIONAL
    labels = torch.stack([kind, tau, grp], -1).to(torch.int32)[None].repeat(batch, 1, 1)
    return labels.to(device), pos[None].repeat(batch, 1).to(device), mode


def build_providers(names_filter):
    """name -> factory(case) returning a zero-argument callable (or raising to skip).

    Every callable returns ``(B, Lq, Hq, D)`` (baselines return a transposed view: no copy).
    """
    import torch
    import torch.nn.functional as F

    from simsd_kernels import backends
    from simsd_kernels.reference import full_mask
    from simsd_kernels.rope import apply_rope

    provs = {}  # sdpa-dense first: the others are diffed against it
    for name in ("triton", "cuda"):
        def simsd(c, name=name):
            impl = backends.resolve_backend(name, c["q"].device)
            a = c["args"]
            return lambda: impl.attention(*a, c["mode"], 1e6, c["scale"])
        provs[f"simsd-{name}"] = simsd

    def dense_inputs(c):
        q, k, v, kc, vc, lens, labels, pos = c["args"]
        L = c["cache_len"]
        qr = apply_rope(q, pos, 1e6).transpose(1, 2).contiguous()
        keys = torch.cat([kc[:, :L], apply_rope(k, pos, 1e6)], 1).transpose(1, 2).contiguous()
        vals = torch.cat([vc[:, :L], v], 1).transpose(1, 2).contiguous()
        return qr, keys, vals

    def sdpa_dense(c):
        qr, keys, vals = dense_inputs(c)
        mask = full_mask(c["args"][5], c["args"][6], c["mode"], c["cache_len"])[:, None]
        return lambda: F.scaled_dot_product_attention(qr, keys, vals, attn_mask=mask,
                                                      enable_gqa=True).transpose(1, 2)
    provs["sdpa-dense"] = sdpa_dense

    def sdpa_nomask(c):
        qr, keys, vals = dense_inputs(c)
        return lambda: F.scaled_dot_product_attention(qr, keys, vals, enable_gqa=True).transpose(1, 2)
    provs["sdpa-nomask"] = sdpa_nomask

    def flex(c):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from simsd_kernels.flex import make_mask_mod
        qr, keys, vals = dense_inputs(c)
        mask_mod = make_mask_mod(c["args"][6], c["args"][5], c["cache_len"], c["mode"])
        bm = create_block_mask(mask_mod, qr.shape[0], None, qr.shape[2], keys.shape[2], device=qr.device)
        fn = torch.compile(flex_attention, dynamic=False)
        return lambda: fn(qr, keys, vals, block_mask=bm, enable_gqa=True).transpose(1, 2)
    provs["flex"] = flex

    def flash_kvcache(c):
        from flash_attn import flash_attn_with_kvcache
        q, k, v, kc, vc, lens, labels, pos = c["args"]
        if c["mode"] != 0:
            raise RuntimeError("flash_attn_with_kvcache has no temporal mask: denoise layout only")
        qr, kr = apply_rope(q, pos, 1e6), apply_rope(k, pos, 1e6)
        return lambda: flash_attn_with_kvcache(qr, kc, vc, kr, v, cache_seqlens=lens, causal=False)
    provs["flash-kvcache"] = flash_kvcache

    provs = {"sdpa-dense": provs.pop("sdpa-dense"), **provs}
    if names_filter:
        keep = set(names_filter.split(","))
        provs = {k: v for k, v in provs.items() if k in keep}
    return provs


def environment():
    import torch
    import triton
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        sha = ""
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                git_sha=sha, time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def make_case(batch, Lq, Hq, Hkv, D, L):
    """bf16 ``q, k, v, k_cache, v_cache, cache_seqlens`` on the GPU (capacity L + Lq)."""
    import torch
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return [rnd(batch, Lq, Hq, D), rnd(batch, Lq, Hkv, D), rnd(batch, Lq, Hkv, D),
            rnd(batch, L + Lq, Hkv, D), rnd(batch, L + Lq, Hkv, D),
            torch.full((batch,), L, dtype=torch.int32, device="cuda")]


def copy_bandwidth():
    import torch
    from triton.testing import do_bench
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure (this benchmark needs a GPU).")
        return 0
    from triton.testing import do_bench

    env = environment()
    copy_bw = copy_bandwidth()
    print(f"# {env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}  "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    providers = build_providers(args.providers)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    print(f"{'model':6} {'layout':8} {'Bk':>3} {'B':>3} {'cache':>6} {'Lq':>4} {'provider':16} "
          f"{'ms':>8} {'GB/s':>7} {'%4TB':>5} {'%copy':>5} {'TF/s':>6} {'diff':>8}")
    with open(args.out, "a") as f:
        for model in args.models.split(","):
            Hq, Hkv, D = MODELS[model]
            for layout in args.layouts.split(","):
                for bk in map(int, args.blocks.split(",")):
                    for batch in map(int, args.batches.split(",")):
                        for L in map(int, args.caches.split(",")):
                            labels, offs, mode = layout_labels(layout, bk, batch, "cuda")
                            Lq = labels.shape[1]
                            a = make_case(batch, Lq, Hq, Hkv, D, L) + [labels, offs + L]
                            case = dict(args=a, q=a[0], mode=mode, scale=D ** -0.5, cache_len=L)
                            elt = 2
                            nbytes = 2 * batch * L * Hkv * D * elt + batch * Lq * (2 * Hq + 2 * Hkv) * D * elt
                            flops = 4 * batch * Hq * Lq * (L + Lq) * D
                            ref = None
                            for pname, make in providers.items():
                                row = dict(env, model=model, layout=layout, block=bk, batch=batch,
                                           cache_len=L, Lq=Lq, Hq=Hq, Hkv=Hkv, D=D, dtype="bf16",
                                           provider=pname, copy_gbps=copy_bw / 1e9)
                                try:
                                    fn = make(case)
                                    out = fn()
                                    if pname == "sdpa-dense":
                                        ref = out
                                    diff = (out.float() - ref.float()).abs().max().item() if ref is not None else None
                                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                                    row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9,
                                               frac_4tbs=nbytes / (ms * 1e-3) / FLOOR_BYTES_PER_S,
                                               frac_copy=nbytes / (ms * 1e-3) / copy_bw,
                                               tflops=flops / (ms * 1e-3) / 1e12, max_diff=diff)
                                    print(f"{model:6} {layout:8} {bk:3} {batch:3} {L:6} {Lq:4} {pname:16} "
                                          f"{ms:8.4f} {row['gbps']:7.0f} {100 * row['frac_4tbs']:5.1f} "
                                          f"{100 * row['frac_copy']:5.1f} {row['tflops']:6.1f} "
                                          f"{diff if diff is not None else float('nan'):8.1e}", flush=True)
                                except Exception as exc:  # record and go on: one provider failing is data
                                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                                    print(f"{model:6} {layout:8} {bk:3} {batch:3} {L:6} {Lq:4} {pname:16} "
                                          f"skipped: {row['error'][:100]}", flush=True)
                                    torch.cuda.empty_cache()
                                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
