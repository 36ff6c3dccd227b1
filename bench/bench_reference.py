"""simsd's vanilla decoding against an independent block-diffusion loop on transformers' Qwen3 (SDPA).

    python bench/bench_reference.py [--checkpoint bundled|random] [--shape h512-l8-d128] [--prompts 8]
        [--max-new-tokens 64] [--passes 4] [--fold-commit] [--profile] [--json F]

The reference (:class:`TransformersLoop`, written here; it shares no code with simsd) decodes
the way the SDAR authors' evaluation loop does (``generate.py`` of JetAstra/SDAR): the checkpoint
loaded into transformers' ``Qwen3ForCausalLM`` (``attn_implementation="sdpa"``, a
``Qwen3Config`` built from the ``config.json`` fields; SDAR checkpoints are Qwen3 weights, no
remote code), a ``DynamicCache``, a block-causal prefill of the prompt's whole blocks, then per
block of ``B`` positions (blocks aligned to position 0, the prompt's tail inside the first one,
the rest MASK) ``B`` denoising steps: a forward of the block over the cache with the block
visible to itself (a 4D boolean mask sliced from one block-causal mask), the cache then cut
back (the block is not stored while it is denoised), greedy tokens (no shift: the logits at
position ``p`` predict the token at ``p``), and the low-confidence (static) rule: the most
confident still-masked position is revealed (softmax probability of its argmax; ties to the
lower position). A finished block is stored by one more forward of the backbone. Two rules are
simsd's (docs/design.md §3) and not in the authors' loop: the MASK token is never a candidate
token, and the loop stops after the block that holds a stop id or reaches ``--max-new-tokens``
(no commit forward for that last block); both loops therefore run the same forwards.

simsd runs ``vanilla_generate_batch`` on one prompt at a time (the reference loop has a batch of
one), static strategy, greedy, ``B = steps = 4``, float32, one thread. Timing: one process, an
untimed warm-up of each, then ``--passes`` passes over the prompts in alternating order (simsd
first in even passes, transformers first in odd ones); a pass's tokens/s is its generated
tokens over its decode seconds, the prompt prefill excluded for both (simsd's
``decode_seconds``; the reference's clock starts after its prefill). Printed: the median
tokens/s of each, the ratio of the medians and the median (range) of the per-pass ratios
simsd/transformers, and the prompts whose tokens are identical (a prompt that differs is
reported with the first differing token and the reference's logit margin top-1 minus top-2
there, and the confidence gap between the revealed position and the next one; float32 near-ties
can legitimately differ, rarely).

``--fold-commit``: simsd folds each finished block's commit into the next block's first denoise
forward (``DecodeConfig.fold_commit``: one forward of both blocks, block-causal, instead of two;
the reference keeps the authors' separate commit forward). The forwards then differ in shape
(8 tokens instead of 4), so float32 products may round differently: the token check says
whether they stayed identical.

``--checkpoint random`` writes a random SDAR checkpoint of ``--shape`` (``bench/benchlib.py``;
default 8 layers, head_dim 128) with the bundled tokenizer. ``--profile``: afterwards, one
more untimed run of each on the first prompt under ``cProfile`` and ``torch.profiler``, their
top 10 cost centres (own time) printed.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import benchlib  # noqa: E402
from simsd import DecodeConfig, load_checkpoint  # noqa: E402
from simsd.decoding.vanilla import vanilla_generate_batch  # noqa: E402

#: config.json fields of SDAR that Qwen3Config does not have
SDAR_ONLY = ("architectures", "model_type", "auto_map", "block_size", "mask_token_id", "torch_dtype")


class TransformersLoop:
    """Greedy static block diffusion of one checkpoint directory with transformers' Qwen3 (SDPA).

    ``mask_id`` and ``stop_ids`` are the decoding's (the caller's); the model is float32 on the CPU."""

    def __init__(self, path, mask_id: int, stop_ids, block_length: int):
        from safetensors.torch import load_file
        from transformers import Qwen3Config, Qwen3ForCausalLM

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        config = Qwen3Config(**{k: v for k, v in raw.items() if k not in SDAR_ONLY}, attn_implementation="sdpa")
        model = Qwen3ForCausalLM(config)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
            raise ValueError(f"{path}: not Qwen3 weights (missing {missing}, unexpected {unexpected})")
        self.model = model.float().eval()
        self.mask_id, self.stop_ids, self.B = mask_id, set(stop_ids), block_length

    def visible(self, total: int) -> torch.Tensor:
        """``(1, 1, total, total)`` bool: query ``i`` sees key ``j`` iff ``j``'s block is not after ``i``'s."""
        block = torch.arange(total) // self.B
        return (block[None, :] <= block[:, None])[None, None]

    @torch.no_grad()
    def generate(self, prompt: list, max_new_tokens: int, trace: list | None = None) -> tuple[list, float]:
        """``(generated ids, decode seconds)`` for ``prompt`` (ids); the ids are cut after the first
        stop id and at ``max_new_tokens``. ``trace``: a list that receives, per generated token,
        ``(logit margin top-1 minus top-2, confidence gap to the next masked position)`` at the
        step that revealed it (diagnostics; slower)."""
        from transformers import DynamicCache

        B, P = self.B, len(prompt)
        total = -(-(P + max_new_tokens) // B) * B
        mask = self.visible(total)
        ids = torch.tensor(prompt + [self.mask_id] * (total - P))[None]
        pos = torch.arange(total)[None]
        cache = DynamicCache()
        start = P // B * B
        if start:  # block-causal prefill of the prompt's whole blocks (the backbone: no logits needed)
            # cache is the 4th positional argument of Qwen3Model.forward (its keyword changed name in transformers 5)
            self.model.model(ids[:, :start], mask[..., :start, :start], pos[:, :start], cache, use_cache=True)
        t0 = time.perf_counter()
        generated, marks = [], {}
        while True:
            end = start + B
            block = ids[0, start:end].clone()
            step = 0
            while bool((block == self.mask_id).any()):
                logits = self.model(block[None], mask[..., start:end, :end], pos[:, start:end], cache,
                                    use_cache=True).logits[0]
                cache.crop(-B)  # read-only: the block's K/V are stored once it is finished
                step += 1
                logits[:, self.mask_id] = float("-inf")
                probs = torch.softmax(logits.float(), dim=-1)
                conf, tokens = probs.max(dim=-1)  # greedy; max returns the first maximal index
                masked = block == self.mask_id
                conf = torch.where(masked, conf, torch.tensor(float("-inf")))
                order = torch.sort(conf, descending=True, stable=True).indices  # ties: lower position first
                j = int(order[0])  # steps = B: one position per step
                block[j] = tokens[j]
                if trace is not None:
                    top2 = logits[j].topk(2).values
                    nxt = conf[order[1]] if int(masked.sum()) > 1 else torch.tensor(float("nan"))
                    marks[start + j] = (float(top2[0] - top2[1]), float(conf[j] - nxt))
            ids[0, start:end] = block
            new = block[max(P - start, 0):].tolist()
            generated += new
            if trace is not None:
                trace += [marks[p] for p in range(max(P, start), end)]
            if self.stop_ids.intersection(new) or len(generated) >= max_new_tokens:
                break
            self.model.model(block[None], mask[..., start:end, :end], pos[:, start:end], cache, use_cache=True)
            start = end
        seconds = time.perf_counter() - t0
        return cut(generated, self.stop_ids, max_new_tokens), seconds


def cut(generated: list, stop_ids, max_new_tokens: int) -> list:
    """``generated`` up to and including the first stop id, at most ``max_new_tokens`` ids."""
    out = []
    for t in generated[:max_new_tokens]:
        out.append(t)
        if t in stop_ids:
            break
    return out


def simsd_generate(target, prompt: list, cfg: DecodeConfig, index: int) -> tuple[list, float]:
    """``(token ids, decode seconds)`` of simsd's vanilla decoding of one prompt."""
    res = vanilla_generate_batch(target.model, [prompt], cfg, target.mask_token_id, target.stop_ids, index).results[0]
    return res.token_ids, res.stats["decode_seconds"]


def run_pass(name: str, target, ref: TransformersLoop, prompts: list, cfg: DecodeConfig) -> tuple[list, float, int]:
    """``(tokens per prompt, decode seconds, tokens)`` of one pass of ``name`` over ``prompts``."""
    outs, seconds = [], 0.0
    for i, p in enumerate(prompts):
        toks, sec = simsd_generate(target, p, cfg, i) if name == "simsd" else ref.generate(p, cfg.max_new_tokens)
        outs.append(toks)
        seconds += sec
    return outs, seconds, sum(len(t) for t in outs)


def first_difference(a: list, b: list) -> int | None:
    """Index of the first differing token of two id lists (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def profile_top(fn, n: int = 10) -> tuple[str, str]:
    """``(cProfile top n by own time, torch.profiler top n by self CPU time)`` of ``fn()``."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    text = buf.getvalue()
    py = text[text.index("   ncalls"):].rstrip() if "   ncalls" in text else text
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        fn()
    return py, tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", choices=("bundled", "random"), default="bundled")
    p.add_argument("--shape", choices=sorted(benchlib.RANDOM_SHAPES), default="h512-l8-d128",
                   help="the random checkpoint's shape")
    p.add_argument("--prompts", type=int, default=8, help="the first N bundled held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=4, help="timed passes, alternating which runs first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fold-commit", action="store_true",
                   help="simsd folds each block's commit into the next block's first forward")
    p.add_argument("--profile", action="store_true", help="profile one prompt of each afterwards")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "passes", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def compare(target, ref: TransformersLoop, prompts: list, names: list, cfg: DecodeConfig, passes: int) -> dict:
    """The timed passes and the token check; the result row."""
    simsd_generate(target, prompts[0], cfg, 0)  # warm-up, untimed
    ref.generate(prompts[0], cfg.max_new_tokens)
    tps = {"simsd": [], "transformers": []}
    tokens = {}
    for k in range(passes):
        for name in ("simsd", "transformers") if k % 2 == 0 else ("transformers", "simsd"):
            outs, seconds, n = run_pass(name, target, ref, prompts, cfg)
            if tokens.setdefault(name, outs) != outs:
                raise RuntimeError(f"{name}: pass {k} decoded other tokens than pass 0")
            tps[name].append(n / seconds)
    ratios = [a / b for a, b in zip(tps["simsd"], tps["transformers"])]
    differ = []
    for i, (a, b) in enumerate(zip(tokens["simsd"], tokens["transformers"])):
        at = first_difference(a, b)
        if at is not None:
            trace = []
            ref.generate(prompts[i], cfg.max_new_tokens, trace)
            margin, gap = trace[at] if at < len(trace) else (None, None)
            differ.append({"prompt": names[i], "token": at, "simsd": a[at] if at < len(a) else None,
                           "transformers": b[at] if at < len(b) else None, "logit_margin": margin,
                           "confidence_gap": gap})
    med = {k: statistics.median(v) for k, v in tps.items()}
    return {"prompts": len(prompts), "identical": len(prompts) - len(differ), "differ": differ,
            "new_tokens": sum(len(t) for t in tokens["simsd"]),
            "new_tokens_transformers": sum(len(t) for t in tokens["transformers"]),
            "simsd_tokens_per_second": med["simsd"], "transformers_tokens_per_second": med["transformers"],
            "ratio_of_medians": med["simsd"] / med["transformers"], "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "passes": passes,
            "simsd_tokens_per_second_all": tps["simsd"], "transformers_tokens_per_second_all": tps["transformers"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint == "bundled":
            from simsd.assets import DEFAULT_TARGET as path
            label = "bundled tiny target"
        else:
            path = benchlib.random_checkpoint(Path(tmp) / "random", args.shape)
            label = f"random {args.shape}"
        target = load_checkpoint(path)
        ref = TransformersLoop(path, target.mask_token_id, target.stop_ids, target.model.config.block_size or 4)
    prompts, names = benchlib.prompt_ids(target.tokenizer, args.prompts)
    cfg = DecodeConfig(block_length=ref.B, strategy="static", max_new_tokens=args.max_new_tokens,
                       fold_commit=args.fold_commit)
    row = compare(target, ref, prompts, names, cfg, args.passes)
    env = benchlib.environment()
    row.update(checkpoint=label, block_length=ref.B, steps=cfg.steps, strategy="static", greedy=True,
               max_new_tokens=args.max_new_tokens, dtype="float32", fold_commit=args.fold_commit, **env)
    print(f"bench_reference: {label}, {row['prompts']} prompts x {args.max_new_tokens} tokens, greedy, static, "
          f"B = steps = {ref.B}, float32{', simsd folds commits' if args.fold_commit else ''}, "
          f"{env['threads']} thread(s), torch {env['torch']}, "
          f"transformers {env['transformers']}, git {env['git_sha']}")
    print(f"identical tokens: {row['identical']}/{row['prompts']} prompts "
          f"({row['new_tokens']} simsd tokens, {row['new_tokens_transformers']} transformers tokens)")
    for d in row["differ"]:
        print(f"  {d['prompt']}: first difference at token {d['token']} (simsd {d['simsd']}, transformers "
              f"{d['transformers']}; transformers' logit margin {d['logit_margin']}, confidence gap "
              f"{d['confidence_gap']})")
    print(f"tokens/s (median of {args.passes} passes, prefill excluded): simsd {row['simsd_tokens_per_second']:.1f}, "
          f"transformers {row['transformers_tokens_per_second']:.1f}")
    print(f"ratio simsd/transformers: {row['ratio_of_medians']:.3f} (ratio of medians); per pass median "
          f"{row['ratio_median']:.3f}, range {row['ratio_min']:.3f}-{row['ratio_max']:.3f}")
    if args.profile:
        for name, fn in (("simsd", lambda: simsd_generate(target, prompts[0], cfg, 0)),
                         ("transformers", lambda: ref.generate(prompts[0], cfg.max_new_tokens))):
            py, ops = profile_top(fn)
            print(f"\n== profile {name}: cProfile, top 10 by own time ==\n{py}\n"
                  f"== profile {name}: torch.profiler, top 10 by self CPU time ==\n{ops}")
    if args.json:
        benchlib.write_json(args.json, {"script": "bench_reference", "prompt_ids": names, **vars(args)}, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
