"""The host side of the paged KV cache: which blocks each sequence holds, and its length.

Block 0 is the null block (`specjax.core.kv.NULL_BLOCK`) and is never handed out. Rewind only
moves the length back and frees whole trailing blocks; it never zeroes memory, because
attention reads only below the logical length and the next write overwrites stale rows.
"""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Raised when a request needs more KV blocks than are free; nothing was allocated."""


class BlockAllocator:
    """Blocks 1..num_blocks-1 are allocatable; block 0 is the reserved null block."""

    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free = list(range(num_blocks - 1, 0, -1))
        self._blocks: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._blocks

    def blocks(self, seq_id: int) -> list[int]:
        return self._blocks[seq_id]

    def length(self, seq_id: int) -> int:
        return self._length[seq_id]

    def blocks_needed(self, seq_id: int | None, n: int) -> int:
        """Extra blocks that growing `seq_id` (or a new sequence) by `n` tokens takes."""
        length = self._length.get(seq_id, 0) if seq_id is not None else 0
        held = len(self._blocks.get(seq_id, ())) if seq_id is not None else 0
        return max(0, -(-(length + n) // self.tokens_per_block) - held)

    def can_add(self, seq_id: int | None, n: int) -> bool:
        return self.blocks_needed(seq_id, n) <= len(self._free)

    # -- updates ---------------------------------------------------------------------------

    def allocate(self, seq_id: int) -> None:
        """Register an empty sequence (length 0, no blocks)."""
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id} is already allocated")
        self._blocks[seq_id] = []
        self._length[seq_id] = 0

    def add_tokens(self, seq_id: int, n: int) -> None:
        """Grow the logical length by `n`, taking blocks as needed (all or nothing)."""
        if n < 0:
            raise ValueError(f"add_tokens needs n >= 0, got {n}")
        need = self.blocks_needed(seq_id, n)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more KV blocks, "
                              f"{len(self._free)} free")
        blocks = self._blocks[seq_id]
        for _ in range(need):
            blocks.append(self._free.pop())
        self._length[seq_id] += n

    def rewind(self, seq_id: int, n: int) -> None:
        """Move the logical length back by `n`; free only blocks wholly past the new length."""
        length = self._length[seq_id]
        if not 0 <= n <= length:
            raise ValueError(f"cannot rewind sequence {seq_id} of length {length} by {n}")
        length -= n
        self._length[seq_id] = length
        keep = -(-length // self.tokens_per_block)
        blocks = self._blocks[seq_id]
        while len(blocks) > keep:
            self._free.append(blocks.pop())

    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id`; unknown ids are ignored (idempotent cancel)."""
        blocks = self._blocks.pop(seq_id, None)
        self._length.pop(seq_id, None)
        if blocks:
            self._free.extend(reversed(blocks))
