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
    index.follow(prompt, [7, 8, 9, 10])
    assert index.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    index.follow(prompt, [7, 8, 9, 10])  # nothing new
    assert len(index) == 10 and index.predict([2]) == 3
    with pytest.raises(ValueError, match="shorter than the 10 indexed"):
        index.follow(prompt, [7])
