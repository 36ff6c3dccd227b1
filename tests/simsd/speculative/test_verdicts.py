"""The verification verdicts on hand-made rounds, every output computed by hand (docs/design.md §4, §4.1).

One block of L = 4 positions, MASK = 9. The draft's three steps reveal position 0 (token 5), then
position 2 (token 6), then positions 1 and 3 (tokens 7 and 8):

    states[0] = [M, M, M, M]   states[1] = [5, M, M, M]   states[2] = [5, M, 6, M]   drafted = [5, 7, 6, 8]
    tau = [1, 3, 2, 3]

:func:`tree_verdict` on a draft's chain accepts draft step ``c`` iff the target's own step on
``states[c]`` is the same state (same positions, same tokens), accepts the longest such prefix and
commits the target's step at the first mismatch (else its bonus step, else the draft's last
state); on a tree with alternatives it follows the valid sibling.
:func:`accept_in_order` (paper mode) accepts per token in the draft's temporal order (reveal
step, then position) up to the first rejected token, which takes its replacement.
"""
import torch

from simsd.speculative.tree import ProposalTree
from simsd.speculative.verification import accept_in_order, tree_verdict
from simsd_kernels import TAU_INF

M = 9
S0, S1, S2 = [M, M, M, M], [5, M, M, M], [5, M, 6, M]
DRAFTED = [5, 7, 6, 8]
TAU = [1, 3, 2, 3]


def exact(mine, states, drafted, tau, bonus):
    """The verdict on a draft's chain (a proposal tree without branches, the drafted state its last
    node, with a copy while it has MASK)."""
    tree = ProposalTree.chain([torch.tensor(x) for x in states], torch.tensor(drafted), int(bonus), 0)
    assert len(mine) == len(tree.copy_nodes())
    new, taken, accepted, _, valid = tree_verdict(torch.tensor(mine), tree.states, tree.constants("cpu"))
    assert int((valid != torch.tensor(states[0])).sum()) == int(accepted)
    return new.tolist(), int(taken), int(accepted)


def test_exact_all_steps_accepted_without_bonus():
    # the target takes the draft's three steps; the block is full: the draft's last state is committed
    assert exact([S1, S2, DRAFTED], [S0, S1, S2], DRAFTED, TAU, False) == (DRAFTED, 3, 4)


def test_exact_mismatch_at_the_last_step():
    # steps 1 and 2 agree; at step 3 the target reveals position 1 only: its state is committed
    mine = [S1, S2, [5, 7, 6, M]]
    assert exact(mine, [S0, S1, S2], DRAFTED, TAU, False) == ([5, 7, 6, M], 3, 2)


def test_exact_same_tokens_at_other_positions_are_rejected():
    # step 2: the target reveals token 6 at position 3, the draft at position 2 (same tokens, other place)
    mine = [S1, [5, M, M, 6], [5, 7, 6, M]]
    assert exact(mine, [S0, S1, S2], DRAFTED, TAU, False) == ([5, M, M, 6], 2, 1)
    # step 1: token 5 at position 1 instead of 0
    mine = [[M, 5, M, M], S2, DRAFTED]
    assert exact(mine, [S0, S1, S2], DRAFTED, TAU, False) == ([M, 5, M, M], 1, 0)


def test_exact_same_positions_other_tokens_are_rejected():
    mine = [[4, M, M, M], S2, DRAFTED]
    assert exact(mine, [S0, S1, S2], DRAFTED, TAU, False) == ([4, M, M, M], 1, 0)


def test_exact_accepts_a_prefix_only():
    # step 1 rejected, step 2 would agree: nothing after the first mismatch counts
    mine = [[M, M, 6, M], S2, DRAFTED]
    assert exact(mine, [S0, S1, S2], DRAFTED, TAU, False) == ([M, M, 6, M], 1, 0)


def test_exact_bonus_step_after_full_acceptance():
    # two draft steps leave MASK at positions 1 and 3: the bonus copy's step (the target's own
    # step on the draft's last state) is committed as a third step
    tau = [1, TAU_INF, 2, TAU_INF]
    bonus = [5, 7, 6, M]
    assert exact([S1, S2, bonus], [S0, S1], S2, tau, True) == (bonus, 3, 2)
    # a mismatch before the bonus copy: the bonus is not used
    assert exact([S1, [5, 7, M, M], bonus], [S0, S1], S2, tau, True) == ([5, 7, M, M], 2, 1)


def paper(ok, replacement, tau=TAU, n=3, block=S0, drafted=DRAFTED):
    new, rejected, taken, accepted = accept_in_order(
        torch.tensor(block), torch.tensor(drafted), torch.tensor(tau), n, torch.tensor(ok), torch.tensor(replacement))
    return new.tolist(), bool(rejected), int(taken), int(accepted)


def test_paper_accepts_in_temporal_order():
    # order (tau, position): 0 (tau 1), 2 (tau 2), 1 (tau 3), 3 (tau 3); the token at position 1
    # is rejected: 0 and 2 accepted, 1 replaced by its replacement 4, 3 stays MASK
    got = paper([True, False, True, True], [0, 4, 0, 0])
    assert got == ([5, 4, 6, M], True, 3, 2)
    # the first proposal in temporal order rejected: only it is replaced, the round took 1 step
    got = paper([False, True, True, True], [3, 0, 0, 0])
    assert got == ([3, M, M, M], True, 1, 0)
    # position 2 (tau 2) rejected although position 1 and 3 (tau 3) are fine
    got = paper([True, True, False, True], [0, 0, 2, 0])
    assert got == ([5, M, 2, M], True, 2, 1)


def test_paper_all_accepted():
    assert paper([True] * 4, [0] * 4) == (DRAFTED, False, 3, 4)
    # positions known before the round keep their tokens; proposals of later steps than n are not judged
    tau = [TAU_INF, 1, 3, 2]
    got = paper([False, True, False, True], [1, 1, 1, 1], tau=tau, n=2, block=[3, M, M, M], drafted=[3, 7, 6, 8])
    assert got == ([3, 7, M, 8], False, 2, 2)


def test_tree_follows_the_valid_sibling():
    """A tree with alternatives: root S0; its children A = [5, M, M, M] (primary) and B = [M, M, 6, M]
    (alternative); A's children A2 = [5, M, 6, M] and A2b = [5, 7, M, M]. A node is valid only
    when every node on its path is its parent's target step; the deepest valid node's target step
    is committed."""
    A, B, A2, A2b = [5, M, M, M], [M, M, 6, M], [5, M, 6, M], [5, 7, M, M]
    tree = ProposalTree(torch.tensor([S0, A, B, A2, A2b]), [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [True] * 5, 4)
    shape = tree.constants("cpu")

    def verdict(t_root, t_a, t_b, t_a2, t_a2b):
        new, taken, accepted, node, valid = tree_verdict(torch.tensor([t_root, t_a, t_b, t_a2, t_a2b]),
                                                         tree.states, shape)
        return new.tolist(), int(taken), int(accepted), int(node), valid.tolist()

    # the target reveals position 2 first: the alternative B is valid, A and its subtree are not
    # (even though A's own target step would have been A2)
    assert verdict(B, A2, [5, M, 6, M], A2, A2b) == ([5, M, 6, M], 2, 1, 2, B)
    # A, then A's alternative child A2b
    assert verdict(A, A2b, B, [5, 7, 6, M], [5, 7, 6, 8]) == ([5, 7, 6, 8], 3, 2, 4, A2b)
    # A, then neither child: the target's step on A is committed
    assert verdict(A, [5, M, M, 1], B, A2, A2b) == ([5, M, M, 1], 2, 1, 1, A)
    # neither child of the root: the root's step
    assert verdict([M, 3, M, M], A2, B, A2, A2b) == ([M, 3, M, M], 1, 0, 0, S0)
