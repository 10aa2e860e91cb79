"""Paged KV-cache blocks: allocation as sequences grow, reference counts, prefix caching with LRU eviction."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from sluice.worker.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """SHA-256 of a full block's tokens after its parent's hash: equal hashes mean equal prefixes.

    Not Python's hash(): token-id tuples that collide in it are found in seconds, and a hit checks only the block's
    own tokens, so a crafted prompt could register a block whose K/V were computed after another prefix.
    """
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        # unreferenced blocks that still hold a cached prefix, least recently used first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}
        # full prompt blocks a running sequence is computing and has not yet committed: a waiting sequence whose next
        # block is one of them waits for it instead of computing the same prefix again beside it
        self.pending: dict[bytes, Sequence] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Take cached blocks for the longest cached prefix of a sequence without blocks; returns tokens hit.

        At least one token is always left to compute: the last one must produce logits.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs, parent = self.block_size, seq.hash_root
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        return len(seq.block_table) * self.block_size

    def claim(self, seq: Sequence) -> None:
        """Mark the full prompt blocks an admitted sequence is about to compute as pending, in its name."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for i in range(len(seq.block_hashes), seq.num_prompt_tokens // bs):
            parent = chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if parent not in self.pending:
                self.pending[parent] = seq
                seq.pending_hashes.append(parent)

    def waits_for_pending(self, seq: Sequence) -> bool:
        """Whether the next block after a sequence's cached prefix (match_prefix) is one another sequence is
        computing: admitted now, it would compute that block again."""
        i = len(seq.block_table)
        if not self.pending or i >= (seq.num_tokens - 1) // self.block_size:
            return False
        bs = self.block_size
        h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.hash_root,
                       tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        return self.pending.get(h, seq) is not seq

    def holds(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the sequence's own blocks already have room for its next num_new_tokens tokens."""
        return seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens the sequence could take: the room left in its blocks and in every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give the sequence blocks for its next num_new_tokens tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:  # most calls (a decode token inside its last block): nothing to check or take
            return
        assert need <= self.num_free_blocks, "allocate() without can_allocate()"
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def share(self, src: Sequence, dst: Sequence) -> None:
        """Give dst (a forked choice, holding no blocks) src's blocks by reference; each is freed by its last holder."""
        assert not dst.block_table
        for block_id in src.block_table:
            self._ref(block_id)
        dst.block_table = list(src.block_table)
        dst.block_hashes = list(src.block_hashes)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly filled blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.hash_root, tokens)
            seq.block_hashes.append(h)
            if self.pending.get(h) is seq:  # committed: waiting sequences now find it in the cache
                del self.pending[h]
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; the tail goes first so shared prefixes are evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_ids.append(block_id)
                else:
                    self.evictable[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        for h in seq.pending_hashes:  # preempted or finished before committing them: nobody waits on it any more
            if self.pending.get(h) is seq:
                del self.pending[h]
        seq.pending_hashes.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks, changed weights); refused (False) while a sequence holds blocks."""
        if self.num_used_blocks:
            return False
        for block_id in self.evictable:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
            self.free_ids.append(block_id)
        self.evictable.clear()
        self.hash_to_block.clear()
        return True

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id
