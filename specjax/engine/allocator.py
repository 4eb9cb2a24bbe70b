"""The host side of the paged KV cache: which blocks each sequence holds, its length, and the
prefix cache -- full blocks of committed tokens that later requests may share.

Block 0 is the null block (`specjax.core.kv.NULL_BLOCK`) and is never handed out. Rewind only
moves the length back and frees whole trailing blocks; it never zeroes memory, because
attention reads only below the logical length and the next write overwrites stale rows.

Prefix cache. A sequence may `publish` a full block once every position in it holds K/V of
committed tokens (never of drafts, which may yet be rejected -- the engine decides when). The
block is keyed by (its parent's entry, its tokens): a chain, compared exactly, so two prompts
share a block only if every token before and in it is equal. `lookahead` extra tokens after
the block join its key when a drafter's K/V at a position depend on the tokens after it
(EAGLE-3 pairs the hidden state at t with the token at t+1). Blocks are reference-counted; a
cached block nobody holds is free -- counted in `num_free_blocks` -- and stays findable until
the pool needs it, least recently freed first (a sequence's tail before its head, since a
chain is found from its head). Entry ids are never reused, so after an eviction no stale
child can hang under a new block that happens to reuse the parent's id.
"""
from __future__ import annotations

import collections
import itertools
from typing import Sequence

ROOT = 0   # the parent entry of every chain's first block


class OutOfBlocks(RuntimeError):
    """Raised when a request needs more KV blocks than are free; nothing was allocated."""


class BlockAllocator:
    """Blocks 1..num_blocks-1 are allocatable; block 0 is the reserved null block."""

    def __init__(self, num_blocks: int, tokens_per_block: int, lookahead: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.lookahead = lookahead
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free = list(range(num_blocks - 1, 0, -1))
        self._blocks: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        # Per sequence, a number that changes whenever its block list does (unique across
        # sequences), so a copy of the list made elsewhere knows when it is stale.
        self._version: dict[int, int] = {}
        self._changes = itertools.count(1)
        self._refs = [0] * num_blocks
        # The prefix cache: key (parent entry, tokens) -> (block, entry id); per block its key;
        # cached blocks nobody holds, least recently freed first; per sequence the entry ids
        # of its leading blocks that are in the cache (the parents of its next publications).
        self._cache: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._entries: dict[int, list[int]] = {}
        self._entry_ids = itertools.count(ROOT + 1)

    # -- queries ---------------------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: never used, or cached and held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks some sequence holds (a shared block counts once)."""
        return self.total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or free."""
        return len(self._key_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._blocks

    def blocks(self, seq_id: int) -> list[int]:
        return self._blocks[seq_id]

    def length(self, seq_id: int) -> int:
        return self._length[seq_id]

    def version(self, seq_id: int) -> int:
        """Changes whenever the sequence's block list does (`blocks`); never the same for
        two sequences or two lists."""
        return self._version[seq_id]

    def entries(self, seq_id: int) -> list[int]:
        """Cache entry ids of the sequence's leading blocks that are in the cache."""
        return self._entries[seq_id]

    def blocks_needed(self, seq_id: int | None, n: int) -> int:
        """Extra blocks that growing `seq_id` (or a new sequence) by `n` tokens takes."""
        length = self._length.get(seq_id, 0) if seq_id is not None else 0
        held = len(self._blocks.get(seq_id, ())) if seq_id is not None else 0
        return max(0, -(-(length + n) // self.tokens_per_block) - held)

    def can_add(self, seq_id: int | None, n: int) -> bool:
        return self.blocks_needed(seq_id, n) <= self.num_free_blocks

    # -- the prefix cache: lookups -----------------------------------------------------------

    def _key(self, parent: int, tokens: Sequence[int], index: int) -> tuple[int, tuple[int, ...]]:
        bs = self.tokens_per_block
        return parent, tuple(tokens[index * bs:(index + 1) * bs + self.lookahead])

    def shareable_blocks(self, num_tokens: int) -> int:
        """Leading full blocks a sequence of `num_tokens` tokens may take from the cache: each
        key's tokens must exist, and the last token is always computed again, so the step
        that processes it has logits and hidden states to start from."""
        return max(0, min(num_tokens - 1, num_tokens - self.lookahead) // self.tokens_per_block)

    def match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """The longest cached chain of full blocks starting `tokens` -> (blocks, their entry
        ids); changes nothing."""
        blocks, entries, parent = [], [], ROOT
        for index in range(self.shareable_blocks(len(tokens))):
            hit = self._cache.get(self._key(parent, tokens, index))
            if hit is None:
                break
            blocks.append(hit[0])
            entries.append(parent := hit[1])
        return blocks, entries

    def next_key(self, tokens: Sequence[int], entries: Sequence[int]):
        """The key of the block after the matched chain `entries` (None if there is none)."""
        index = len(entries)
        if index >= self.shareable_blocks(len(tokens)):
            return None
        return self._key(entries[-1] if entries else ROOT, tokens, index)

    def cached_chains(self) -> dict[int, tuple[list[int], int]]:
        """{cached block: (the tokens its key stands for -- its chain's from the first through
        its own and its lookahead tokens --, its index in the chain)}, for the blocks a lookup
        can still reach (for checks and debugging)."""
        by_entry = {entry: key for key, (_, entry) in self._cache.items()}
        bs, chains = self.tokens_per_block, {}
        for key, (block, _) in self._cache.items():
            parts, parent = [key[1]], key[0]
            while parent in by_entry:
                parent, tokens = by_entry[parent]
                parts.append(tokens)
            if parent == ROOT:   # a chain whose head was evicted cannot be found any more
                head = [t for part in reversed(parts[1:]) for t in part[:bs]]
                chains[block] = (head + list(parts[0]), len(parts) - 1)
        return chains

    def cost(self, blocks: Sequence[int]) -> int:
        """Free blocks that taking these cached blocks uses up (those nobody holds)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    # -- updates ---------------------------------------------------------------------------

    def allocate(self, seq_id: int, cached: tuple[list[int], list[int]] = ([], [])) -> None:
        """Register a sequence: empty, or starting with the cached blocks of a `match` (its
        length is then theirs)."""
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id} is already allocated")
        blocks, entries = cached
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        self._blocks[seq_id] = list(blocks)
        self._entries[seq_id] = list(entries)
        self._length[seq_id] = len(blocks) * self.tokens_per_block
        self._version[seq_id] = next(self._changes)

    def add_tokens(self, seq_id: int, n: int) -> None:
        """Grow the logical length by `n`, taking blocks as needed (all or nothing)."""
        length = self._length[seq_id] + n
        if 0 <= n and length <= len(self._blocks[seq_id]) * self.tokens_per_block:
            self._length[seq_id] = length   # within its blocks (most calls)
            return
        if n < 0:
            raise ValueError(f"add_tokens needs n >= 0, got {n}")
        need = self.blocks_needed(seq_id, n)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more KV blocks, "
                              f"{self.num_free_blocks} free")
        if need:
            blocks = self._blocks[seq_id]
            for _ in range(need):
                blocks.append(self._take())
            self._version[seq_id] = next(self._changes)
        self._length[seq_id] += n

    def publish(self, seq_id: int, tokens: Sequence[int], num_blocks: int) -> None:
        """Put the sequence's first `num_blocks` blocks in the cache (those not there yet).
        The caller vouches that they hold K/V of exactly `tokens` (committed ones) and that
        the key's lookahead tokens exist. A block whose key another sequence published first
        stays private; the chain goes on under the other's entry."""
        entries, blocks = self._entries[seq_id], self._blocks[seq_id]
        for index in range(len(entries), min(num_blocks, len(blocks))):
            key = self._key(entries[-1] if entries else ROOT, tokens, index)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = (blocks[index], next(self._entry_ids))
                self._key_of[blocks[index]] = key
            entries.append(hit[1])

    def rewind(self, seq_id: int, n: int) -> None:
        """Move the logical length back by `n`; free only blocks wholly past the new length."""
        length = self._length[seq_id]
        if not 0 <= n <= length:
            raise ValueError(f"cannot rewind sequence {seq_id} of length {length} by {n}")
        length -= n
        self._length[seq_id] = length
        keep = -(-length // self.tokens_per_block)
        blocks = self._blocks[seq_id]
        if len(blocks) > keep:
            while len(blocks) > keep:
                self._release(blocks.pop())
            self._version[seq_id] = next(self._changes)
        del self._entries[seq_id][keep:]

    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id`; unknown ids are ignored (idempotent cancel)."""
        blocks = self._blocks.pop(seq_id, None)
        self._length.pop(seq_id, None)
        self._entries.pop(seq_id, None)
        self._version.pop(seq_id, None)
        for block in reversed(blocks or ()):   # the tail is evicted before the head
            self._release(block)

    def clear_cache(self) -> None:
        """Forget every cached block (their contents are gone, e.g. after a device reset)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cache.clear()
        self._key_of.clear()
        for entries in self._entries.values():
            entries.clear()

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the least recently freed cached block leaves the cache
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self._key_of.pop(block)]
        self._refs[block] = 1
        return block
