"""Static, preallocated KV cache with per-sequence slots.

One tensor per K and V for all layers, ``[layers, slots, max_len, kv_heads, head_dim]``, allocated
once (gpt-fast / vLLM style), so decoding never reallocates. A sequence owns one slot; the engine
keeps each slot's valid length on the host. Rolling back after a rejection is just using a shorter
length: entries past it are never attended to and get overwritten by the next round.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """No free slot: the caller must wait for a sequence to finish."""


class SlotAllocator:
    """Hands out sequence slots 0..num_slots-1, lowest first (keeps batches contiguous more often)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        """Take a free slot."""
        if not self._free:
            raise CacheFullError("KV cache has no free slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Give a slot back. Its contents are stale and will be overwritten on reuse."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)


class KVCache(SlotAllocator):
    """Slot allocator plus the K/V storage of one model."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_slots)
        shape = (num_layers, num_slots, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
