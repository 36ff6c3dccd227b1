"""Proposal trees (simsd/speculative/tree.py): the alternatives of a step, by hand, and the shape
constants the verdict reads."""
import torch

from simsd import DecodeConfig, SamplingParams
from simsd.config.speculative import ALTERNATIVES, LEFTMOST, NGRAM
from simsd.speculative.tree import ProposalTree, step_candidates, step_draws

M = 9  # MASK (vocabulary of 10)


def logits_for(rows):
    """``(4, 10)`` logits: per position a dict token -> logit, everything else -10."""
    x = torch.full((4, 10), -10.0)
    for i, row in enumerate(rows):
        for t, v in row.items():
            x[i, t] = v
    return x


def test_greedy_static_alternatives_by_hand():
    """Position 2 is the most confident (token 3, then token 5); position 0 comes next (token 1).
    One token per step: the primary reveals 3 at position 2, the first alternative 1 at position 0
    (the strategy's choice without position 2), the second 5 at position 2 (its runner-up token)."""
    state = torch.tensor([M, 4, M, M])
    logits = logits_for([{1: 5.0, 2: 4.0}, {4: 9.0}, {3: 9.0, 5: 8.0}, {6: 1.0, 7: 0.9}])
    cfg = DecodeConfig(block_length=4, strategy="static")
    out, kinds = step_candidates(logits.clone(), state, M, cfg, 1, None, range(3), masks=3)
    assert [s.tolist() for s in out] == [[M, 4, 3, M], [1, 4, M, M], [M, 4, 5, M]] and kinds == [0, 1, 2]
    assert [s.tolist() for s in step_candidates(logits.clone(), state, M, cfg, 1, None, range(2), masks=3)[0]] == \
        [[M, 4, 3, M], [1, 4, M, M]]
    # one MASK left: no other position; the token alternative only
    one = torch.tensor([7, 4, M, 8])
    assert [s.tolist() for s in step_candidates(logits.clone(), one, M, cfg, 3, None, range(3), masks=1)[0]] == \
        [[7, 4, 3, 8], [7, 4, 5, 8]]
    # sequential: the leftmost MASK is fixed, its runner-up token is the alternative
    seq = DecodeConfig(block_length=4, strategy="sequential")
    assert [s.tolist() for s in step_candidates(logits.clone(), state, M, seq, 1, None, range(3), masks=3)[0]] == \
        [[1, 4, M, M], [2, 4, M, M]]


def test_every_alternative_by_hand():
    """The five alternatives of ALTERNATIVES on the state above (position 2 token 3, then 5, then
    8; position 0 token 1, then 2; position 3 token 6): (1, 0) position 0's token 1, (0, 1) position
    2's runner-up 5, (1, 1) position 0's runner-up 2, (2, 0) position 3 (positions 2 and 0 left
    out), (0, 2) position 2's third token 8. With one MASK left only the token alternatives apply,
    and keep their kinds."""
    state = torch.tensor([M, 4, M, M])
    logits = logits_for([{1: 5.0, 2: 4.5}, {4: 9.0}, {3: 9.0, 5: 8.0, 8: 7.0}, {6: 1.0, 7: 0.9}])
    cfg = DecodeConfig(block_length=4, strategy="static")
    out, kinds = step_candidates(logits.clone(), state, M, cfg, 1, None, range(6), masks=3)
    assert [s.tolist() for s in out] == [[M, 4, 3, M], [1, 4, M, M], [M, 4, 5, M], [2, 4, M, M], [M, 4, M, 6],
                                         [M, 4, 8, M]]
    assert kinds == [0, 1, 2, 3, 4, 5]
    out, kinds = step_candidates(logits.clone(), torch.tensor([7, 4, M, 8]), M, cfg, 3, None, range(6), masks=1)
    assert [s.tolist() for s in out] == [[7, 4, 3, 8], [7, 4, 5, 8], [7, 4, 8, 8]] and kinds == [0, 2, 5]
    # two MASK: one position may be left out, not two
    _, kinds = step_candidates(logits.clone(), torch.tensor([M, 4, M, 8]), M, cfg, 2, None, range(6), masks=2)
    assert kinds == [0, 1, 2, 3, 5]
    # some kinds only, in the order asked (a best-first tree asks for the kinds it grows), from
    # draws shared by every state of the step: the same states as above
    draws = step_draws(logits.clone(), M, cfg, None)
    out, kinds = step_candidates(logits.clone(), state, M, cfg, 1, None, [4, 1], masks=3, draws=draws)
    assert [s.tolist() for s in out] == [[M, 4, M, 6], [1, 4, M, M]] and kinds == [4, 1]


def test_history_alternatives_by_hand():
    """The NGRAM kinds (6, 7, 8 of ALTERNATIVES): the positions the (1 + skip)-th logits kind
    reveals, each given the history's prediction there (``fill``; MASK: none, the logits' token
    kept). On the state above: (0, NGRAM) position 2 := 6; (1, NGRAM) position 0 := 7; (2,
    NGRAM) position 3, unpredicted: the logits' 6, the same state as (2, 0). Without a fill they do
    not apply."""
    state = torch.tensor([M, 4, M, M])
    logits = logits_for([{1: 5.0, 2: 4.5}, {4: 9.0}, {3: 9.0, 5: 8.0, 8: 7.0}, {6: 1.0, 7: 0.9}])
    cfg = DecodeConfig(block_length=4, strategy="static")
    fill = torch.tensor([7, 4, 6, M])
    assert [ALTERNATIVES[k - 1] for k in (6, 7, 8)] == [(0, NGRAM), (1, NGRAM), (2, NGRAM)]
    out, kinds = step_candidates(logits.clone(), state, M, cfg, 1, None, [6, 7, 8, 4], masks=3, fill=fill)
    assert [s.tolist() for s in out] == [[M, 4, 6, M], [7, 4, M, M], [M, 4, M, 6], [M, 4, M, 6]]
    assert kinds == [6, 7, 8, 4]
    assert step_candidates(logits.clone(), state, M, cfg, 1, None, range(9), masks=3)[1] == list(range(6))
    # a multi-token step: every revealed position takes the history's token where it has one
    two = DecodeConfig(block_length=4, steps=2, strategy="static")
    out, _ = step_candidates(logits.clone(), state, M, two, 0, None, [0, 6], masks=3, fill=fill)
    assert [s.tolist() for s in out] == [[1, 4, 3, M], [7, 4, 6, M]]
    # (LEFTMOST, NGRAM): the leftmost MASK positions, as many as the step reveals, with the
    # history's tokens: position 0 (7); two of them on [M, M, 4, M], predicted 2 and 5
    assert ALTERNATIVES[8] == (LEFTMOST, NGRAM)
    out, _ = step_candidates(logits.clone(), state, M, cfg, 1, None, [9], masks=3, fill=fill)
    assert [s.tolist() for s in out] == [[7, 4, M, M]]
    out, _ = step_candidates(logits.clone(), torch.tensor([M, M, 4, M]), M, two, 0, None, [0, 9], masks=3,
                             fill=torch.tensor([2, 5, 4, 8]))
    assert [s.tolist() for s in out][1] == [2, 5, 4, M] and out[0].tolist() != [2, 5, 4, M]
    seq = DecodeConfig(block_length=4, strategy="sequential")  # its own step is the leftmost one
    assert step_candidates(logits.clone(), state, M, seq, 1, None, [0, 9], masks=3, fill=fill)[1] == [0]


def test_sampled_token_alternative_is_the_race_runner_up():
    """Under sampling the token alternative is the second arrival of the step's exponential race
    (the draw with the same noise) at the most confident drawn position: position 0 draws token 1
    (its noise favours it; probability ~0.73, above position 2's drawn token 5 at 0.5), and its
    runner-up under that noise is token 2, not the noise's next-lowest token elsewhere."""
    state = torch.tensor([M, 4, M, M])
    logits = logits_for([{1: 5.0, 2: 4.0}, {4: 9.0}, {3: 1.0, 5: 1.0}, {6: 1.0, 7: 0.9}])
    noise = torch.ones(4, 10)
    noise[2, 5], noise[2, 3] = 0.1, 0.5  # token 5 first, 3 second at position 2
    noise[0, 1] = 0.01  # position 0 draws token 1 (probability ~0.73, the most confident drawn token)
    cfg = DecodeConfig(block_length=4, strategy="static", sampling=SamplingParams(temperature=1.0))
    out, _ = step_candidates(logits.clone(), state, M, cfg, 1, noise, range(3), masks=3)
    assert out[0].tolist() == [1, 4, M, M]  # the drawn token 1 at position 0 is the most confident
    assert out[2].tolist() == [2, 4, M, M]  # its runner-up under the same noise


def test_constants_of_a_tree():
    tree = ProposalTree(torch.zeros(5, 4, dtype=torch.long), [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2],
                        [True, True, False, True, True], 4)
    copy_index, parent, depth, copies, rank, path = tree.constants("cpu")
    assert copy_index.tolist() == [0, 1, 3, 4] and parent.tolist() == [0, 0, 1, 1]
    assert depth.tolist() == [0, 1, 1, 2, 2] and copies.tolist() == [1, 1, 0, 1, 1]
    assert rank.tolist() == [0, 1, 0, 2, 3]
    assert path.int().tolist() == [[0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 1, 0],
                                   [0, 1, 0, 0, 1]]


def test_a_grown_tree_keeps_each_nodes_kind():
    """The self-draft's tree labels each node with its kind in ALTERNATIVES (what the width policy
    counts), not its index among the candidates that applied: with one MASK left the position
    alternatives do not apply, and the token alternatives keep kinds 2 and 5."""
    from simsd.speculative.self_draft import SelfDraft
    logits = logits_for([{1: 5.0, 2: 4.5}, {4: 9.0}, {3: 9.0, 5: 8.0, 8: 7.0}, {6: 1.0, 7: 0.9}])
    draft = SelfDraft(DecodeConfig(block_length=4, strategy="static"), M, 2, alternatives=5)
    draft.logits = logits
    tree = draft.propose(torch.tensor([7, 4, M, 8]), 3, 1, None)
    assert tree.kind == [0, 0, 2, 5] and tree.parent == [-1, 0, 0, 0]
    assert [s.tolist() for s in tree.states[1:]] == [[7, 4, 3, 8], [7, 4, 5, 8], [7, 4, 8, 8]]


def test_a_history_token_equal_to_the_logits_one_is_one_node():
    """A (0, NGRAM) candidate whose history token is the primary's (position 2 token 3 both) is
    the same state: the grown tree is read back once (``reads``) and the later sibling dropped, so
    the forward carries no copy twice; with a history that predicts another token it stays."""
    from simsd.speculative.self_draft import SelfDraft
    logits = logits_for([{1: 5.0, 2: 4.5}, {4: 9.0}, {3: 9.0, 5: 8.0, 8: 7.0}, {6: 1.0, 7: 0.9}])
    block = [M, 4, M, M]
    for history, kept in (([4, 3], [0, 0, 1, 2, 3, 4, 5]), ([4, 7], [0, 0, 1, 2, 3, 4, 5, 6])):  # the root first
        draft = SelfDraft(DecodeConfig(block_length=4, strategy="static"), M, 1, alternatives=6)
        draft.ngram.extend(history)  # after 4: 3 (the logits' token at position 2), or 7
        draft.logits = logits.clone()
        tree = draft.propose(torch.tensor(block), 1, 3, None, host=block)
        assert tree.kind == kept and draft.reads == 1
        states = [tuple(s) for s in tree.states.tolist()]
        assert len(set(states)) == len(states)
    draft = SelfDraft(DecodeConfig(block_length=4, strategy="static"), M, 1, alternatives=6)
    draft.logits = logits.clone()
    tree = draft.propose(torch.tensor(block), 1, 3, None, host=block)  # no history: nothing to read
    assert tree.kind == [0, 0, 1, 2, 3, 4, 5] and draft.reads == 0
