"""An independent SDAR block decoder for the tests: shares no decoding code with simsd.

Everything the decoder decides is written here again, from the design reference
(docs/design.md §2-§3), in the plainest form: loops over positions, float64 everywhere, and a
full recomputation of the sequence at every step (no KV cache). The forward pass is
transformers' ``Qwen3ForCausalLM`` (not simsd's model) loaded from the checkpoint files with
safetensors, run with a block-causal mask built here; its norms and RoPE are replaced by float64
versions written here (transformers computes both in float32 whatever the model dtype).

* :class:`ReferenceModel`: the checkpoint (weights, mask id, stop ids) and ``block_logits``.
* :func:`schedule`: tokens per denoising step.
* :func:`filtered`, :func:`confidences`, :func:`choose`: the sampling rule, the confidence
  rule and the four remasking strategies.
* :func:`reference_generate`: greedy block decoding with stops (returns a trace of every step),
  optionally with vLLM's presence, frequency and repetition penalties (:func:`penalized`).
* :func:`reference_paper_generate`: greedy SimSD in the paper's layout (§4): the draft's steps,
  the ``[leftover | D | M]`` query with the four-quadrant mask and the RoPE copy, acceptance
  in the draft's temporal order, gamma and the fallback.
* :func:`step_outcomes`: the exact probability of every outcome of one denoising step under
  sampling (enumeration of the joint draw), for chi-square tests of simsd's sampled steps.
"""
from __future__ import annotations

import itertools
import json
import math
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

# ----------------------------------------------------------------------------------------------
# the forward: transformers' Qwen3 in float64 with a mask built here


def _norm_f64(self, x):
    """RMSNorm in float64 (transformers' Qwen3RMSNorm casts to float32)."""
    x64 = x.to(torch.float64)
    y = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.to(torch.float64) * y).to(x.dtype)


class _RopeF64(torch.nn.Module):
    """cos/sin tables of rotate-half RoPE computed in float64 (``theta ** (-2i / D)``)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x, position_ids):
        i = torch.arange(0, self.head_dim, 2, dtype=torch.float64)
        inv_freq = 1.0 / (self.theta ** (i / self.head_dim))
        ang = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class ReferenceModel:
    """A checkpoint directory read without simsd: transformers' Qwen3 in float64.

    ``mask_id``: ``config.json`` ``mask_token_id`` (else the tokenizer's ``<|MASK|>``);
    ``stop_ids``: ``generation_config.json`` ``eos_token_id`` (int or list).
    """

    def __init__(self, path):
        from safetensors.torch import load_file
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.models.qwen3 import modeling_qwen3

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        fields = {k: v for k, v in raw.items()
                  if k not in ("model_type", "architectures", "block_size", "mask_token_id", "auto_map", "torch_dtype",
                               "rope_theta")}
        theta = float(raw.get("rope_theta", 1e6))
        hf_cfg = Qwen3Config(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta},
                             attn_implementation="sdpa")
        model = Qwen3ForCausalLM(hf_cfg)
        state = {}
        files = sorted(path.glob("*.safetensors"))
        for f in files:
            state.update(load_file(str(f)))
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        model = model.to(torch.float64).eval()
        for m in model.modules():
            if isinstance(m, modeling_qwen3.Qwen3RMSNorm):
                m.forward = types.MethodType(_norm_f64, m)
        model.model.rotary_emb = _RopeF64(hf_cfg.head_dim, theta)
        self.model = model
        self.vocab_size = raw["vocab_size"]
        self.mask_id = raw.get("mask_token_id")
        if self.mask_id is None:
            tok = json.loads((path / "tokenizer.json").read_text())
            self.mask_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|MASK|>")
        gen = path / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else raw.get("eos_token_id")
        self.stop_ids = [] if eos is None else sorted(set(eos if isinstance(eos, list) else [eos]))

    @torch.no_grad()
    def logits(self, ids: list, visible, positions: list | None = None) -> torch.Tensor:
        """float64 logits ``(len(ids), V)`` of the whole sequence ``ids`` at ``positions``
        (default 0..n-1), where token ``i`` attends token ``j`` iff ``visible(i, j)``."""
        n = len(ids)
        mask = torch.tensor([[bool(visible(i, j)) for j in range(n)] for i in range(n)])
        pos = torch.arange(n) if positions is None else torch.tensor(positions)
        out = self.model(input_ids=torch.tensor([ids]), position_ids=pos[None],
                         attention_mask=mask[None, None], use_cache=False)
        return out.logits[0].to(torch.float64)

    def block_logits(self, context: list, block: list, block_length: int) -> torch.Tensor:
        """Logits ``(B, V)`` of the last block of ``context + block`` under the block-causal mask
        (token i sees j iff j's block index <= i's), recomputed from scratch; the MASK logit is
        removed (a step never reveals MASK)."""
        ids = list(context) + list(block)
        assert len(context) % block_length == 0
        out = self.logits(ids, lambda i, j: j // block_length <= i // block_length)[len(context):]
        out[:, self.mask_id] = -math.inf
        return out


# ----------------------------------------------------------------------------------------------
# the decoding rules


def schedule(block_length: int, steps: int) -> list:
    """Tokens revealed per step: B tokens dealt to the steps one at a time, first step first
    (so each step gets ``B // steps`` and the first ``B % steps`` steps one more)."""
    counts = [0] * steps
    for t in range(block_length):
        counts[t % steps] += 1
    return counts


def tokens_at(sched: list, step: int) -> int:
    """The schedule's count at 0-based ``step``; steps past the schedule repeat its last entry."""
    return sched[step] if step < len(sched) else sched[-1]


def softmax64(row: torch.Tensor, temperature: float) -> list:
    """Softmax of one logit row at ``temperature`` as a list of floats (float64)."""
    z = row.to(torch.float64) / temperature
    z = z - z[torch.isfinite(z)].max()
    e = torch.where(torch.isfinite(z), torch.exp(z), torch.zeros_like(z))
    return (e / e.sum()).tolist()


def filtered(row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> list:
    """The distribution a token is drawn from (list of floats): temperature, then the ``top_k``
    largest, then the smallest head of the renormalised rest whose mass reaches ``top_p`` (the
    token that crosses ``top_p`` is kept), renormalised."""
    p = softmax64(row, temperature)
    V = len(p)
    order = sorted(range(V), key=lambda t: -p[t])
    keep = set(t for t in order if p[t] > 0)
    if top_k and top_k < V:
        keep = set(order[:top_k])
    if top_p < 1.0:
        mass = sum(p[t] for t in keep)
        head, acc = set(), 0.0
        for t in order:
            if t not in keep:
                continue
            if acc >= top_p:
                break
            head.add(t)
            acc += p[t] / mass
        keep = head
    mass = sum(p[t] for t in keep)
    return [p[t] / mass if t in keep else 0.0 for t in range(V)]


def entropy(row: torch.Tensor, temperature: float) -> float:
    p = softmax64(row, temperature)
    return -sum(x * math.log(x) for x in p if x > 0)


def choose(strategy: str, masked: list, conf: list, ent: list, k: int, threshold) -> list:
    """Positions a step reveals (sorted list), from the masked positions ``masked`` (list of
    bools), the confidence and entropy per position and the schedule's ``k``.

    sequential: the first k masked positions; static: the k most confident (ties: lower
    position); dynamic: all masked positions with confidence > threshold if there are at least
    k, else as static; entropy: the longest run of lowest-entropy positions whose summed entropy
    is <= threshold, at least one. ``k`` is clipped to [1, masked count]."""
    idx = [i for i, m in enumerate(masked) if m]
    if not idx:
        return []
    k = min(max(k, 1), len(idx))
    by_conf = sorted(idx, key=lambda i: (-conf[i], i))
    if strategy == "sequential":
        out = idx[:k]
    elif strategy == "static":
        out = by_conf[:k]
    elif strategy == "dynamic":
        above = [i for i in idx if conf[i] > threshold]
        out = above if len(above) >= k else by_conf[:k]
    elif strategy == "entropy":
        by_ent = sorted(idx, key=lambda i: (ent[i], i))
        out, total = [], 0.0
        for i in by_ent:
            if total + ent[i] > threshold:
                break
            out.append(i)
            total += ent[i]
        out = out or by_ent[:1]
    else:
        raise ValueError(strategy)
    return sorted(out)


DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}  # docs/design.md §3.5


@dataclass
class ReferenceResult:
    token_ids: list
    #: per block: the list of (positions revealed, tokens) of each step
    trace: list = field(default_factory=list)
    #: per generated token (before the cut): whether the draft proposed it and the target accepted it
    origins: list = field(default_factory=list)

    def step_sizes(self) -> list:
        return [len(p) for blk in self.trace for p, _ in blk]


def penalized(row: torch.Tensor, prompt: list, output: list, presence: float, frequency: float,
              repetition: float) -> torch.Tensor:
    """One logit row with vLLM's penalties, written from vLLM's description (its sampler's
    ``apply_penalties``): a token of the prompt or of ``output`` has its logit divided by
    ``repetition`` when positive, multiplied by it otherwise; then each token loses ``frequency``
    per time ``output`` holds it and ``presence`` once if ``output`` holds it. Float64, a loop
    over the vocabulary."""
    out = row.clone().to(torch.float64)
    for t in range(out.shape[0]):
        c = output.count(t)
        x = float(out[t])
        if t in prompt or c:
            x = x / repetition if x > 0 else x * repetition
        out[t] = x - frequency * c - presence * (1 if c else 0)
    return out


def reference_generate(ref: ReferenceModel, prompt: list, *, block_length: int, steps: int | None = None,
                       strategy: str = "static", threshold: float | None = None, max_new_tokens: int = 16,
                       stop_ids=None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0) -> ReferenceResult:
    """Greedy SDAR block decoding, recomputing the whole sequence at every step.

    Blocks are aligned to position 0; the unaligned prompt tail opens the first block. Each step
    takes every masked position's argmax, its confidence (softmax at temperature 1, MASK
    excluded) and entropy, reveals the positions ``choose`` picks. After a block with no MASK
    left: stop if one of its generated tokens is a stop id or ``max_new_tokens`` are reached.
    The returned ids end at the first stop id (kept) and at ``max_new_tokens``.

    Penalties (any away from 0, 0, 1): before the argmax every position's logits get
    :func:`penalized` with the output so far of the block's state: the tokens generated in earlier
    blocks and those revealed in this block (not the prompt tail, not MASK).
    """
    B = block_length
    sched = schedule(B, steps or B)
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    stops = set(ref.stop_ids if stop_ids is None else stop_ids)
    context, tail = split_prompt(prompt, B)
    generated, trace = [], []
    while True:
        block = tail + [ref.mask_id] * (B - len(tail))
        first = len(tail)
        tail, steps_of_block, step = [], [], 0
        while ref.mask_id in block:
            logits = ref.block_logits(context, block, B)
            if (presence_penalty, frequency_penalty, repetition_penalty) != (0.0, 0.0, 1.0):
                output = generated + [t for t in block[first:] if t != ref.mask_id]
                logits = torch.stack([penalized(logits[i], prompt, output, presence_penalty, frequency_penalty,
                                                repetition_penalty) for i in range(B)])
            masked = [t == ref.mask_id for t in block]
            best = [int(torch.argmax(logits[i])) for i in range(B)]
            conf = [softmax64(logits[i], 1.0)[best[i]] for i in range(B)]
            ent = [entropy(logits[i], 1.0) for i in range(B)]
            pos = choose(strategy, masked, conf, ent, tokens_at(sched, step), threshold)
            assert pos, "a step must reveal a position"
            for i in pos:
                block[i] = best[i]
            steps_of_block.append((pos, [best[i] for i in pos]))
            step += 1
        trace.append(steps_of_block)
        context += block
        generated += block[first:]
        if stops & set(block[first:]) or len(generated) >= max_new_tokens:
            break
    return ReferenceResult(returned_ids(generated, max_new_tokens, stops), trace)


def split_prompt(prompt: list, B: int) -> tuple:
    """``(context, tail)``: the block-aligned part of the prompt and the rest (it opens the first block)."""
    cut = len(prompt) - len(prompt) % B
    return list(prompt[:cut]), list(prompt[cut:])


def returned_ids(generated: list, max_new_tokens: int, stops: set) -> list:
    """The returned ids: ``generated`` up to the first stop id (kept) and at ``max_new_tokens``."""
    out = []
    for t in generated[:max_new_tokens]:
        out.append(t)
        if t in stops:
            break
    return out


def step_outcomes(logits: torch.Tensor, masked: list, strategy: str, k: int, threshold=None,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> dict:
    """Exact distribution of one sampled denoising step: ``{((pos, token), ...): probability}``.

    Every masked position draws its token independently from :func:`filtered`; confidence is the
    drawn token's probability under the temperature-scaled distribution *before* filtering,
    entropy that distribution's entropy; :func:`choose` picks the revealed positions. The joint
    draws are enumerated (keep the supports small). ``logits (L, V)`` have the MASK logit
    removed already.
    """
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    L = logits.shape[0]
    idx = [i for i in range(L) if masked[i]]
    dist = {i: filtered(logits[i], temperature, top_k, top_p) for i in idx}
    base = {i: softmax64(logits[i], temperature) for i in idx}
    ent = [entropy(logits[i], temperature) if masked[i] else 0.0 for i in range(L)]
    support = {i: [t for t, q in enumerate(dist[i]) if q > 0] for i in idx}
    out: dict = {}
    for combo in itertools.product(*(support[i] for i in idx)):
        draw = dict(zip(idx, combo))
        prob = math.prod(dist[i][draw[i]] for i in idx)
        conf = [base[i][draw[i]] if masked[i] else 0.0 for i in range(L)]
        pos = choose(strategy, masked, conf, ent, k, threshold)
        key = tuple((i, draw[i]) for i in pos)
        out[key] = out.get(key, 0.0) + prob
    return out


# ----------------------------------------------------------------------------------------------
# SimSD, paper layout (greedy)

INF = float("inf")


def quadrant(kind_q: str, tau_q: float, kind_k: str, tau_k: float) -> bool:
    """The four-quadrant rule of §4 (kinds "K" leftover, "D", "M")."""
    if kind_k == "K":
        return kind_q in ("K", "D", "M")
    if kind_q == "D":
        return tau_k <= tau_q if kind_k == "D" else tau_k > tau_q
    if kind_q == "M":
        return tau_k < tau_q if kind_k == "D" else tau_k >= tau_q
    return False


def greedy_step(ref: ReferenceModel, context: list, block: list, B: int, strategy: str, k: int, threshold):
    """One greedy denoising step of ``block`` by ``ref``: ``(new block, revealed positions)``."""
    logits = ref.block_logits(context, block, B)
    masked = [t == ref.mask_id for t in block]
    best = [int(torch.argmax(logits[i])) for i in range(B)]
    conf = [softmax64(logits[i], 1.0)[best[i]] for i in range(B)]
    ent = [entropy(logits[i], 1.0) for i in range(B)]
    pos = choose(strategy, masked, conf, ent, k, threshold)
    assert pos, "a step must reveal a position"
    return [best[i] if i in pos else t for i, t in enumerate(block)], pos


def paper_verify(target: ReferenceModel, context: list, block: list, drafted: list, tau: list, B: int,
                 rope_copy: bool) -> dict:
    """The target's argmax at each unknown position's M slot: ``{position: token}``."""
    mask_id = target.mask_id
    left = [i for i in range(B) if block[i] != mask_id]
    unk = [i for i in range(B) if block[i] == mask_id]
    C = len(context)
    kinds = ["K"] * len(left) + ["D"] * len(unk) + ["M"] * len(unk)
    taus = [0.0] * len(left) + [tau[i] for i in unk] * 2
    ids = [block[i] for i in left] + [drafted[i] for i in unk] + [mask_id] * len(unk)
    m_pos = [C + i for i in unk] if rope_copy else [C + B + j for j in range(len(unk))]
    positions = list(range(C)) + [C + i for i in left] + [C + i for i in unk] + m_pos

    def visible(i, j):
        if i < C:  # context tokens: block-causal among themselves, never the query
            return j < C and j // B <= i // B
        if j < C:
            return True
        a, b = i - C, j - C
        return quadrant(kinds[a], taus[a], kinds[b], taus[b])

    logits = target.logits(context + ids, visible, positions)
    logits[:, mask_id] = -math.inf
    first_m = C + len(left) + len(unk)
    return {p: int(torch.argmax(logits[first_m + j])) for j, p in enumerate(unk)}


def reference_paper_generate(target: ReferenceModel, draft: ReferenceModel, prompt: list, *, block_length: int,
                             steps: int | None = None, strategy: str = "static", threshold: float | None = None,
                             gamma: int | None = None, on_reject: str = "redraft", rope_copy: bool = True,
                             max_new_tokens: int = 16, stop_ids=None) -> ReferenceResult:
    """Greedy SimSD with the paper's verification, recomputing everything from scratch.

    A round: unless the fallback applies (``on_reject == "fallback"`` and fewer MASK than
    ``gamma`` left: one vanilla target step), the draft makes up to ``gamma`` steps of its own
    (schedule entries ``block_step + c``), each revealed position gets ``tau = c + 1``; the
    target reads every unknown position at its M slot; proposals are taken in (tau, position)
    order while the draft token is the target's argmax; the first mismatch takes the argmax and
    ends the round. ``block_step`` advances by the steps the round used (the rejected
    proposal's tau, else the draft's step count). ``trace``: per block, per round, the tokens
    committed as ``(positions, tokens)``.
    """
    B = block_length
    sched = schedule(B, steps or B)
    gamma = gamma or B
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    mask_id = target.mask_id
    stops = set(target.stop_ids if stop_ids is None else stop_ids)
    context, tail = split_prompt(prompt, B)
    generated, trace = [], []
    while True:
        block = tail + [mask_id] * (B - len(tail))
        first, tail, block_step, rounds = len(tail), [], 0, []
        while mask_id in block:
            masks = block.count(mask_id)
            if on_reject == "fallback" and masks < gamma:
                block, pos = greedy_step(target, context, block, B, strategy, tokens_at(sched, block_step), threshold)
                rounds.append((pos, [block[i] for i in pos]))
                block_step += 1
                continue
            state, tau, n = list(block), [INF] * B, 0
            for c in range(gamma):
                if mask_id not in state:
                    break
                state, pos = greedy_step(draft, context, state, B, strategy, tokens_at(sched, block_step + c),
                                         threshold)
                for i in pos:
                    tau[i] = c + 1
                n += 1
            best = paper_verify(target, context, block, state, tau, B, rope_copy)
            order = sorted((p for p in range(B) if tau[p] <= n), key=lambda p: (tau[p], p))
            new, taken, done = list(block), n, []
            for p in order:
                if state[p] == best[p]:
                    new[p] = state[p]
                    done.append(p)
                    continue
                new[p] = best[p]
                done.append(p)
                taken = int(tau[p])
                break
            rounds.append((sorted(done), [new[p] for p in sorted(done)]))
            block, block_step = new, block_step + taken
        trace.append(rounds)
        context += block
        generated += block[first:]
        if stops & set(block[first:]) or len(generated) >= max_new_tokens:
            break
    return ReferenceResult(returned_ids(generated, max_new_tokens, stops), trace)


def reference_release_generate(target: ReferenceModel, draft: ReferenceModel, prompt: list, *, block_length: int,
                               steps: int | None = None, strategy: str = "static", threshold: float | None = None,
                               max_new_tokens: int = 16, stop_ids=None) -> ReferenceResult:
    """Greedy SimSD as the SimSD release's loop runs it (``configs/experiments/sdar.yaml``,
    method ``ours``), recomputing everything from scratch. Written from the release's
    description, not from simsd's code:

    A round: the known tokens of the block are a prefix (the prompt tail, then committed
    tokens); the draft denoises the rest with ``steps`` steps of its own, step ``s`` (1-based)
    revealing ``ceil(masked / (steps - s + 1))`` positions counted before the step, until no
    MASK is left; the target reads every drafted position at its M slot (paper layout, RoPE
    copy); positions are judged from left to right; the first one whose draft token is not the
    target's argmax takes the argmax, and the positions after it become MASK again; if none is
    rejected the draft's tokens are committed and nothing else. ``trace``: per block, per
    round, ``(positions, tokens)`` committed; ``origins``: per generated token, whether it is an
    accepted draft token.
    """
    B = block_length
    steps = steps or B
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    mask_id = target.mask_id
    stops = set(target.stop_ids if stop_ids is None else stop_ids)
    context, tail = split_prompt(prompt, B)
    generated, trace = [], []
    origins = []
    while True:
        known = list(tail)
        first, tail, rounds, origin = len(known), [], [], [False] * len(known)
        while len(known) < B:
            state, tau, s = known + [mask_id] * (B - len(known)), [INF] * B, 0
            while mask_id in state:
                s += 1
                masked = state.count(mask_id)
                k = -(-masked // max(steps - s + 1, 1))
                state, pos = greedy_step(draft, context, state, B, strategy, k, threshold)
                for i in pos:
                    tau[i] = s
            block = known + [mask_id] * (B - len(known))
            best = paper_verify(target, context, block, state, tau, B, True)
            committed, accepted = [], []
            for p in range(len(known), B):
                committed.append(best[p] if state[p] != best[p] else state[p])
                accepted.append(state[p] == best[p])
                if state[p] != best[p]:
                    break
            rounds.append((list(range(len(known), len(known) + len(committed))), committed))
            known += committed
            origin += accepted
        trace.append(rounds)
        context += known
        generated += known[first:]
        origins += origin[first:]
        if stops & set(known[first:]) or len(generated) >= max_new_tokens:
            break
    return ReferenceResult(returned_ids(generated, max_new_tokens, stops), trace, origins)
