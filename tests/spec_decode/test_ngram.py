"""N-gram prompt lookup: hand-made cases, agreement with a brute-force search as a sequence
grows, and a bounded cost per call on a 32k-token sequence."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from atom.spec_decode.ngram import NgramProposer, find_continuation
from atom.spec_decode.proposer import DraftRequest, Proposer


def _propose(tokens, k=3, min_n=1, max_n=4) -> list[int]:
    return find_continuation(np.array(tokens, dtype=np.int32), min_n, max_n, k)


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first, then the latest start whose n-gram ends before the last token."""
    for n in range(max_n, min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_copies_what_followed_the_match():
    assert _propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]
    assert _propose([1, 2, 3, 4, 5, 1, 2, 3], k=1) == [4]
    assert _propose([1, 2, 3, 4, 1, 2, 3], k=10) == [4, 1, 2, 3]  # capped at the sequence end
    assert _propose([7, 7, 7, 7], k=5) == [7]  # overlapping occurrence, ending before the end


def test_skip_drafts_past_an_unknown_token():
    """Asynchronous scheduling: the token after the match stands for one not known yet."""
    tokens = np.array([1, 2, 3, 4, 5, 1, 2, 3], dtype=np.int32)
    assert find_continuation(tokens, 1, 4, 3, skip=1) == [5, 1, 2]
    # An occurrence followed by nothing past the skipped token does not count: the one before.
    assert find_continuation(np.array([7, 7, 7, 7], dtype=np.int32), 1, 4, 5, skip=1) == [7]
    late = np.array([5, 3, 3], dtype=np.int32)
    assert find_continuation(late, 1, 4, 2) == [3]
    assert find_continuation(late, 1, 4, 2, skip=1) == []
    proposer = NgramProposer()
    ahead = DraftRequest(0, [1, 2, 3, 4, 5, 1, -1], 6, 3, in_flight=[2, 3])
    assert proposer.propose([ahead]).token_ids == [[5, 1, 2]]  # as if 2, 3 and then 4 came


def test_longest_match_wins_then_the_most_recent():
    # [5, 6, 7] occurred once (then 9); [6, 7] occurred more recently (then 8)
    assert _propose([5, 6, 7, 9, 1, 6, 7, 8, 5, 6, 7]) == [9, 1, 6]
    assert _propose([5, 6, 7, 9, 1, 6, 7, 8, 5, 6, 7], max_n=2) == [8, 5, 6]
    # two occurrences of [1, 2]: the later one is copied
    assert _propose([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], max_n=2) == [4, 0, 1]


def test_no_proposal_without_a_match():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([]) == [] and _propose([5]) == []
    assert _propose([1, 2, 3, 1], min_n=2) == []  # only a 1-gram matches
    assert _propose([1, 2, 3, 1, 2], k=0) == []


def test_matches_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    for min_n, max_n in [(1, 4), (2, 3), (3, 3)]:
        proposer = NgramProposer(min_n, max_n)
        tokens: list[int] = []
        for _ in range(400):
            tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
            k = rng.randrange(6)
            got = proposer.propose_one(DraftRequest(7, tokens, len(tokens), k))
            assert got == _reference(tokens, min_n, max_n, k), tokens


def test_placeholders_window_and_restart():
    proposer: Proposer = NgramProposer(window=6)
    tokens = [1, 2, 3, 9, 9, 9, 9, 1, 2]
    (far,) = proposer.propose([DraftRequest(0, tokens, len(tokens), 3)]).token_ids
    assert far == []  # [1, 2] occurred 7 tokens back, outside the window
    near = NgramProposer()
    assert near.propose_one(DraftRequest(1, tokens + [-1, -1], len(tokens), 3)) == [3, 9, 9]
    # a sequence that no longer extends what was seen is read again from its start
    assert near.propose_one(DraftRequest(1, [4, 5, 4], 3, 3)) == [5, 4]
    near.release(1)
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_a_call_on_a_32k_token_sequence_is_cheap():
    """Repetitive text (the last token occurs thousands of times) is the expensive case; a
    search over the whole history each call, in Python, would take milliseconds. CPU time of
    this process, so that other processes on the machine do not count."""
    rng = random.Random(1)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(3, 12))] for _ in range(200)]
    tokens: list[int] = []
    while len(tokens) < 32768:
        tokens.extend(rng.choice(phrases))
    proposer = NgramProposer()
    proposer.propose_one(DraftRequest(0, tokens, len(tokens), 4))  # the first call copies all
    calls, start = 200, time.process_time()
    for _ in range(calls):
        tokens.extend(rng.choice(phrases)[:2])
        proposer.propose_one(DraftRequest(0, tokens, len(tokens), 4))
    per_call = (time.process_time() - start) / calls
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} us per call"
