"""Prompt lookup (simsd/speculative/ngram.py): a row's history predicts a position's token from the
token that followed the latest earlier occurrence of the tokens before it, the longest match first;
a block's MASK positions are predicted left to right; the index follows the row's history."""
import pytest

from simsd.speculative.ngram import NgramIndex

M = 99


def test_the_longest_latest_match_predicts():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 1, 2, 4, 5, 2, 3])
    assert index.predict([1, 2]) == 4  # [1, 2] last followed by 4 (earlier by 3)
    assert index.predict([7, 2, 3]) == 1  # no [7, 2, 3]; [2, 3] followed by 1
    assert index.predict([5, 2]) == 3  # the 3-gram [?, 5, 2] is shorter: [5, 2] -> 3
    assert index.predict([3]) == 1  # [3] followed by 1; the last 3 has no follower yet
    assert index.predict([8]) is None and index.predict([]) is None
    assert len(index) == 9


def test_min_n_leaves_short_contexts_unpredicted():
    index = NgramIndex(max_n=2, min_n=2)
    index.extend([1, 2, 3, 1])
    assert index.predict([1]) is None and index.predict([5, 1]) is None and index.predict([1, 2]) == 3
    with pytest.raises(ValueError, match="min_n=0"):
        NgramIndex(min_n=0)
    with pytest.raises(ValueError, match="max_n=2"):
        NgramIndex(max_n=2, min_n=3)


def test_a_block_is_filled_left_to_right_from_its_known_tokens_and_predictions():
    index = NgramIndex(max_n=2)
    index.extend([5, 6, 7, 8, 6, 9])
    # position 0 follows the history's last token 9 (never followed: no prediction); position 1
    # follows nothing known (no context); position 2 is known (6), position 3 follows 6 -> 9 (latest)
    assert index.fill([M, M, 6, M], M) == [M, M, 6, 9]
    index.extend([5])
    # the history ends ..., 9, 5: [9, 5] was never followed, [5] was by 6; then [5, 6] -> 7 (a
    # prediction is context for the next); position 2 is known (7); [7, 7] never occurred, [7] -> 8
    assert index.fill([M, M, 7, M], M) == [6, 7, 7, 8]


def test_the_index_follows_a_rows_history():
    index = NgramIndex()
    prompt = [1, 2, 3, 4, 5, 6]
    index.follow(prompt, [], first=2)  # the first block holds the prompt's last two tokens
    assert index.tokens == [1, 2, 3, 4]
    index.follow(prompt, [7, 8], first=0)  # that block done: its tail and output
    assert index.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert index.predict([4]) == 5 and index.predict([5]) == 6  # the tail's n-grams indexed too
    index.follow(prompt, [7, 8, 9, 10])
    assert index.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    index.follow(prompt, [7, 8, 9, 10])  # nothing new
    assert len(index) == 10 and index.predict([2]) == 3
    with pytest.raises(ValueError, match="shorter than the 10 indexed"):
        index.follow(prompt, [7])


def test_the_next_blocks_first_steps_as_the_history_predicts_them():
    """SelfDraft.ahead_chain: the next block all MASK, then after each step (the schedule's count of
    its leftmost MASK positions given the history's tokens after the predicted finished block)
    while predicted and MASK is left."""
    from simsd import DecodeConfig
    from simsd.speculative.self_draft import SelfDraft
    draft = SelfDraft(DecodeConfig(block_length=4, strategy="static"), M, 4, width=9)
    draft.ngram.extend([1, 2, 3, 4, 1, 2, 3])
    # the block predicted finished as [4, 1, 2, 3]: then [1, 2, 3] -> 4, [2, 3, 4] -> 1, ...
    assert draft.ahead_chain([4, 1, 2, 3]) == [[M] * 4, [4, M, M, M], [4, 1, M, M], [4, 1, 2, M]]
    two = SelfDraft(DecodeConfig(block_length=4, steps=2, strategy="static"), M, 4, width=9)
    two.ngram = draft.ngram
    assert two.ahead_chain([4, 1, 2, 3]) == [[M] * 4, [4, 1, M, M]]  # the next step would fill it
    # a finished block the history never saw the end of: nothing predicted after it
    assert draft.ahead_chain([4, 1, 2, 9]) == [[M] * 4]
    assert draft.ahead_chain([4, 1, 2, M]) == [[M] * 4]  # its last token unknown


def test_a_round_without_logits_proposes_the_historys_steps():
    """A round with nothing to propose from (a request's first, a block no lookahead reached)
    puts the history's next steps to the target, one below the other (kind None: counted as the
    history's steps, WidthPolicy.observe_ahead), as many as the width holds."""
    import torch

    from simsd import DecodeConfig
    from simsd.speculative.self_draft import SelfDraft
    from simsd.speculative.width import AHEAD_PRIOR

    def draft_of(width):
        draft = SelfDraft(DecodeConfig(block_length=4, strategy="static"), M, 4, width=width)
        draft.ngram.extend([1, 2, 3, 4, 1, 2, 3])
        return draft
    block = [4, M, M, M]  # after the history: [2, 3, 4] -> 1, [3, 4, 1] -> 2, [4, 1, 2] -> 3
    draft = draft_of(9)
    tree = draft.propose(torch.tensor(block), 1, 3, None, host=block)
    assert tree.kind is None and tree.parent == [-1, 0, 1] and tree.copies == [True] * 3 and tree.proposed == 2
    assert tree.states.tolist() == [[4, M, M, M], [4, 1, M, M], [4, 1, 2, M]]  # the block is not filled
    draft.observe(tree, 1)  # the first step was the target's, the second not
    s, t = AHEAD_PRIOR
    assert draft.policy.hits[("ahead", 1)] == [s + 1, t + 1] and draft.policy.hits[("ahead", 2)] == [s, t + 1]
    assert draft_of(2).propose(torch.tensor(block), 1, 3, None, host=block).parent == [-1, 0]  # two copies
    tree = draft_of(9).propose(torch.tensor([9, M, M, M]), 1, 3, None, host=[9, M, M, M])
    assert tree.parent == [-1] and tree.kind == [0]  # nothing predicted: the block alone
