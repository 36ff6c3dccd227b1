"""Train the bundled tiny SDAR-format pair (``simsd/assets/tiny-sdar-{target,draft}``).

Not part of the test suite. Deterministic given ``--seed`` (same corpus, same thread count).

Stages (work files go to ``build/tiny-sdar/``, ignored by git)::

    python tools/train_tiny_sdar.py tokenizer            # BPE + tokenized corpus
    python tools/train_tiny_sdar.py train --model target  # -> simsd/assets/tiny-sdar-target
    python tools/train_tiny_sdar.py train --model draft   # -> simsd/assets/tiny-sdar-draft
    python tools/train_tiny_sdar.py train --model draft --init-from simsd/assets/tiny-sdar-draft \
        --teacher simsd/assets/tiny-sdar-target         # distill -> build/tiny-sdar/draft-distilled

Corpus: ``tools/corpus.py`` (CHAMP and HumanEval from their PyPI packages, chat-formatted and
plain, plus the interpreter's stdlib sources), with a fixed held-out split of problems.

Objective (SDAR / BD3-LM block diffusion, no shift): the model reads ``[x_t | x_0]`` (noisy
copy, then clean copy, shared position ids). Per block of ``B`` tokens, ``m ~ U{1..B}``
positions are replaced by ``<|MASK|>`` (the discrete form of ``t ~ U(0, 1]`` for a block of
``B`` tokens: ``t = m / B``; every block then carries loss and every noise level a denoising
step meets at inference is trained). Noisy block ``i`` attends itself bidirectionally and
clean blocks ``< i``; clean block ``i`` attends clean blocks ``<= i``. Loss: cross-entropy at
the masked positions of ``x_t`` (the logits at position ``p`` predict token ``p``), weighted by
``1 / t``, summed and divided by the number of tokens. The held-out loss is the same quantity
on the held-out CHAMP / HumanEval chat documents with a fixed noise seed.

The training forward reuses the ``SDARForCausalLM`` modules with torch SDPA and a dense bool
mask; at start (and on the saved bf16 checkpoint) it is checked against
``SDARForCausalLM.forward`` (prefill + denoise over the KV cache), so the trained weights mean
the same at inference.

Shipped pair (defaults: 700 steps x 8 x 256 tokens, lr 3e-3; target ``--threads 2``, draft
``--threads 1``): target 28 min, held-out loss 4.636; draft 18 min, 4.581 (bf16 weights, on a
shared 2-core CPU). Corpus, split, samples and draft/target agreement: ``tools/TRAINING.md``.

Distillation (``--teacher``, loss in ``tools/distill.py``): start from ``--init-from`` weights and
minimise KL(teacher || student) at the masked positions of the same ``[x_t | x_0]`` input,
optionally mixed with the 1/t-weighted CE (``--kd-weight``, ``--ce-weight``).
The shipped draft is the first draft distilled this way (1200 steps, 20 min, held-out loss 4.664,
greedy agreement with the target 41% -> 64%; ``tools/TRAINING.md``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bd_objective import bd_loss, bd_mask, heldout_loss, train_forward  # noqa: E402

import distill  # noqa: E402
from simsd.models.config import ModelConfig  # noqa: E402
from simsd.models.model import SDARForCausalLM, labels_for  # noqa: E402
from simsd.testing import build_tokenizer, config_dict, save_checkpoint  # noqa: E402

WORK = ROOT / "build" / "tiny-sdar"
ASSETS = ROOT / "simsd" / "assets"
SOURCE_WEIGHTS = {"math_chat": 0.35, "code_chat": 0.2, "text": 0.1, "stdlib": 0.35}
MODELS = {
    "target": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64),
}


# ----------------------------------------------------------------------------- data
def encode_docs(tok, docs) -> dict:
    """Token stream of ``docs``, each followed by ``<|endoftext|>``: ``{"ids": int32, "starts": int64}``."""
    ids, starts = [], []
    for d in docs:
        starts.append(len(ids))
        ids.extend(tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    return {"ids": torch.tensor(ids, dtype=torch.int32), "starts": torch.tensor(starts, dtype=torch.int64)}


def stage_tokenizer(args) -> None:
    import corpus

    sp = corpus.split()
    corpus.write_assets(sp)
    train, held = corpus.documents("train", sp), corpus.documents("heldout", sp)
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]

    def strip(t):
        for s in specials:
            t = t.replace(s, " ")
        return t

    texts = [strip(t) for docs in train.values() for t in docs]
    t0 = time.time()
    tok = build_tokenizer(texts, vocab_size=args.vocab_size)
    WORK.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(WORK / "tokenizer"))
    data = {"train": {k: encode_docs(tok, v) for k, v in train.items()},
            "heldout": {k: encode_docs(tok, v) for k, v in held.items()}}
    torch.save(data, WORK / "corpus.pt")
    stats = {w: {k: int(v["ids"].numel()) for k, v in d.items()} for w, d in data.items()}
    print(f"tokenizer: {len(tok)} tokens ({time.time() - t0:.0f}s); corpus tokens {json.dumps(stats)}")


class Sampler:
    """Random windows of ``L`` tokens: a source by weight, a start at a document start (half the
    time) or anywhere; each source stream wraps around."""

    def __init__(self, streams: dict, L: int, seed: int):
        self.names = list(SOURCE_WEIGHTS)
        self.weights = torch.tensor([SOURCE_WEIGHTS[n] for n in self.names])
        self.streams, self.L = streams, L
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, n: int) -> torch.Tensor:
        out = []
        for _ in range(n):
            s = self.streams[self.names[int(torch.multinomial(self.weights, 1, generator=self.g))]]
            ids, starts = s["ids"], s["starts"]
            if torch.rand((), generator=self.g) < 0.5:
                i = int(starts[torch.randint(len(starts), (), generator=self.g)])
            else:
                i = int(torch.randint(len(ids), (), generator=self.g))
            idx = (torch.arange(self.L) + i) % len(ids)
            out.append(ids[idx].long())
        return torch.stack(out)


def heldout_windows(streams: dict, L: int) -> torch.Tensor:
    """Non-overlapping ``L``-token windows of every held-out stream (fixed)."""
    rows = []
    for s in streams.values():
        ids = s["ids"].long()
        rows.extend(ids[i:i + L] for i in range(0, len(ids) - L + 1, L))
    return torch.stack(rows)


def tokenized_corpus(tok) -> dict:
    """``build/tiny-sdar/corpus.pt`` if the tokenizer stage left it there; otherwise the same corpus
    tokenized with ``tok`` (the bundled tokenizer, which is the one that stage trained)."""
    import corpus

    f = WORK / "corpus.pt"
    if f.is_file():
        return torch.load(f)
    sp = corpus.split()
    data = {w: {k: encode_docs(tok, v) for k, v in corpus.documents(w, sp).items()} for w in ("train", "heldout")}
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(data, f)
    return data


# ----------------------------------------------------------------------------- model
@torch.no_grad()
def check_against_inference(model: SDARForCausalLM, vocab: int, B: int, mask_id: int, seed: int = 0) -> float:
    """Max |train - inference| logit difference, relative to the logits' scale, for a noisy block
    after ``3`` clean blocks: inference = block-causal prefill into the cache + bidirectional denoise."""
    g = torch.Generator().manual_seed(seed)
    k = 3
    x0 = torch.randint(0, vocab, (1, (k + 1) * B), generator=g)
    xt = x0.clone()
    xt[0, k * B + 1] = xt[0, k * B + 3] = mask_id
    ref = train_forward(model, xt, x0, bd_mask((k + 1) * B, B))[0, k * B:]
    model.attention_backend = "torch"
    cache = model.new_cache(1, (k + 1) * B)
    pos = torch.arange(k * B)[None]
    model(x0[:, :k * B], pos, labels_for(k * B, "cpu", grp=pos // B), "block_causal", cache, num_write=k * B,
          logits_slice=None)
    got = model(xt[:, k * B:], torch.arange(k * B, (k + 1) * B)[None], labels_for(B, "cpu"), "bidirectional",
                cache)[0]
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def init_weights(model: SDARForCausalLM, seed: int) -> None:
    torch.manual_seed(seed)
    n = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            torch.nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)


# ----------------------------------------------------------------------------- training
def stage_train(args) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.init_from or WORK / "tokenizer"))
    data = tokenized_corpus(tok)
    B, L, mask_id = args.block, args.seq_len, tok.mask_token_id
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    if args.init_from:  # continue from a saved checkpoint (bf16 weights -> fp32 master weights)
        from simsd.models.loading import load_checkpoint

        cfg = json.loads((Path(args.init_from) / "config.json").read_text())
        cfg.pop("torch_dtype", None)
        assert cfg["block_size"] == B and cfg["mask_token_id"] == mask_id
        model = load_checkpoint(args.init_from, dtype="float32").model
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        cfg = config_dict(vocab_size=len(tok), block_size=B, mask_token_id=mask_id, eos_token_id=stops,
                          max_position_embeddings=args.max_positions, **MODELS[args.model])
        model = SDARForCausalLM(ModelConfig.from_dict(cfg))
        init_weights(model, args.seed)
    teacher = distill.load_teacher(args.teacher) if args.teacher else None
    nparam = sum(p.numel() for p in model.parameters())
    model.double()
    err = check_against_inference(model, len(tok), B, mask_id)
    model.float()
    print(f"{args.model}: {nparam / 1e6:.2f}M params; train-vs-inference forward rel. diff (fp64) {err:.2e}",
          flush=True)
    assert err < 1e-9, "the training forward does not match SDARForCausalLM.forward"
    if teacher is not None:
        err_t = check_against_inference(teacher.double(), len(tok), B, mask_id)
        teacher.float()
        print(f"teacher {args.teacher}: train-vs-inference rel. diff (fp64) {err_t:.2e}", flush=True)
        assert err_t < 1e-9
    sampler = Sampler(data["train"], L, args.seed)
    held = heldout_windows(data["heldout"], L)
    g = torch.Generator().manual_seed(args.seed + 1)
    mask = bd_mask(L, B)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    t0, run = time.time(), None
    log = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x0 = sampler.batch(args.batch)
        if teacher is None:
            loss = bd_loss(model, x0, B, mask_id, mask, g)
        else:
            loss = distill.kd_loss(model, teacher, x0, B, mask_id, mask, g, args.kd_weight, args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        loss = float(loss.detach())
        run = loss if run is None else 0.9 * run + 0.1 * loss
        last = (step == args.steps - 1 or step + 1 == args.stop_step
                or bool(args.max_minutes and time.time() - t0 > 60 * args.max_minutes))
        if step % args.log_every == 0 or last:
            msg = f"step {step} loss {run:.3f} gnorm {gn:.2f} lr {lr_at(step):.2e} {time.time() - t0:.0f}s"
            if step % args.eval_every == 0 or last:
                model.eval()
                hl = heldout_loss(model, held[:args.eval_windows], B, mask_id)
                model.train()
                msg += f" heldout {hl:.3f}"
                log.append({"step": step, "train": run, "heldout": hl, "seconds": time.time() - t0})
                if teacher is not None:
                    log[-1]["heldout_kl"] = distill.heldout_kl(model, teacher, held[:args.eval_windows], B, mask_id)
                    msg += f" heldout-KL {log[-1]['heldout_kl']:.3f}"
            print(msg, flush=True)
        if last:
            break
    seconds = time.time() - t0
    name = f"{args.model}-distilled" if teacher is not None else args.model
    out = Path(args.out or (WORK / name if teacher is not None else ASSETS / f"tiny-sdar-{args.model}"))
    save_checkpoint(out, cfg, {k: v.detach() for k, v in model.state_dict().items()}, tok, dtype=torch.bfloat16,
                    stop_ids=stops)
    portable_files(out)
    from simsd.models.loading import load_checkpoint

    ck = load_checkpoint(out, dtype="float64")
    err_saved = check_against_inference(ck.model, len(tok), B, ck.mask_token_id, seed=1)
    hl_saved = heldout_loss(ck.model.float(), held, B, mask_id)
    summary = {"model": args.model, "params": nparam, "steps": step + 1, "planned_steps": args.steps,
               "batch": args.batch, "seq_len": L, "block": B, "lr": args.lr, "seed": args.seed, "threads": args.threads,
               "train_seconds": seconds,
               "tokens_seen": (step + 1) * args.batch * L, "heldout_windows": len(held),
               "heldout_loss_bf16": hl_saved, "saved_check_rel_diff": err_saved, "log": log}
    if teacher is not None:
        summary.update(init_from=str(args.init_from), teacher=str(args.teacher), kd_weight=args.kd_weight,
                       ce_weight=args.ce_weight,
                       heldout_kl_bf16=distill.heldout_kl(ck.model, teacher, held, B, mask_id))
        print(f"heldout KL(teacher || student) (bf16 weights) {summary['heldout_kl_bf16']:.3f}")
    (WORK / f"summary-{name}.json").write_text(json.dumps(summary, indent=1))
    print(f"saved {out}: heldout loss (bf16 weights) {hl_saved:.3f}, check {err_saved:.1e}, {seconds:.0f}s")


def portable_files(out: Path) -> None:
    """bf16 in config.json; a tokenizer_config.json that transformers 4.x and 5.x both load
    (``PreTrainedTokenizerFast``, chat template inline as well as in chat_template.jinja)."""
    from simsd.testing import CHAT_TEMPLATE

    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    for k in ("is_local", "local_files_only", "backend"):
        tc.pop(k, None)
    tc.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg["max_position_embeddings"],
              chat_template=CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--vocab-size", type=int, default=6144)
    r = sub.add_parser("train")
    r.add_argument("--model", choices=sorted(MODELS), required=True)
    r.add_argument("--steps", type=int, default=700)
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--block", type=int, default=4)
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--warmup", type=int, default=30)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--max-positions", type=int, default=2048)
    r.add_argument("--log-every", type=int, default=25)
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument("--eval-windows", type=int, default=48, help="held-out windows for the periodic eval")
    r.add_argument("--max-minutes", type=float, default=0,
                   help="safety stop (0: none); the steps done are recorded: rerun with --stop-step to reproduce")
    r.add_argument("--stop-step", type=int, default=0, help="stop after this many steps (schedule still --steps)")
    r.add_argument("--out", default=None)
    r.add_argument("--init-from", default=None, help="start from this checkpoint's weights and tokenizer")
    r.add_argument("--teacher", default=None, help="distil toward this checkpoint (tools/distill.py)")
    r.add_argument("--kd-weight", type=float, default=1.0, help="weight of KL(teacher || student)")
    r.add_argument("--ce-weight", type=float, default=0.0, help="weight of the 1/t CE when distilling")
    args = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    {"tokenizer": stage_tokenizer, "train": stage_train}[args.stage](args)


if __name__ == "__main__":
    main()
