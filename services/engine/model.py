"""The model interface the engine drives, batch layouts over the caches, and model loading.

A ``CausalLM`` is anything with ``info``, ``kv_bytes_per_token``, ``new_paged_cache(num_slots,
num_blocks, block_size, max_len)`` (the engine's block pool), ``new_cache(num_slots, max_len)`` (a
static cache) and ``forward(input_ids [B, T], cache, layout, logits_for)``; a cache's ``layout()``
builds the :class:`BatchLayout` its forward needs. Two implementations:

- :class:`specd.services.engine.llama.LlamaLM`: own forward for Llama/Mistral/Qwen2 (fast path);
- :class:`HFCausalLM`: any other ``transformers`` causal LM, one ``DynamicCache`` per slot, cropped
  on rollback. Correct for every architecture, slower (rows run one at a time).

:func:`load_model` picks one through a registry keyed by ``config.model_type``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specd.services.engine.kv_cache import BlockTable, SlotAllocator, kv_bytes
from specd.services.engine.transfer import to_device


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about a loaded model."""

    name: str
    model_type: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    backend: str


class VocabMismatchError(ValueError):
    """The draft and the target do not share a vocabulary; speculation would be meaningless."""


class BatchLayout:
    """Where each row of a batch lives in the cache: slot, first position, and the attention mask.

    Built once per forward (host lists in, small tensors out) and shared by all layers. The tensors
    are made when first asked for: the fused CPU forward reads only the host lists.
    """

    def __init__(
        self,
        slots: list[int],
        starts: list[int],
        T: int,
        device: torch.device | str = "cpu",
        lengths: list[int] | None = None,
    ) -> None:
        self.slots, self.starts, self.T, self.device = slots, starts, T, device
        # Tokens each row really holds (1..T; None: all T). Past them a row is padding, which a
        # forward may skip (the fused CPU forward does: a round then costs the tokens it verifies)
        # or compute (its K/V lands past the row's tokens, where later writes replace it before
        # anything attends to it). Callers read no logits past a row's tokens, so set it for
        # logits_for "all" or "none" only: "last" means position T - 1 on the per-op paths.
        # Kept only where some row is short, so a forward reads None as "nothing to skip".
        self.lengths = lengths if lengths is not None and min(lengths) < T else None
        self.S = max(starts) + T  # keys attended: the cache prefix up to the furthest row
        self._contiguous = slots == list(range(slots[0], slots[0] + len(slots)))

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """[B, T]: each row's positions."""
        start_t = to_device(self.starts, self.device, torch.long)
        return start_t[:, None] + torch.arange(self.T, device=self.device)[None, :]

    @functools.cached_property
    def _slot_t(self) -> torch.Tensor:
        return to_device(self.slots, self.device, torch.long)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, T, S]: which cached keys each query sees (None: one query sees the whole prefix)."""
        if len(self.slots) == 1 and self.T == 1:
            return None
        keys = torch.arange(self.S, device=self.device)
        return keys[None, None, None, :] <= self.positions[:, None, :, None]

    def write(self, cache_layer: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [B, T, Hkv, D] into cache_layer [slots, L, Hkv, D] at each row's positions."""
        if len(self.slots) == 1:
            s0 = self.starts[0]
            cache_layer[self.slots[0], s0 : s0 + self.T] = x[0]
        else:
            cache_layer[self._slot_t[:, None].expand_as(self.positions), self.positions] = x

    def read(self, cache_layer: torch.Tensor) -> torch.Tensor:
        """The first S positions of each row's slot, [B, S, Hkv, D] (a view when slots are contiguous)."""
        if self._contiguous:
            return cache_layer[self.slots[0] : self.slots[0] + len(self.slots), : self.S]
        # Slice before gathering: the gather then copies S positions per row, not the whole slot.
        return cache_layer[:, : self.S].index_select(0, self._slot_t)


class PagedLayout(BatchLayout):
    """A batch over a :class:`~specd.services.engine.kv_cache.PagedKVCache`: positions map to pool rows
    through each sequence's block table.

    ``table`` [B, W] holds the rows' block ids (the scratch block past their own). One sequence
    whose blocks are consecutive in the pool (the usual case on a quiet server: blocks go out lowest
    first) is read as a view; otherwise each layer gathers the S attended positions of every row,
    the same copy :meth:`BatchLayout.read` makes for non-adjacent slots.
    """

    def __init__(
        self,
        slots: list[int],
        starts: list[int],
        T: int,
        table: torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        lengths: list[int] | None = None,
    ) -> None:
        super().__init__(slots, starts, T, device, lengths)
        self.table, self.block_size = table, block_size

    @functools.cached_property
    def _base(self) -> int | None:
        """The pool row of position 0 when one sequence's blocks are consecutive (read as a view)."""
        nb = -(-self.S // self.block_size)
        if len(self.slots) == 1:
            row = self.table[0, :nb]
            first = int(row[0])
            if nb == 1 or bool((row == torch.arange(first, first + nb)).all()):
                return first * self.block_size
        return None

    @functools.cached_property
    def _gather_idx(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write) pool rows of the S attended positions of every row and of the T new ones."""
        B, bs = len(self.slots), self.block_size
        nb = -(-self.S // bs)
        tab = to_device(self.table[:, :nb], self.device)
        idx = (tab[:, :, None] * bs + torch.arange(bs, device=self.device)).view(B, nb * bs)[:, : self.S]
        return idx.reshape(-1), idx.gather(1, self.positions).reshape(-1)

    def write(self, cache_layer: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [B, T, Hkv, D] into the pool layer [rows, Hkv, D] at each row's positions."""
        if self._base is not None:
            s0 = self._base + self.starts[0]
            cache_layer[s0 : s0 + self.T] = x[0]
        else:
            cache_layer.index_copy_(0, self._gather_idx[1], x.reshape(-1, *x.shape[2:]))

    def read(self, cache_layer: torch.Tensor) -> torch.Tensor:
        """The first S positions of each row, [B, S, Hkv, D]."""
        if self._base is not None:
            return cache_layer[self._base : self._base + self.S].unsqueeze(0)
        B = len(self.slots)
        return cache_layer.index_select(0, self._gather_idx[0]).view(B, self.S, *cache_layer.shape[1:])


class CausalLM(Protocol):
    """What the engine and drafters need from a model."""

    info: ModelInfo
    device: torch.device

    def new_cache(self, num_slots: int, max_len: int) -> SlotAllocator: ...

    def new_paged_cache(self, num_slots: int, num_blocks: int, block_size: int, max_len: int) -> BlockTable: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def skips_padding(self) -> bool:
        """Whether forward computes only each row's ``layout.lengths`` tokens (a round's cost follows
        the tokens it verifies), rather than every row's T."""
        ...

    def forward(
        self, input_ids: torch.Tensor, cache: SlotAllocator, layout: BatchLayout, logits_for: str = "all"
    ) -> torch.Tensor | None: ...


def eos_ids_of(hf_model) -> tuple[int, ...]:
    """EOS ids from the generation config and the model config (either may hold a list)."""
    ids: list[int] = []
    for src in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is None:
            continue
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(dict.fromkeys(int(i) for i in ids))


class _DynamicCacheSlots(BlockTable):
    """One ``DynamicCache`` per slot; the block table only accounts for the budget (each
    ``DynamicCache`` grows by itself)."""

    def __init__(self, num_slots: int, max_len: int, num_blocks: int | None = None, block_size: int = 16) -> None:
        from transformers import DynamicCache

        if num_blocks is None:  # the static interface: room for every slot at full length
            num_blocks = num_slots * -(-max_len // block_size)
        super().__init__(num_slots, num_blocks, block_size, max_len)
        self._factory = DynamicCache
        self.caches = [DynamicCache() for _ in range(num_slots)]

    def allocate(self) -> int:
        slot = super().allocate()
        self.caches[slot] = self._factory()
        return slot


class HFCausalLM:
    """Fallback for architectures without an own forward: ``transformers`` with a cache per slot."""

    def __init__(self, hf_model, dtype: torch.dtype, device: torch.device | str) -> None:
        self.model = hf_model.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        # transformers 5.x renamed past_key_values to cache; accept either.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        cfg = hf_model.config
        self.info = ModelInfo(
            name=getattr(cfg, "_name_or_path", "") or cfg.model_type,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            max_context=getattr(cfg, "max_position_embeddings", 2048),
            eos_token_ids=eos_ids_of(hf_model),
            backend="transformers",
        )

    def new_cache(self, num_slots: int, max_len: int) -> _DynamicCacheSlots:
        return _DynamicCacheSlots(num_slots, max_len)

    def new_paged_cache(self, num_slots: int, num_blocks: int, block_size: int, max_len: int) -> _DynamicCacheSlots:
        return _DynamicCacheSlots(num_slots, max_len, num_blocks, block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return kv_bytes(cfg.num_hidden_layers, kv_heads, head_dim, self.model.dtype)

    @property
    def skips_padding(self) -> bool:
        return False  # each row runs T tokens (see CausalLM.skips_padding)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: _DynamicCacheSlots, layout: BatchLayout, logits_for: str = "all"
    ) -> torch.Tensor | None:
        outs = []
        for b, (slot, start) in enumerate(zip(layout.slots, layout.starts)):
            dc = cache.caches[slot]
            if dc.get_seq_length() > start:
                dc.crop(start - dc.get_seq_length())  # rollback; a negative crop drops that many tokens
            out = self.model(
                input_ids=input_ids[b : b + 1],
                position_ids=layout.positions[b : b + 1],
                use_cache=True,
                **{self._cache_kwarg: dc},
            )
            outs.append(out.logits.float())
        if logits_for == "none":
            return None
        logits = torch.cat(outs)
        return logits[:, -1:] if logits_for == "last" else logits


def _load_hf(name_or_path: str):
    from transformers import AutoModelForCausalLM

    # Loaded in fp32 once; each backend casts to the dtype it runs in (bf16 -> fp32 is exact).
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).eval()


def _own_llama(
    name_or_path: str, dtype: torch.dtype, device: torch.device | str, quantize: str | None = None
) -> CausalLM:
    from specd.services.engine.llama import LlamaLM, load_llama, open_llama_checkpoint

    # Straight from the safetensors files, one tensor at a time in the checkpoint's dtype: no
    # float32 copy of the whole model on the host first. Other formats go through transformers.
    c = open_llama_checkpoint(name_or_path)
    if c is None:
        return load_llama(_load_hf(name_or_path), dtype, device, prepack=None, quantize=quantize)
    records = None
    if quantize == "int4" and torch.device(device).type == "cpu":
        from specd.services.model_store.gguf_blocks import gguf_source, read_q4k_linears

        source = gguf_source(name_or_path)  # a model converted from a GGUF file: serve its own Q4_K blocks
        records = read_q4k_linears(source) if source is not None else None
    store = None
    if quantize and torch.device(device).type == "cpu":
        from specd.services.engine.quantized_store import QuantizedStore

        store = QuantizedStore.for_folder(name_or_path, quantize, dtype)
    return LlamaLM(
        c.shape,
        c.state,
        c.inv_freq,
        c.attention_scaling,
        c.info,
        dtype,
        device,
        prepack=None,
        quantize=quantize,
        int4_records=records,
        quantized_store=store,
    )


# model_type -> builder(name_or_path, dtype, device). Everything else falls back to transformers.
BACKENDS: dict[str, Callable[..., CausalLM]] = {
    "llama": _own_llama,
    "mistral": _own_llama,
    "qwen2": _own_llama,
}


def default_draft_quantize(device: torch.device | str) -> str | None:
    """What ``--draft-quantize auto`` means: int8 on a CPU with the AVX2 kernels, where it halves the
    draft's bytes per step (real pair, single `specd generate` runs on an AVX2 CPU: 1.66-1.82x over
    target-only with an int8 draft, 1.19-1.44x with the bf16 one, the same acceptance); no
    quantization elsewhere."""
    if torch.device(device).type != "cpu":
        return None
    from specd.services.engine.kernels import int8_linear

    return "int8" if int8_linear() is not None else None


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    quantize: str | None = None,
) -> CausalLM:
    """Load an HF causal LM by local path or hub id. ``backend``: "auto", "own" or "transformers".
    ``quantize``: None, "int8" or "int4" (weight-only, the own forward on CPU, see
    :func:`specd.services.engine.llama.quantize_int4`), or "auto" (:func:`default_draft_quantize`, for
    drafts, which may be anything without changing what the target emits)."""
    from specd.services.model_store.gguf_import import resolve_model_path

    name_or_path = resolve_model_path(name_or_path)  # a .gguf file: its converted folder
    auto = quantize == "auto"
    quantize = default_draft_quantize(device) if auto else quantize
    if backend != "transformers":
        from specd.services.engine.llama import plain_config

        plain = plain_config(name_or_path)
        if plain is not None:
            model_type = plain.model_type
        else:
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(name_or_path).model_type
        builder = BACKENDS.get(model_type)
        if builder is not None:
            return builder(name_or_path, dtype, device, quantize) if quantize else builder(name_or_path, dtype, device)
        if backend == "own":
            raise ValueError(f"no own forward for model_type {model_type!r}")
    if quantize and not auto:  # "auto" quietly means no quantization where only transformers can run it
        raise ValueError(f"quantize={quantize!r} needs the own forward (llama, mistral, qwen2)")
    return HFCausalLM(_load_hf(name_or_path), dtype, device)


def check_same_vocab(target: ModelInfo, draft: ModelInfo) -> None:
    """Refuse a draft whose vocabulary differs from the target's."""
    if target.vocab_size != draft.vocab_size:
        raise VocabMismatchError(
            f"draft vocabulary ({draft.vocab_size} tokens, {draft.name}) differs from the target's "
            f"({target.vocab_size} tokens, {target.name}); a draft must share the target's tokenizer"
        )
