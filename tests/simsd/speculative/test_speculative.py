"""SimSD verification (paper and exact layouts) and the speculative decoder."""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.layouts import exact_layout
from simsd.models.model import labels_for
from simsd.speculative import SpecConfig, speculative_generate
from simsd.speculative.verification import accept_in_order, paper_layout, token_verdicts
from simsd_kernels import TAU_INF
from tests.helpers import layout_tensors, random_checkpoint, rejection_rng

V = 96


def ckpt(name, layers=2, dtype="float64", seed=0, vocab=V, std=0.2):
    path = random_checkpoint(name, tokenizer=False, vocab_size=vocab, num_hidden_layers=layers, seed=seed, std=std)
    return load_checkpoint(path, dtype=dtype, with_tokenizer=False)


class Runner:
    """One sequence over its own cache: block-causal prefill, then read-only forwards."""

    def __init__(self, model, prompt, B=4):
        self.model, self.cache = model, model.new_cache(1, 64)
        aligned = len(prompt) // B * B
        pos = torch.arange(aligned)[None]
        model(torch.tensor([prompt[:aligned]]), pos, labels_for(aligned, "cpu", grp=pos // B), "block_causal",
              self.cache, num_write=aligned, logits_slice=None)
        self.cached = aligned

    def forward(self, ids, pos, lab, mode):
        return self.model(ids, pos, lab, mode, self.cache)

    def denoise_logits(self, block):
        L = block.shape[0]
        return self.forward(block[None], torch.arange(self.cached, self.cached + L)[None], labels_for(L, "cpu"),
                            "bidirectional")[0]


def prefilled(model, prompt, B=4):
    return Runner(model, prompt, B)


def sequential_states(block, drafted, tau, mask_id, n):
    """State before draft step s (s = 1..n): the block plus draft tokens with tau < s."""
    return [torch.where((tau < s) & (block == mask_id), drafted, block) for s in range(1, n + 1)]


def random_round(seed, mask_id, B=4, n_known=1):
    g = torch.Generator().manual_seed(seed)
    block = torch.full((B,), mask_id)
    block[:n_known] = torch.randint(0, mask_id, (n_known,), generator=g)
    drafted = block.clone()
    drafted[n_known:] = torch.randint(0, mask_id, (B - n_known,), generator=g)
    tau = torch.full((B,), 0, dtype=torch.int64)
    tau[n_known:] = torch.tensor([1, 2, 2, 3, 4, 4, 5][: B - n_known])  # ties allowed
    tau[:n_known] = TAU_INF
    return block, drafted, tau


def verification_vs_sequential(model, mask_id, mode, rope_copy=True):
    prompt = list(range(1, 9))
    runner = prefilled(model, prompt)
    block, drafted, tau = random_round(3, mask_id)
    known = block != mask_id
    n = int(tau[~known].max())
    states = sequential_states(block, drafted, tau, mask_id, n)
    start = runner.cached
    seq = torch.stack([runner.denoise_logits(s) for s in states])  # (n, B, V)
    if mode == "paper":
        ids, pos, lab, taus, m_index = paper_layout(block, known, drafted, torch.where(known, TAU_INF, tau), start,
                                                    rope_copy)
        logits = runner.forward(*layout_tensors(ids, pos, lab, taus), "paper")[0]
        got = torch.stack([logits[m_index[p]] for p in range(4) if not known[p]])
        want = torch.stack([seq[int(tau[p]) - 1, p] for p in range(4) if not known[p]])
    else:
        got = runner.forward(*layout_tensors(*exact_layout(states, start)), "exact")[0].view(n, 4, -1)
        want = seq
    return got, want


def test_paper_one_layer_equals_sequential():
    c = ckpt("one-layer", layers=1)
    got, want = verification_vs_sequential(c.model, c.mask_token_id, "paper")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_paper_two_layers_is_an_approximation():
    c = ckpt("two-layer", layers=2)
    got, want = verification_vs_sequential(c.model, c.mask_token_id, "paper")
    assert (got - want).abs().max() > 1e-6  # the approximation of docs/design.md §4.1 is real


@pytest.mark.parametrize("layers", [1, 3])
def test_exact_equals_sequential(layers):
    c = ckpt(f"exact-{layers}", layers=layers)
    got, want = verification_vs_sequential(c.model, c.mask_token_id, "exact")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_no_rope_copy_equals_moved_mask_positions():
    """The ablation (no RoPE copy): on a one-layer model each M slot's logits equal a
    bidirectional denoise forward of its state in which the still-masked positions sit where
    the layout puts the M slots (after the block: start + L + j for the j-th unknown position)."""
    c = ckpt("one-layer", layers=1)
    mask_id = c.mask_token_id
    runner = prefilled(c.model, list(range(1, 9)))
    block, drafted, tau = random_round(3, mask_id)
    known = block != mask_id
    unk = [i for i in range(4) if not known[i]]
    n = int(tau[~known].max())
    states = sequential_states(block, drafted, tau, mask_id, n)
    start = runner.cached
    ids, pos, lab, taus, m_index = paper_layout(block, known, drafted, torch.where(known, TAU_INF, tau), start,
                                                rope_copy=False)
    logits = runner.forward(*layout_tensors(ids, pos, lab, taus), "paper")[0]
    with_copy, _ = verification_vs_sequential(c.model, mask_id, "paper", rope_copy=True)
    got = torch.stack([logits[m_index[p]] for p in unk])
    want = []
    for p in unk:
        s = states[int(tau[p]) - 1]
        moved = torch.tensor([[start + i if s[i] != mask_id else start + 4 + unk.index(i) for i in range(4)]])
        out = runner.forward(s[None], moved, labels_for(4, "cpu"), "bidirectional")[0]
        want.append(out[p])
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-10)
    assert (got - with_copy).abs().max() > 1e-3  # the copy matters


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
@pytest.mark.parametrize("B", [4, 8])
@pytest.mark.parametrize("prompt_len", [8, 13])
@pytest.mark.parametrize("draft_kind", ["self", "poor"])
def test_exact_greedy_equals_vanilla_target(strategy, B, prompt_len, draft_kind):
    target = ckpt("target")
    draft = target if draft_kind == "self" else ckpt("poor-draft", layers=1, seed=11)
    prompt = torch.randint(0, V - 2, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    cfg = DecodeConfig(block_length=B, strategy=strategy, max_new_tokens=3 * B + 2,
                       threshold=0.05 if strategy == "dynamic" else None)
    want = vanilla_generate(target.model, prompt, cfg, target.mask_token_id, target.stop_ids)
    got = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode="exact"))
    assert got.token_ids == want.token_ids
    s = got.stats
    assert s["proposed"] >= s["accepted"] >= 0 and s["rounds"] >= 1
    if draft_kind == "self":
        # the target as its own draft: every draft step is accepted
        assert s["acceptance_rate"] == 1.0
        assert s["target_forwards"] <= want.stats["target_forwards"]
        if strategy == "static":  # one token per step: speculation must save target forwards
            assert s["target_forwards"] < want.stats["target_forwards"]


def test_paper_greedy_self_draft_one_layer_equals_vanilla():
    # with one layer the paper mask is exact, so a self-draft is always accepted
    c = ckpt("one-layer", layers=1)
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=12)
    want = vanilla_generate(c.model, list(range(1, 10)), cfg, c.mask_token_id, c.stop_ids)
    got = speculative_generate(c, c, list(range(1, 10)), cfg, SpecConfig(mode="paper"))
    assert got.token_ids == want.token_ids
    assert got.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("on_reject", ["redraft", "fallback"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_paper_greedy_one_layer_poor_draft_equals_vanilla(on_reject, gamma):
    """With one layer the paper mask is exact and greedy matching commits the target's argmax
    in the draft's order; with the sequential strategy that order is the target's, so even a
    poor draft gives the vanilla target's tokens (redraft and the paper's fallback)."""
    target, draft = ckpt("one-layer", layers=1), ckpt("poor-draft", layers=1, seed=11)
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=16)
    prompt = list(range(1, 10))
    want = vanilla_generate(target.model, prompt, cfg, target.mask_token_id, target.stop_ids)
    r = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode="paper", on_reject=on_reject, gamma=gamma))
    assert r.token_ids == want.token_ids and len(r.token_ids) == 16
    if on_reject == "fallback":
        assert r.stats["fallback_steps"] > 0


def test_stop_inside_accepted_prefix():
    target = ckpt("target")
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=32)
    free = speculative_generate(target, target, list(range(1, 9)), cfg, SpecConfig(mode="exact"))
    stop = free.token_ids[6]
    first = free.token_ids.index(stop)
    stopped = dataclasses.replace(target, stop_ids=[stop])
    for mode in ("exact", "paper"):
        r = speculative_generate(stopped, stopped, list(range(1, 9)), cfg, SpecConfig(mode=mode))
        assert r.token_ids[-1] == stop and stop not in r.token_ids[:-1]
        assert len(r.token_ids) == first + 1 and r.stats["new_tokens"] == first + 1
        assert r.stats["blocks"] == first // 4 + 1


def test_mismatched_pair_is_rejected():
    target, other = ckpt("target"), ckpt("other-vocab", vocab=80)
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, other, [1, 2, 3, 4], DecodeConfig(), SpecConfig())


def test_token_verdicts_keep_target_distribution():
    """Rejection sampling of N independent draft draws at once: the committed token (the draft's
    if accepted, else the replacement) follows p_t (chi-square); a zero-probability token never
    comes out."""
    from scipy.stats import chisquare
    g = torch.Generator().manual_seed(0)
    p_t = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    p_d = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    N = 20000
    x = torch.multinomial(p_d, N, replacement=True, generator=g)
    logits = p_t.log().expand(N, 5)
    ok, repl = token_verdicts(logits, x, p_d.expand(N, 5), SamplingParams(temperature=1.0), rejection_rng(N, 5, g))
    committed = torch.where(ok, x, repl)
    counts = torch.bincount(committed, minlength=5).double()
    assert counts[4] == 0
    assert chisquare(counts[:4].numpy(), (p_t[:4] * N).double().numpy()).pvalue > 1e-3
    # acceptance probability of each draft token is min(1, p_t / p_d)
    rate = torch.tensor([float(ok[x == t].double().mean()) for t in range(4)])
    torch.testing.assert_close(rate, torch.minimum(p_t[:4] / p_d[:4], torch.ones(4)), atol=0.03, rtol=0)


def reference_accept(block, drafted, tau, n, ok, repl):
    """accept_in_order written as a loop over steps and positions."""
    new, prop = list(block), 0
    for c in range(1, n + 1):
        step = [p for p in range(len(block)) if tau[p] == c]
        prop += len(step)
        for j, p in enumerate(step):
            if not ok[p]:
                new[p] = repl[p]
                return new, True, c, sum(1 for q in range(len(block)) if tau[q] < c) + j
            new[p] = drafted[p]
    return new, False, n, prop


def test_accept_in_order_equals_loop():
    g = torch.Generator().manual_seed(1)
    L = 6
    for trial in range(300):
        n = int(torch.randint(1, 5, (1,), generator=g))
        tau = torch.randint(1, n + 3, (L,), generator=g)
        tau = torch.where(tau > n, TAU_INF, tau)
        block = torch.where(tau <= n, 99, torch.randint(0, 9, (L,), generator=g))
        drafted = torch.where(tau <= n, torch.randint(10, 20, (L,), generator=g), block)
        ok = torch.rand(L, generator=g) < 0.8
        repl = torch.randint(20, 30, (L,), generator=g)
        new, rejected, taken, acc = accept_in_order(block, drafted, tau, n, ok, repl)
        want = reference_accept(block.tolist(), drafted.tolist(), tau.tolist(), n, ok.tolist(), repl.tolist())
        assert (new.tolist(), bool(rejected), int(taken), int(acc)) == want, trial


# end-to-end rejection sampling (several draft steps, exact expectations): test_rejection_sampling.py


@pytest.mark.parametrize("mode", ["exact", "paper"])
@pytest.mark.parametrize("draft_kind", ["self", "poor"])
def test_folded_commits(mode, draft_kind):
    """Folding each block's commit into the next forward changes no token and saves forwards."""
    target = ckpt("target")
    draft = target if draft_kind == "self" else ckpt("poor-draft", layers=1, seed=11)
    prompt = list(range(2, 13))
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=18)
    folded = dataclasses.replace(cfg, fold_commit=True)
    plain = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode=mode))
    fold = speculative_generate(target, draft, prompt, folded, SpecConfig(mode=mode))
    assert fold.token_ids == plain.token_ids
    assert fold.stats["draft_forwards"] < plain.stats["draft_forwards"]
    if mode == "exact":
        assert fold.token_ids == vanilla_generate(target.model, prompt, folded, target.mask_token_id, []).token_ids
        assert fold.stats["target_forwards"] < plain.stats["target_forwards"]
    else:  # the paper layout cannot hold a folded commit: the target runs it separately
        assert fold.stats["target_forwards"] == plain.stats["target_forwards"]
