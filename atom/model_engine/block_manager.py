"""Paged KV-cache blocks with prefix caching.

A full block is identified by a hash chain `hash(prev_block_hash, its tokens)`, so two requests
that share a prompt prefix share its blocks. Freed blocks keep their hash and stay findable until
they are reused (LRU order), which is why "all blocks free" and "prefix cache hit" can both hold.
"""

from __future__ import annotations

from collections import OrderedDict

from atom.model_engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take(next(iter(self.free))))

    def match_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the longest cached full-block prefix of a fresh sequence.

        At least one token is always left to compute, so the step produces logits."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        bs, prev = self.block_size, None
        max_blocks = (len(seq) - 1) // bs
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            if block_id in self.free:
                self._take(block_id, keep_hash=True)
            else:
                self.blocks[block_id].ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * bs

    def commit(self, seq: Sequence) -> None:
        """Register blocks that became full of computed, known tokens in the prefix cache (a
        placeholder's value is not known yet, so its block waits). The scheduler calls it only
        where one may be: `num_computed_tokens >= (num_hashed_blocks + 1) * block_size`."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        known = min(seq.num_computed_tokens, seq.num_known_tokens)
        while (seq.num_hashed_blocks + 1) * bs <= known:
            i = seq.num_hashed_blocks
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def free_blocks(self, seq: Sequence) -> None:
        """Release a sequence's blocks (last block first, so prefix heads are reused last)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def _take(self, block_id: int, keep_hash: bool = False) -> int:
        del self.free[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if not keep_hash and block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
