"""Strategy choices on hand-made confidence vectors, and the token schedule."""
import pytest
import torch

from simsd.decoding.sampling import StepSampling, filtered_probs, sample
from simsd.decoding.strategies import select_positions, transfer_schedule


@pytest.mark.parametrize("B,steps,expected", [(4, 4, [1, 1, 1, 1]), (8, 4, [2, 2, 2, 2]), (8, 3, [3, 3, 2]),
                                              (4, 1, [4]), (8, 5, [2, 2, 2, 1, 1])])
def test_schedule(B, steps, expected):
    assert transfer_schedule(B, steps) == expected
    assert sum(expected) == B


def test_schedule_rejects_bad_steps():
    with pytest.raises(ValueError, match="steps"):
        transfer_schedule(4, 5)
    with pytest.raises(ValueError, match="steps"):
        transfer_schedule(4, 0)


M = torch.tensor([True, True, False, True, True])
CONF = torch.tensor([0.5, 0.95, 0.99, 0.91, 0.2])
ENT = torch.tensor([0.3, 0.1, 0.0, 0.2, 2.0])


def picks(strategy, k, thr=None, masked=M):
    return torch.nonzero(select_positions(strategy, masked, CONF, ENT, k, thr)).flatten().tolist()


def test_sequential():
    assert picks("sequential", 2) == [0, 1]
    assert picks("sequential", 9) == [0, 1, 3, 4]  # never more than the masked positions


def test_static_top_k_ignores_known_positions():
    assert picks("static", 1) == [1]          # position 2 (0.99) is not masked
    assert picks("static", 2) == [1, 3]
    assert picks("static", 10) == [0, 1, 3, 4]


def test_dynamic_strictly_greater():
    assert picks("dynamic", 1, 0.9) == [1, 3]  # both above 0.9, at least k=1 -> all of them
    assert picks("dynamic", 1, 0.91) == [1]    # 0.91 is not > 0.91
    assert picks("dynamic", 3, 0.9) == [0, 1, 3]  # fewer than k above -> top-k
    assert picks("dynamic", 1, 0.99) == [1]    # none above -> top-1


def test_entropy_bounded():
    # masked entropies sorted: 0.1 (1), 0.2 (3), 0.3 (0), 2.0 (4); cumsum 0.1, 0.3, 0.6, 2.6
    assert picks("entropy", 1, 0.35) == [1, 3]
    assert picks("entropy", 1, 0.61) == [0, 1, 3]
    assert picks("entropy", 1, 0.59) == [1, 3]
    assert picks("entropy", 1, 0.05) == [1]    # at least one
    assert picks("entropy", 1, 100.0) == [0, 1, 3, 4]


def test_nothing_masked():
    assert picks("static", 2, masked=torch.zeros(5, dtype=torch.bool)) == []


def test_ties_go_to_lower_index():
    conf = torch.tensor([0.5, 0.5, 0.5])
    sel = select_positions("static", torch.ones(3, dtype=torch.bool), conf, conf, 2)
    assert sel.tolist() == [True, True, False]


def test_confidence_is_unfiltered_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    tok, conf, ent, probs = sample(logits, StepSampling(temperature=0.0))
    assert tok.item() == 0
    torch.testing.assert_close(conf, torch.softmax(logits, -1)[:, 0])
    assert probs[0, 0] == 1.0  # greedy draws from a one-hot
    p = filtered_probs(logits, StepSampling(temperature=1.0, top_k=2))
    torch.testing.assert_close(p[0, 2:], torch.zeros(2))
    p = filtered_probs(logits, StepSampling(temperature=1.0, top_p=0.5))
    assert (p[0] > 0).tolist() == [True, False, False, False]


def reference_select(strategy, masked, confidence, entropy, k, threshold):
    """One block, written the plain way (loops and host reads): the semantics that the batched,
    sync-free :func:`select_positions` must reproduce."""
    n_masked = int(masked.sum())
    out = [False] * masked.shape[0]
    if n_masked == 0:
        return out
    k = max(1, min(int(k), n_masked))
    idx = [i for i in range(masked.shape[0]) if masked[i]]
    if strategy == "sequential":
        chosen = idx[:k]
    elif strategy == "entropy":
        by_ent = sorted(idx, key=lambda i: (float(entropy[i]), i))
        total, chosen = 0.0, []
        for i in by_ent:
            total += float(entropy[i])
            if total > threshold:
                break
            chosen.append(i)
        chosen = chosen or by_ent[:1]
    else:
        top = sorted(idx, key=lambda i: (-float(confidence[i]), i))[:k]
        above = [i for i in idx if float(confidence[i]) > threshold] if strategy == "dynamic" else []
        chosen = above if len(above) >= k else top
    for i in chosen:
        out[i] = True
    return out


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
def test_batched_selection_equals_reference(strategy):
    g = torch.Generator().manual_seed(0)
    N, L = 400, 8
    masked = torch.rand(N, L, generator=g) < 0.6
    # coarse values so that ties and exact threshold hits occur
    conf = (torch.randint(0, 10, (N, L), generator=g) / 10).float()
    ent = (torch.randint(0, 8, (N, L), generator=g) / 10).float()
    k = torch.randint(0, L + 2, (N,), generator=g)
    thr = 0.5 if strategy == "dynamic" else 0.45 if strategy == "entropy" else None
    got = select_positions(strategy, masked, conf, ent, k, thr)
    for i in range(N):
        want = reference_select(strategy, masked[i], conf[i], ent[i], int(k[i]), thr)
        assert got[i].tolist() == want, (i, masked[i], conf[i], ent[i], int(k[i]))
    for kk in (0, 1, 3):  # a host int k gives the same as a tensor of it
        same = select_positions(strategy, masked, conf, ent, torch.full((N,), kk), thr)
        assert torch.equal(select_positions(strategy, masked, conf, ent, kk, thr), same)
