"""End-to-end engine benchmark on one GPU: per-forward latencies, decoding tokens/s, modelled tokens/s.

    python bench/bench_e2e.py [--quick] [--target DIR --draft DIR] [--cache-len 1024] [--acceptance 3.61]

1. **Per-forward latency** (batch 1, bf16, a cache of ``--cache-len`` tokens) of the forwards a
   decoder runs, eager and replayed as CUDA graphs (:mod:`simsd.engine.graphs`): ``draft_step`` (draft,
   B tokens, bidirectional), ``vanilla_step`` (target, B tokens), ``verify_paper`` (target, 2B
   tokens ``D|M``, four-quadrant mask), ``verify_exact`` (target, B copies of the block, B*B
   tokens; ``verify_exact_16`` and ``_32``: 16 and 32 copies, a self-speculative tree's widths),
   ``commit`` / ``draft_commit`` (B tokens written; the timed function also resets the
   cache length, one tiny kernel). Median of ``triton.testing.do_bench``. ``gpu_ms`` is the sum
   of the kernels' device time from the profiler (the "pure GPU time" of one forward).
   Models: ``--target/--draft`` checkpoints, or random weights with the SDAR-8B / SDAR-1.7B
   shapes built directly on the GPU (nothing written to disk); ``--target-shape 30b-a3b``: a
   random target of SDAR-30B-A3B's shape (128 experts, 8 routed, width 768, hidden 2048) with its
   48 layers cut to 12 to fit the device script's time (the per-layer costs are the model's); a
   comma list (``8b,30b-a3b``, as the device script passes) runs each target with the 1.7B draft
   in turn, one pair after the other (each freed before the next).
2. **Modelled tokens/s** from those latencies at a stated acceptance ``a`` (tokens committed
   per verify round; the paper: 3.61 of 4), block length B, gamma = B, static strategy:
   vanilla ``B / (B * t_vanilla_step + t_commit)``;
   SimSD ``a / (B * t_draft_step + t_verify + (a / B) * (t_commit + t_draft_commit))``.
   These rows say ``"modelled": true``; they are not measurements of decoding.
3. **Measured tokens/s** (prefill excluded, after one warm-up prompt, CUDA-synchronised) of
   vanilla, vanilla+graphs, paper, paper+graphs, exact, exact+graphs on the bundled tiny pair
   (``simsd/assets``; skipped when absent) and on the large pair with synthetic prompts (random
   weights make its acceptance meaningless: the acceptance is reported with each row).
   ``graphs_equal_eager`` says whether the graph variant produced the eager tokens (graphs run
   static padded shapes, so in bf16 a rare tie may legitimately differ; the GPU test
   ``tests/simsd/engine/test_graphs.py`` checks replay against eager with the same shapes).

Every case -- one forward's latency in one mode, the modelled rows, one engine variant's tokens/s
-- runs isolated: an exception or ``--case-timeout`` seconds (SIGALRM: Python code is interrupted,
a call blocked inside a CUDA kernel is not) records a ``kind: "error"`` row naming the case, prints
its traceback and the script goes on; rows that need a failed case's result leave it out. Rows
(JSON lines, with GPU name, versions and git sha) are appended to ``--out`` (default
``bench/results/e2e.jsonl``) as each case ends, flushed and fsync'ed. Exit status 1 when a case
failed. Without CUDA the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "e2e.jsonl")
#: (hidden, intermediate, layers, q heads, kv heads) of the SDAR checkpoints (head_dim 128, vocab 151936)
SHAPES = {"8b": (4096, 12288, 36, 32, 8), "1.7b": (2048, 6144, 28, 16, 8), "30b-a3b": (2048, 6144, 12, 32, 4)}
#: the mixture-of-experts fields of a shape (SDAR-30B-A3B's: Qwen3-30B-A3B's config)
MOE = {"30b-a3b": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)}
#: ``--cpu-smoke``: tiny shapes, float32 on the CPU, CUDA capture replaced by eager replay and
#: do_bench by a wall-clock median: it only checks that this script's code paths run
SMOKE = {"8b": (64, 128, 2, 4, 2), "1.7b": (64, 128, 1, 4, 2), "30b-a3b": (64, 128, 2, 4, 2)}
SMOKE_MOE = {"30b-a3b": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)}
DEV, DTYPE = "cuda", "bfloat16"
#: the random targets' shapes (``--target-shape``)
TARGET_SHAPES = ("8b", "30b-a3b")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (device script)")
    p.add_argument("--target", default=None, help="target checkpoint directory (default: random SDAR-8B shapes)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory (default: random SDAR-1.7B shapes)")
    p.add_argument("--target-shape", default="8b",
                   help="the random target's shape without --target: 8b, 30b-a3b (12 of its layers), or a comma "
                        "list of them, run one pair after the other")
    p.add_argument("--block-length", type=int, default=4)
    p.add_argument("--cache-len", type=int, default=1024, help="cached tokens for the latency rows")
    p.add_argument("--acceptance", type=float, default=3.61, help="tokens per verify round for the modelled rows")
    p.add_argument("--prompts", type=int, default=8, help="prompts for the measured tokens/s rows")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--case-timeout", type=float, default=120.0, help="seconds per case (0: none)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    # testing the isolation of cases (tests/bench/test_device_run.py): this case raises
    p.add_argument("--inject-failure", default=None, metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.target_shapes = [x.strip() for x in args.target_shape.split(",") if x.strip()]
    bad = [x for x in args.target_shapes if x not in TARGET_SHAPES]
    if bad or not args.target_shapes:
        p.error(f"--target-shape {args.target_shape!r}: expected a comma list of {', '.join(TARGET_SHAPES)}")
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 48
    return args


def environment() -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from simsd.entrypoints.bench import git_sha
    sha = git_sha()  # $SIMSD_GIT_SHA on a copy without .git
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu-smoke"
    return dict(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton_version, python=platform.python_version(), git_sha=sha,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def random_model(shape: str, block_length: int):
    """A bf16 SDAR model with random weights on the GPU (std 0.02 linears, unit norms)."""
    import torch

    from simsd.models.config import ModelConfig
    from simsd.models.model import SDARForCausalLM
    from simsd.testing import config_dict, moe_config_dict
    smoke = DEV == "cpu"
    H, inter, layers, hq, hkv = (SMOKE if smoke else SHAPES)[shape]
    raw = config_dict(vocab_size=151936, hidden_size=H, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=64 if smoke else 128,
                      block_size=block_length, mask_token_id=151669, max_position_embeddings=40960)
    moe = (SMOKE_MOE if smoke else MOE).get(shape)
    cfg = ModelConfig.from_dict(moe_config_dict(raw, **moe) if moe else raw)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, DTYPE))
    try:
        with torch.device(DEV):
            model = SDARForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


#: block copies of the wide exact verify forwards timed beside ``verify_exact`` (B copies)
WIDE_COPIES = (16, 32)


def forward_cases(B: int, L: int):
    """name -> (model role, mask mode, labels (1, Lq, 3) int32, num_write, logits?)."""
    import torch

    from simsd_kernels import KIND_DRAFT, KIND_MASK
    zeros = lambda n: torch.zeros(1, n, 3, dtype=torch.int32, device=DEV)  # noqa: E731
    paper = zeros(2 * B)
    paper[0, :B, 0], paper[0, B:, 0] = KIND_DRAFT, KIND_MASK
    paper[0, :B, 1] = paper[0, B:, 1] = torch.arange(1, B + 1, dtype=torch.int32)
    def exact(copies: int):
        labels = zeros(copies * B)
        labels[0, :, 2] = torch.arange(copies, dtype=torch.int32).repeat_interleave(B)
        return labels
    return {"draft_step": ("draft", "bidirectional", zeros(B), 0, True),
            "vanilla_step": ("target", "bidirectional", zeros(B), 0, True),
            "verify_paper": ("target", "paper", paper, 0, True),
            "verify_exact": ("target", "exact", exact(B), 0, True),
            # the wide trees of self-speculation (bench/bench_costmodel.py reads their widths)
            **{f"verify_exact_{c}": ("target", "exact", exact(c), 0, True) for c in WIDE_COPIES},
            "commit": ("target", "bidirectional", zeros(B), B, False),
            "draft_commit": ("draft", "bidirectional", zeros(B), B, False)}


def gpu_time_ms(fn, iters: int = 5):
    """Sum of device kernel time per call of ``fn`` (profiler), or None when unavailable."""
    import torch
    try:
        from torch.profiler import ProfilerActivity, profile
        if DEV != "cuda":
            return None
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        total_us = sum(evt.time_range.elapsed_us() for evt in prof.events()
                       if str(getattr(evt, "device_type", "")).endswith("CUDA"))
        return total_us / iters / 1e3 if total_us else None
    except Exception:  # the profiler is a diagnostic: never fail the benchmark on it
        return None


def bench_fn():
    """``do_bench(fn, warmup, rep, return_mode) -> ms``: triton's on CUDA, a wall-clock median on the CPU."""
    if DEV == "cuda":
        from triton.testing import do_bench
        return do_bench

    def wall(fn, warmup, rep, return_mode):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[2]
    return wall


def latency_row(models: dict, B: int, L: int, env: dict, pair: str, name: str, kind: str) -> list:
    """The row of forward ``name`` (:func:`forward_cases`) run ``kind`` = ``eager`` or ``graphs``."""
    import torch

    from simsd.engine.graphs import GraphRunner, eager_capture
    role, mode, labels, nw, want = forward_cases(B, L)[name]
    model = models[role]
    Lq = labels.shape[1]
    cache = model.new_cache(1, L + Lq + 8)
    for t in cache.k + cache.v:
        t.normal_()
    cache.seqlens.fill_(L)
    ids = torch.randint(0, model.config.vocab_size - 1, (1, Lq), device=DEV)
    pos = (L + torch.arange(Lq, device=DEV) % B)[None]
    nw_t = torch.full((1,), nw, dtype=torch.int32, device=DEV)
    if kind == "eager":
        def fn():  # the engine's forward, as a graph captures it
            model(ids, pos, labels, mode, cache, nw_t, slice(None) if want else None, unit=B)
            if nw:
                cache.seqlens.fill_(L)
    else:
        runner = GraphRunner(model, cache, B, capture=None if DEV == "cuda" else eager_capture)

        def fn():
            runner(ids, pos, labels, mode, nw_t, want)
            if nw:
                cache.seqlens.fill_(L)
    ms = bench_fn()(fn, warmup=10, rep=60, return_mode="median")
    return [dict(env, kind="latency", pair=pair, forward=name, mode=kind, mask_mode=mode, Lq=Lq, block_length=B,
                 cache_len=L, batch=1, dtype=DTYPE, ms=ms, gpu_ms=gpu_time_ms(fn) if kind == "eager" else None)]


def modelled_rows(lat: list, B: int, a: float, env: dict, pair: str) -> list:
    """Modelled tokens/s of vanilla and the two verifications, per mode (eager / graphs) whose
    latencies all exist (a failed latency case leaves its rows out)."""
    rows = []
    for kind in ("eager", "graphs"):
        t = {r["forward"]: r["ms"] / 1e3 for r in lat if r.get("kind") == "latency" and r["mode"] == kind}
        if "vanilla_step" in t and "commit" in t:
            van = B / (B * t["vanilla_step"] + t["commit"])
            rows.append(dict(env, kind="modelled", modelled=True, pair=pair, mode=f"vanilla/{kind}", block_length=B,
                             tokens_per_second=van, formula="B / (B*t_vanilla_step + t_commit)"))
        for verify in ("paper", "exact"):
            need = ("draft_step", f"verify_{verify}", "commit", "draft_commit")
            if not all(n in t for n in need):
                continue
            tps = a / (B * t["draft_step"] + t[f"verify_{verify}"] + a / B * (t["commit"] + t["draft_commit"]))
            rows.append(dict(env, kind="modelled", modelled=True, pair=pair, mode=f"{verify}/{kind}",
                             block_length=B, acceptance_tokens_per_round=a, tokens_per_second=tps,
                             formula="a / (B*t_draft_step + t_verify + a/B*(t_commit + t_draft_commit))"))
    base = next((r["tokens_per_second"] for r in rows if r["mode"] == "vanilla/graphs"), None)
    for r in rows:
        r["speedup_vs_vanilla_graphs"] = r["tokens_per_second"] / base if base else None
    return rows


MEASURED = [(mode, graphs) for mode in ("vanilla", "paper", "exact") for graphs in (False, True)]


def measured_row(target, draft, prompts: list, args, env: dict, pair: str, mode: str, graphs: bool,
                 outputs: dict) -> list:
    """Tokens/s of one engine variant on ``prompts`` (lists of ids) after one warm-up prompt; its
    tokens go to ``outputs[label]`` for the comparisons of later variants (None where the variant
    compared with failed). The variant keeps one engine for its prompts (captured graphs are
    replayed, not captured again)."""
    from simsd import DecodeConfig
    from simsd.decoding.config import check_prompt
    from simsd.decoding.program import generate_batch
    from simsd.decoding.vanilla import VanillaRow
    from simsd.engine.batching import BatchEngine, round_capacity
    from simsd.speculative import SpecConfig
    from simsd.speculative.decoder import SpeculativeDecoder
    block_length = args.block_length
    cfg = DecodeConfig(block_length=block_length, strategy="static", max_new_tokens=args.max_new_tokens)
    caps = [check_prompt(p, target.config, cfg.max_new_tokens, block_length) for p in prompts]
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    engine = BatchEngine(models, block_length, 1, round_capacity(max(caps)),
                         (2 if mode == "vanilla" else block_length + 2) * block_length, cuda_graphs=graphs)
    dec = None if mode == "vanilla" else SpeculativeDecoder(target, draft, cfg, SpecConfig(mode=mode))

    def run(p, i):
        seed = cfg.seed + i
        new = (lambda row, _: VanillaRow(row, cfg, target.mask_token_id, target.stop_ids, seed)) \
            if dec is None else (lambda row, _: dec.new_row(row, seed))
        return generate_batch(engine, [p], [caps[i]], new).results[0]
    run(prompts[0], 0)
    res = [run(p, i) for i, p in enumerate(prompts)]
    tok = sum(r.stats["new_tokens"] for r in res)
    sec = sum(r.stats["decode_seconds"] for r in res)
    label = mode + ("+graphs" if graphs else "")
    outputs[label] = [r.token_ids for r in res]
    s = lambda k: sum(r.stats.get(k, 0) for r in res)  # noqa: E731
    vanilla = outputs.get("vanilla")
    return [dict(env, kind="tokens_per_second", pair=pair, mode=label, prompts=len(prompts),
                 block_length=args.block_length, max_new_tokens=args.max_new_tokens, new_tokens=tok,
                 decode_seconds=sec, tokens_per_second=tok / sec,
                 target_forwards_per_token=s("target_forwards") / max(tok, 1),
                 acceptance_rate=s("accepted") / s("proposed") if s("proposed") else None,
                 identical_to_vanilla=None if vanilla is None else sum(a == b for a, b in zip(outputs[label], vanilla)),
                 graphs_equal_eager=(outputs[label] == outputs[mode]) if graphs and mode in outputs else None)]


def measured_cases(target, draft, prompts, args, env, pair, run_case) -> None:
    outputs: dict = {}
    for mode, graphs in MEASURED:
        run_case(f"tokens/s:{mode}{'+graphs' if graphs else ''}", pair,
                 lambda: measured_row(target, draft, prompts, args, env, pair, mode, graphs, outputs))


def bundled_pair(args):
    """``(target, draft, prompts)`` of the bundled tiny pair, or None when it is not installed."""
    from simsd import load_checkpoint
    from simsd.assets import DEFAULT_DRAFT, DEFAULT_TARGET, HELDOUT_PROMPTS
    from simsd.entrypoints.encoding import encode_prompt
    if not (DEFAULT_TARGET / "config.json").is_file() or not (DEFAULT_DRAFT / "config.json").is_file():
        print(f"bench_e2e: bundled pair not found under {DEFAULT_TARGET.parent}: measured rows skipped")
        return None
    t = load_checkpoint(DEFAULT_TARGET, dtype=DTYPE, device=DEV)
    d = load_checkpoint(DEFAULT_DRAFT, dtype=DTYPE, device=DEV)
    lines = HELDOUT_PROMPTS.read_text().splitlines() if HELDOUT_PROMPTS.is_file() else []
    texts = [json.loads(x)["prompt"] for x in lines if x.strip()][: args.prompts] or ["def add(a, b):"]
    prompts = [encode_prompt([{"role": "user", "content": x}], t.tokenizer, t.mask_token_id)[0] for x in texts]
    return t, d, prompts


def goal_lines(rows: list) -> list:
    """The issue's goals, from the latency and modelled rows of each pair."""
    out = []
    for pair in dict.fromkeys(r["pair"] for r in rows if r["kind"] == "latency"):
        lat = {(r["forward"], r["mode"]): r for r in rows if r["kind"] == "latency" and r["pair"] == pair}
        van = lat.get(("vanilla_step", "graphs"))
        for v in ("paper", "exact"):
            if van and (f"verify_{v}", "graphs") in lat:
                ratio = lat[(f"verify_{v}", "graphs")]["ms"] / van["ms"]
                out.append(f"goal      {pair:12} verify_{v}/vanilla_step (graphs) {ratio:.2f} (goal <= 1.15)")
        gpu = lat.get(("draft_step", "eager"), {}).get("gpu_ms")
        if gpu and ("draft_step", "graphs") in lat:
            ratio = lat[("draft_step", "graphs")]["ms"] / gpu
            out.append(f"goal      {pair:12} draft_step graphs / pure GPU time {ratio:.2f} (goal <= 1.2)")
        for r in rows:
            if r["kind"] == "modelled" and r["pair"] == pair and r["mode"] in ("paper/graphs", "exact/graphs") \
                    and r.get("speedup_vs_vanilla_graphs"):
                out.append(f"goal      {pair:12} modelled {r['mode']} / vanilla/graphs "
                           f"{r['speedup_vs_vanilla_graphs']:.2f} (goal >= 1.6)")
    return out


def print_table(rows: list) -> None:
    print("\n# e2e summary (ms per forward; tokens/s; modelled rows are not measurements)")
    for r in rows:
        if r["kind"] == "latency":
            gpu = f" gpu {r['gpu_ms']:.3f}" if r.get("gpu_ms") else ""
            print(f"latency   {r['pair']:12} {r['forward']:13} {r['mode']:7} {r['ms']:8.3f} ms{gpu}")
        elif r["kind"] == "modelled":
            x = r["speedup_vs_vanilla_graphs"]
            print(f"modelled  {r['pair']:12} {r['mode']:15} {r['tokens_per_second']:9.1f} tok/s "
                  + (f"x{x:.2f} vs vanilla/graphs" if x else ""))
        elif r["kind"] == "error":
            print(f"FAILED    {r['pair']:12} {r['case']:28} {r['error'][:100]}")
        else:
            acc = f" accept {r['acceptance_rate']:.3f}" if r.get("acceptance_rate") is not None else ""
            print(f"measured  {r['pair']:12} {r['mode']:15} {r['tokens_per_second']:9.1f} tok/s "
                  f"fwd/tok {r['target_forwards_per_token']:.3f}{acc} same-as-vanilla {r['identical_to_vanilla']}"
                  f"/{r['prompts']}")
    for line in goal_lines(rows):
        print(line)


class CaseTimeout(Exception):
    """A case ran past ``--case-timeout``."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CaseTimeout` in this (main) thread after ``seconds`` (0: no limit)."""
    if not seconds:
        yield
        return

    def alarm(signum, frame):
        raise CaseTimeout(f"ran past the case time limit of {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Cases:
    """Runs cases in isolation and appends their rows to ``path`` as each ends (flushed, fsync'ed)."""

    def __init__(self, path: str, env: dict, timeout: float, inject: str | None):
        self.path, self.env, self.timeout, self.inject = path, env, timeout, inject
        self.rows, self.failed = [], []

    def __call__(self, case: str, pair: str, fn) -> list:
        t0 = time.perf_counter()
        try:
            with time_limit(self.timeout):
                if case == self.inject:
                    raise RuntimeError("injected failure (--inject-failure)")
                rows = fn()
        except Exception as exc:  # the case failed; the next one runs
            sec = time.perf_counter() - t0
            print(f"bench_e2e: case {case} ({pair}) FAILED after {sec:.1f} s:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            self.failed.append(case)
            rows = [dict(self.env, kind="error", pair=pair, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                         seconds=round(sec, 2))]
            _release_device()
        for r in rows:
            r.setdefault("case", case)
        self.emit(rows)
        return rows

    def emit(self, rows: list) -> None:
        self.rows.extend(rows)
        with open(self.path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _release_device() -> None:
    """After a failed case: free cached GPU memory (a sticky CUDA error makes this raise: ignored,
    the following cases then fail and say why)."""
    if DEV != "cuda":
        return
    import torch
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def run_pair(args, shape, env: dict, run_case) -> None:
    """The latency, modelled and measured cases of one pair: ``--target/--draft`` (``shape`` None) or
    the random target of ``shape`` with the random 1.7B draft; its models are freed at the end."""
    B = args.block_length
    pair = os.path.basename(os.path.normpath(args.target)) if args.target else f"random-{shape}/1.7b"
    models = {}

    def load():
        from simsd import load_checkpoint
        if args.target:
            models["t"] = load_checkpoint(args.target, dtype=DTYPE, device=DEV)
            models["d"] = load_checkpoint(args.draft or args.target, dtype=DTYPE, device=DEV)
        else:
            from pathlib import Path

            from simsd.models.loading import Checkpoint
            stops = [151645, 151643]  # <|im_end|>, <|endoftext|>
            models["t"] = Checkpoint(Path(f"random-{shape}"), random_model(shape, B), None, 151669, stops)
            models["d"] = Checkpoint(Path("random-1.7b"), random_model("1.7b", B), None, 151669, stops)
        return []
    run_case("load", pair, load)
    if models:
        t, d = models["t"], models["d"]
        roles = {"target": t.model, "draft": d.model}
        lat = []
        for name in forward_cases(B, args.cache_len):
            for kind in ("eager", "graphs"):
                lat += run_case(f"latency:{name}:{kind}", pair,
                                lambda: latency_row(roles, B, args.cache_len, env, pair, name, kind))
        run_case("modelled", pair, lambda: modelled_rows(lat, B, args.acceptance, env, pair))
        prompts = [list(range(100, 100 + n)) for n in (37, 64, 91, 120)][: args.prompts]
        measured_cases(t, d, prompts, args, env, pair, run_case)
        del t, d, roles
        models.clear()
        _release_device()


def main(argv=None) -> int:
    global DEV, DTYPE
    args = parse_args(argv)
    import torch
    if args.cpu_smoke:
        DEV, DTYPE = "cpu", "float32"
        args.cache_len, args.prompts, args.max_new_tokens = 16, 2, 8
        import simsd.engine.graphs
        simsd.engine.graphs.cuda_capture = simsd.engine.graphs.eager_capture
        simsd.engine.graphs.check_graphable = lambda model: None
    elif not torch.cuda.is_available():
        print("bench_e2e: no CUDA device; nothing to measure (this benchmark needs a GPU).")
        return 0
    env = environment()
    print(f"# {env['gpu']}  torch {env['torch']}  cuda {env['cuda']}  triton {env['triton']}  sha {env['git_sha']}",
          flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    run_case = Cases(args.out, env, args.case_timeout, args.inject_failure)
    for shape in [None] if args.target else args.target_shapes:
        run_pair(args, shape, env, run_case)
    bundled = {}
    run_case("load:bundled-tiny", "bundled-tiny", lambda: bundled.update(pair=bundled_pair(args)) or [])
    if bundled.get("pair"):
        t, d, prompts = bundled["pair"]
        measured_cases(t, d, prompts, args, env, "bundled-tiny", run_case)
    print_table(run_case.rows)
    if run_case.failed:
        print(f"bench_e2e: {len(run_case.failed)} cases failed: {', '.join(run_case.failed)} (tracebacks above)")
    return 1 if run_case.failed else 0


if __name__ == "__main__":
    sys.exit(main())
