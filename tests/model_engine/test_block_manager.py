"""Block accounting and prefix caching, without a model."""

from __future__ import annotations

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def test_allocate_and_free_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(seq, 12)  # still fits in 3 blocks
    assert bm.num_free_blocks == 5
    bm.allocate(seq, 13)
    assert bm.num_free_blocks == 4
    assert not bm.can_allocate(_seq([1]), 4 * 5)
    bm.free_blocks(seq)
    assert bm.num_free_blocks == bm.num_total_blocks == 8
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(12)))
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.commit(a)
    assert a.num_hashed_blocks == 3
    b = _seq(list(range(12)))  # identical prompt: only 2 of 3 blocks are reused
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = _seq([0, 1, 2, 3, 99, 5, 6, 7, 8])  # diverges in block 2
    bm.match_prefix(c)
    assert c.block_table == a.block_table[:1]
    for s in (a, b, c):
        bm.free_blocks(s)
    assert bm.num_free_blocks == 8
    d = _seq(list(range(12)))  # freed blocks keep their hash until reused
    bm.match_prefix(d)
    assert d.num_computed_tokens == 8
    bm.free_blocks(d)


def test_reused_block_forgets_its_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = _seq(list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free_blocks(a)
    other = _seq([7] * 8)
    bm.allocate(other, 8)  # takes both blocks, evicting a's cached prefix
    bm.free_blocks(other)
    again = _seq(list(range(8)))
    bm.match_prefix(again)
    assert again.num_computed_tokens == 0 and bm.hash_to_block == {}


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = _seq(list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free_blocks(a)
    b = _seq(list(range(8)))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0 and b.block_table == []
