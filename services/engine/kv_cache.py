"""KV caches: the paged block pool the engine serves from, and a static slot cache.

:class:`PagedKVCache` (the engine's, target and draft alike): one pool of fixed-size blocks sized by
a memory budget (``--kv-cache-memory``), handed to sequences as they grow, so memory follows the
tokens held rather than slots x the longest context. :class:`KVCache`: one tensor per K and V,
``[layers, slots, max_len, kv_heads, head_dim]``, for direct model use (tests, micro-benchmarks).

Either way the engine keeps each sequence's valid length on the host. Rolling back after a
rejection is just using a shorter length: entries past it are never attended to and get
overwritten by the next round.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

# The default KV budget of one model's pool: 2 GiB hold 74k positions of Qwen2.5-1.5B in bf16 (two
# full 32k contexts) and 170k of the 0.5B draft, and leave a 24 GB machine usable with both loaded.
# vLLM's CPU backend defaults to 4 GiB (VLLM_CPU_KVCACHE_SPACE) for one model; specd runs two.
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
# Positions per block: large enough that block tables stay short at 32k (Python builds them), small
# enough that a sequence wastes at most a few hundred KB on its last block.
DEFAULT_KV_BLOCK_SIZE = 32


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


def kv_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in a cache of this geometry."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def pool_blocks(budget_bytes: int, bytes_per_token: int, block_size: int, num_slots: int, max_len: int) -> int:
    """Blocks a ``budget_bytes`` pool holds, but never more than ``num_slots`` sequences of ``max_len``
    positions can use (a small model's default budget would otherwise reserve millions of blocks)."""
    per_seq = -(-max_len // block_size)
    return max(1, min(budget_bytes // (bytes_per_token * block_size), num_slots * per_seq))


class BlockTable(SlotAllocator):
    """KV memory as a pool of fixed-size blocks (vLLM's paged KV), handed to sequences on demand.

    A sequence owns a slot (its row in the block table) and the blocks covering its positions; it
    grows with :meth:`reserve` and gives everything back with :meth:`release`. Accounting only:
    :class:`PagedKVCache` adds the storage. Block ``num_blocks`` is a scratch block that every
    table entry past a sequence's own blocks points at, so a padded row's writes land there.

    A slot can :meth:`fork` another's prefix (the draft service's prepared branches): full blocks
    are then shared, counted by holders, and go back to the pool with their last holder.

    **Prefix caching** (:meth:`enable_prefix_caching`, vLLM's automatic prefix caching): a full block
    whose K/V are final is :meth:`register`-ed under a digest of every token up to its end, and a new
    sequence starting with the same tokens :meth:`attach_prefix`-es it instead of computing it again.
    A registered block whose last holder lets go stays cached, idle, and counts as free: the pool
    hands idle blocks out again, least recently used first, only when no never-cached block is left.
    A digest names the whole prefix (sha256 chained block by block), so a hit is never a
    different text; blocks are shared only whole, below every position a holder writes.
    """

    def __init__(self, num_slots: int, num_blocks: int, block_size: int, max_len: int) -> None:
        super().__init__(num_slots)
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.scratch = num_blocks
        self._free_blocks = list(range(num_blocks))  # a min-heap: low ids first keeps sequences contiguous
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._holders: dict[int, int] = {}  # shared blocks only: how many slots hold them
        width = -(-max_len // block_size) + 1
        self.table = torch.full((num_slots, width), self.scratch, dtype=torch.long)  # host copy, rows per slot
        self.prefix_caching = False
        # Set where other processes follow this pool's tables (tensor-parallel ranks): they zero
        # every block new to a row (mirror_table), so a cached block would lose its K/V there.
        self.mirrored = False
        self._by_digest: dict[bytes, int] = {}  # registered blocks, by the digest of their prefix
        self._digest_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered blocks no slot holds, oldest first
        # Per slot, the digests of its sequence's blocks so far (its tokens only grow while it holds the slot).
        self._digests: list[list[bytes]] = [[] for _ in range(num_slots)]
        self._salts: list[bytes] = [b""] * num_slots  # per slot, its sequence's cache salt (attach_prefix)

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take: never used, or cached and idle."""
        return len(self._free_blocks) + len(self._idle)

    @property
    def supports_prefix_caching(self) -> bool:
        """Whether blocks can be shared between sequences (the storage is this pool's own)."""
        return self.can_fork and not self.mirrored

    def enable_prefix_caching(self) -> None:
        if not self.supports_prefix_caching:
            raise ValueError("this cache cannot share blocks between sequences")
        self.prefix_caching = True

    def _take_block(self) -> int:
        """A block to write afresh: a never-cached one, else the least recently used idle one (its
        cached prefix is forgotten). Callers check :attr:`free_blocks` first."""
        if self._free_blocks:
            return heapq.heappop(self._free_blocks)
        block, _ = self._idle.popitem(last=False)
        del self._by_digest[self._digest_of.pop(block)]
        return block

    def _hold_again(self, block: int) -> None:
        """One more slot holds a block some slot holds already (free_positions counts them down)."""
        self._holders[block] = self._holders.get(block, 1) + 1

    def _drop_block(self, block: int) -> None:
        """Its last holder let go."""
        if block in self._digest_of:
            self._idle[block] = None
        else:
            heapq.heappush(self._free_blocks, block)

    def _chain(self, slot: int, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The digests of ``slot``'s first ``blocks`` full blocks of ``tokens``, extending its chain."""
        return self._extend(self._digests[slot], self._salts[slot], tokens, blocks)

    def _extend(self, chain: list[bytes], salt: bytes, tokens: Sequence[int], blocks: int) -> list[bytes]:
        bs = self.block_size
        while len(chain) < blocks:
            i = len(chain)
            h = hashlib.sha256(chain[-1] if chain else b"specd-prefix" + salt)
            h.update(array("q", tokens[i * bs : (i + 1) * bs]).tobytes())
            chain.append(h.digest())
        return chain

    def prefix_chain(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[bytes]:
        """The digests a new sequence over ``tokens`` is looked up by: its full blocks up to
        ``limit``, under ``salt`` (empty without prefix caching). A request that waits to be
        admitted is hashed once, and its chain handed to :meth:`blocks_to_admit` at every try and to
        :meth:`attach_prefix` at admission, instead of hashing its whole prompt every step."""
        if not self.prefix_caching:
            return []
        return self._extend([], salt.encode(), tokens, min(limit, len(tokens)) // self.block_size)

    def blocks_to_admit(
        self, tokens: Sequence[int], limit: int, salt: str = "", chain: Sequence[bytes] | None = None
    ) -> int:
        """Free blocks a new sequence over ``tokens`` takes to hold them all: its blocks less the
        leading ones it would attach (:meth:`attach_prefix`, same ``limit`` and ``salt``) that other
        sequences hold already (an idle cached block counts as free, so attaching it takes one).
        ``chain``: :meth:`prefix_chain` of the same arguments, if the caller keeps it."""
        need = self.blocks_for(len(tokens))
        if not self.prefix_caching:
            return need
        if chain is None:
            chain = self.prefix_chain(tokens, limit, salt)
        return need - sum(block not in self._idle for block in self._cached_run(chain))

    def _cached_run(self, chain: Sequence[bytes]) -> list[int]:
        """The registered blocks of ``chain``'s leading digests, up to the first one not cached."""
        hit: list[int] = []
        for digest in chain:
            block = self._by_digest.get(digest)
            if block is None:
                break
            hit.append(block)
        return hit

    def attach_prefix(
        self, slot: int, tokens: Sequence[int], limit: int, salt: str = "", chain: Sequence[bytes] | None = None
    ) -> int:
        """Give the empty ``slot`` the cached blocks of the longest registered prefix of ``tokens``
        that ends at or before ``limit``; returns its length in positions (0 without prefix caching
        or without a hit). Those positions' K/V are then in place and must not be computed again.

        ``salt`` starts the slot's digest chain (vLLM's cache_salt): only blocks registered under
        the same salt are found, and the slot's own blocks register under it. Called once for each
        sequence the slot takes (and again, with the same salt, when it is prefilled again after a
        preemption). ``chain``: :meth:`prefix_chain` of the same arguments, if the caller has it
        (it becomes the slot's chain: not hashed again)."""
        if not self._digests[slot]:
            self._salts[slot] = salt.encode()
            if chain:
                self._digests[slot] = list(chain)
        if not self.prefix_caching or self.blocks[slot]:
            return 0
        hit = self._cached_run(self._chain(slot, tokens, min(limit, len(tokens)) // self.block_size))
        for block in hit:
            if block in self._idle:
                del self._idle[block]
            else:
                self._hold_again(block)
        if hit:
            self.blocks[slot] = hit
            self.table[slot, : len(hit)] = torch.tensor(hit, dtype=torch.long)
        return len(hit) * self.block_size

    def register(self, slot: int, tokens: Sequence[int], valid: int) -> None:
        """``slot``'s K/V are final below position ``valid`` (``tokens`` its sequence): its full
        blocks there become reusable by later sequences with the same prefix. A block whose prefix
        is cached already (two equal prompts prefilled side by side) stays unregistered."""
        if not self.prefix_caching:
            return
        own = self.blocks[slot]
        full = min(valid, len(tokens)) // self.block_size
        chain = self._chain(slot, tokens, min(full, len(own)))
        for block, digest in zip(own, chain):
            if block in self._digest_of or digest in self._by_digest:
                continue
            self._by_digest[digest] = block
            self._digest_of[block] = digest

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def reserve(self, slot: int, length: int) -> bool:
        """Make ``slot`` hold at least ``length`` positions; False (and nothing taken) if the pool
        has too few free blocks or the table too few columns."""
        have = self.blocks[slot]
        need = self.blocks_for(length) - len(have)
        if need <= 0:
            return True
        if need > self.free_blocks or len(have) + need > self.table.shape[1]:
            return False
        new = [self._take_block() for _ in range(need)]
        self._new_blocks(new)
        self.table[slot, len(have) : len(have) + need] = torch.tensor(new, dtype=torch.long)
        have.extend(new)
        return True

    def free_positions(self, slot: int) -> None:
        """Give back every block of ``slot`` but keep the slot (a preempted sequence waits in it)."""
        for b in self.blocks[slot]:
            held = self._holders.get(b, 1) - 1
            if held > 1:
                self._holders[b] = held
            elif held == 1:
                del self._holders[b]
            else:
                self._drop_block(b)
        self.blocks[slot] = []
        self.table[slot] = self.scratch

    @property
    def can_fork(self) -> bool:
        """Whether :meth:`fork` can copy storage (the accounting alone cannot)."""
        return False

    def fork(self, src: int, dst: int, length: int) -> bool:
        """Make the empty slot ``dst`` hold ``src``'s first ``length`` positions: the full blocks
        below ``length`` are shared, the partly used one is copied into a fresh block. False (and
        nothing taken) without a free block for the copy.

        Sharing is safe only while no holder writes below ``length``: callers fork at or below every
        position either slot will write while both exist (a prepared branch is forked where it
        departs from the line it shares, and the line only writes further on).
        """
        if self.blocks[dst]:
            raise ValueError(f"slot {dst} is not empty")
        full, partial = divmod(length, self.block_size)
        if partial and not self.free_blocks:
            return False
        shared = self.blocks[src][:full]
        for b in shared:
            self._hold_again(b)
        own = []
        if partial:
            own = [self._take_block()]
            self._copy_block(self.blocks[src][full], own[0])
        self.blocks[dst] = shared + own
        self.table[dst, : len(self.blocks[dst])] = torch.tensor(self.blocks[dst], dtype=torch.long)
        # The same sequence so far: its salt, and the digests of the shared blocks, so that what the
        # fork registers later lands in the same partition (a prepared branch that the draft adopts).
        self._salts[dst] = self._salts[src]
        self._digests[dst] = self._digests[src][:full]
        return True

    def _copy_block(self, src_block: int, dst_block: int) -> None:
        """Hook for storage: copy one block's contents."""
        raise NotImplementedError("this cache keeps no storage to copy")

    def release(self, slot: int) -> None:
        super().release(slot)
        self.free_positions(slot)
        self._digests[slot] = []  # a preempted sequence keeps its slot, tokens and digests
        self._salts[slot] = b""

    def mirror_table(self, slots: list[int], table: torch.Tensor) -> None:
        """On a tensor-parallel rank that follows rank 0's block tables instead of allocating its own:
        take rank 0's rows ``table`` [len(slots), W] for ``slots`` and zero every block new to its
        slot's row, as rank 0 did when it handed the block out. Without this a rank's storage stays
        uninitialised, and NaN garbage at masked positions turned its heads' attention, and through
        the all-reduce the logits, into NaN (greedy then picked token 0)."""
        for slot, row in zip(slots, table):
            new = row[~torch.isin(row, self.table[slot])]
            if new.numel():
                self._new_blocks(new.unique().tolist())
            self.table[slot] = row

    def _new_blocks(self, blocks: list[int]) -> None:
        """Hook for storage: blocks just handed out."""

    def layout(
        self,
        slots: list[int],
        starts: list[int],
        T: int,
        device: torch.device | str = "cpu",
        lengths: list[int] | None = None,
    ):
        """The :class:`~specd.services.engine.model.BatchLayout` of a batch over this cache (``lengths``:
        the tokens each row really holds, see BatchLayout)."""
        from specd.services.engine.model import BatchLayout

        return BatchLayout(slots, starts, T, device, lengths)


class PagedKVCache(BlockTable):
    """The block pool with its K/V storage: ``[layers, (num_blocks + 1) * block_size, kv_heads, head_dim]``.

    Allocated uninitialised, so on a CPU the operating system commits pages only as blocks are first
    used (resident memory grows with the tokens actually held, up to the budget); each block is
    zeroed when handed out, as masked-out garbage could be NaN and 0 * NaN poisons attention.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_slots, num_blocks, block_size, max_len)
        shape = (num_layers, (num_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._new_blocks([self.scratch])

    def _new_blocks(self, blocks: list[int]) -> None:
        bs = self.block_size
        for b in blocks:
            self.k[:, b * bs : (b + 1) * bs].zero_()
            self.v[:, b * bs : (b + 1) * bs].zero_()

    @property
    def can_fork(self) -> bool:
        return True

    def _copy_block(self, src_block: int, dst_block: int) -> None:
        bs = self.block_size
        s, d = slice(src_block * bs, (src_block + 1) * bs), slice(dst_block * bs, (dst_block + 1) * bs)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def layout(
        self,
        slots: list[int],
        starts: list[int],
        T: int,
        device: torch.device | str = "cpu",
        lengths: list[int] | None = None,
    ):
        from specd.services.engine.model import PagedLayout

        return PagedLayout(slots, starts, T, self.table[slots], self.block_size, device, lengths)
