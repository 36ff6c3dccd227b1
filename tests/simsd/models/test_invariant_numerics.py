"""Shape-invariant numerics (docs/design.md §4.2): a state's logits inside an exact-mode verify forward
equal, bit for bit, the logits of a denoise forward of that state, in every dtype.

The torch attention reference computes each group of query tokens over exactly its visible keys;
``SDARForCausalLM.invariant`` runs the token-wise parts (norms, projections, MLP, lm_head) per
block-sized unit. The Triton kernels run under the interpreter here.
"""
import os

import pytest
import torch

from simsd import load_checkpoint
from simsd.decoding.layouts import exact_layout
from simsd.models.model import labels_for, per_unit
from simsd_kernels import SHARED_GRP
from tests.helpers import layout_tensors, random_checkpoint

pytestmark = pytest.mark.bitwise
V = 96
DTYPES = ["bfloat16", "float16", "float32"]


def model_of(dtype, backend="torch", name="inv-target", layers=2, seed=0):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.3)
    m = load_checkpoint(path, dtype=dtype, with_tokenizer=False).model
    m.attention_backend = backend
    m.invariant = True
    return m


def bundled_target(dtype):
    import simsd.assets
    path = os.path.join(os.path.dirname(simsd.assets.__file__), "tiny-sdar-target")
    m = load_checkpoint(path, dtype=dtype, with_tokenizer=False).model
    m.invariant = True
    return m


def prefilled(m, P, B, g, vocab):
    cache = m.new_cache(1, P + 16 * B)
    pos = torch.arange(P)[None]
    m(torch.randint(0, vocab - 2, (1, P), generator=g), pos, labels_for(P, "cpu", grp=pos // B), "block_causal",
      cache, num_write=P, logits_slice=None)
    return cache


def states_of(n, B, mask_id, vocab, g):
    out = []
    for _ in range(n):
        s = torch.randint(0, vocab - 2, (B,), generator=g)
        out.append(torch.where(torch.rand(B, generator=g) < 0.5, mask_id, s))
    return out


def denoise(m, cache, state, start, B):
    return m(state[None], torch.arange(start, start + B)[None], labels_for(B, "cpu"), "bidirectional", cache,
             unit=B)[0]


def check_copies(m, vocab, B, copies, cache_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask_id = vocab - 1 if vocab == V else 3
    for P in cache_lens:
        cache = prefilled(m, P, B, g, vocab)
        states = states_of(copies, B, mask_id, vocab, g)
        ids, pos, lab = layout_tensors(*exact_layout(states, P))
        verify = m(ids, pos, lab, "exact", cache, unit=B)[0].view(copies, B, -1)
        for c, s in enumerate(states):
            assert torch.equal(verify[c], denoise(m, cache, s, P, B)), (P, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_copy_equals_denoise_forward(dtype):
    """A 4-token denoise forward and its copy inside a 20-token verify forward: equal bits."""
    check_copies(model_of(dtype), V, B=4, copies=5, cache_lens=[4, 36, 132])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("B", [1, 2, 8])
def test_other_block_lengths(dtype, B):
    """Units of 1 and 2 tokens too (float32 products of 1-2 rows round differently from the
    same rows in a larger product on common CPU BLAS) and B = 8 with 9 copies (72 tokens)."""
    check_copies(model_of(dtype), V, B=B, copies=9 if B == 8 else 5, cache_lens=[8, 40])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bundled_target(dtype):
    check_copies(bundled_target(dtype), 6144, B=4, copies=5, cache_lens=[48, 200])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_folded_commit_and_shared_prefix(dtype):
    """The previous block's commit folded into the verify forward (shared prefix) or into the
    next denoise forward (block-causal pair), or run alone: the copies' logits and the
    committed K/V are the same bits in all three."""
    m = model_of(dtype)
    B, P = 4, 40
    g = torch.Generator().manual_seed(3)
    prev = torch.randint(0, V - 2, (B,), generator=g)
    states = states_of(4, B, V - 1, V, g)
    # commit alone, then a denoise forward per state
    alone = prefilled(m, P, B, torch.Generator().manual_seed(9), V)
    m(prev[None], torch.arange(P, P + B)[None], labels_for(B, "cpu"), "bidirectional", alone, num_write=B,
      logits_slice=None, unit=B)
    want = [denoise(m, alone, s, P + B, B) for s in states]
    # commit folded into the verify forward as the shared prefix
    shared = prefilled(m, P, B, torch.Generator().manual_seed(9), V)
    ids, pos, lab = layout_tensors(*exact_layout(states, P + B))
    ids = torch.cat([prev[None], ids], 1)
    pos = torch.cat([torch.arange(P, P + B)[None], pos], 1)
    lab = torch.cat([labels_for(B, "cpu", grp=SHARED_GRP), lab], 1)
    got = m(ids, pos, lab, "exact", shared, num_write=B, logits_slice=slice(B, None), unit=B)[0].view(4, B, -1)
    # commit folded into the next block's first denoise forward (block-causal pair)
    for c, s in enumerate(states):
        pair = prefilled(m, P, B, torch.Generator().manual_seed(9), V)
        grp = (torch.arange(2 * B) >= B).int()
        fold = m(torch.cat([prev, s])[None], torch.arange(P, P + 2 * B)[None], labels_for(2 * B, "cpu", grp=grp),
                 "block_causal", pair, num_write=B, logits_slice=slice(B, None), unit=B)[0]
        assert torch.equal(got[c], want[c]) and torch.equal(fold, want[c]), c
        for layer in range(len(alone.k)):
            assert torch.equal(pair.k[layer][0, :P + B], alone.k[layer][0, :P + B])
            assert torch.equal(shared.v[layer][0, :P + B], alone.v[layer][0, :P + B])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_interpreter(dtype):
    """The same equality through the Triton kernels (interpreted on the CPU; a GPU run may round
    differently, see docs/exactness.md "What is tested")."""
    pytest.importorskip("triton")
    from simsd_kernels.backends import resolve_backend
    try:
        resolve_backend("triton", torch.device("cpu"))
    except ValueError as exc:
        pytest.skip(str(exc))
    check_copies(model_of(dtype, backend="triton"), V, B=4, copies=5, cache_lens=[4, 70])


def test_batch_rows_do_not_change_a_rows_bits():
    """bfloat16: a row's logits in a batched denoise forward (rows with other states and cache
    lengths) equal its logits alone."""
    m = model_of("bfloat16")
    B, g = 4, torch.Generator().manual_seed(5)
    lens = [8, 60, 20]
    cache = m.new_cache(3, 96)
    singles = []
    for r, P in enumerate(lens):
        ids = torch.randint(0, V - 2, (1, P), generator=g)
        pos = torch.arange(P)[None]
        m(ids, pos, labels_for(P, "cpu", grp=pos // B), "block_causal", cache.rows(r, r + 1), num_write=P,
          logits_slice=None)
        one = m.new_cache(1, 96)
        m(ids, pos, labels_for(P, "cpu", grp=pos // B), "block_causal", one, num_write=P, logits_slice=None)
        singles.append(one)
    states = torch.stack(states_of(3, B, V - 1, V, g))
    pos = torch.tensor(lens)[:, None] + torch.arange(B)
    batch = m(states, pos, labels_for(B, "cpu").repeat(3, 1, 1), "bidirectional", cache, unit=B)
    for r in range(3):
        assert torch.equal(batch[r], denoise(m, singles[r], states[r], lens[r], B)), r


def test_per_unit_concatenates_in_order():
    """Rows of 7 tokens (2-D hidden states ``(B * L, hidden)``) in units of 3: 3, 3, 1 per row."""
    x = torch.arange(2 * 7 * 3).view(2 * 7, 3)
    seen = []
    out = per_unit(lambda t: (seen.append((tuple(t.shape), int(t[0, 0]) // 3)) or t * 2, t + 1), 3, x, 7)
    assert seen == [((3, 3), 0), ((3, 3), 3), ((1, 3), 6), ((3, 3), 7), ((3, 3), 10), ((1, 3), 13)]
    assert torch.equal(out[0], x * 2) and torch.equal(out[1], x + 1)
