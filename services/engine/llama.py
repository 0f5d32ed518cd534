"""Own forward pass for the Llama family (Llama, Mistral, Qwen2), over the static :class:`KVCache`.

Why not ``transformers``' own forward: on small models it is mostly framework overhead (about 2x
slower per token here), and speculative decoding lives or dies by the draft/target cost ratio. This
forward fuses QKV and gate/up into single matmuls, keeps the cache static, computes logits only
where asked, and on CPU can pre-pack bf16 weights for oneDNN (verifying 4 tokens then costs ~1.2x
one token instead of 1.8x).

Weights come from any Hugging Face checkpoint (local dir or hub id): straight from its safetensors
files (:func:`open_llama_checkpoint`; a tensor-parallel rank takes only its slices), or through
``transformers`` for other formats. Either way RoPE variants (llama3 scaling etc.) use the exact
``inv_freq`` that ``transformers`` computes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specd.services.engine.kv_cache import KVCache, PagedKVCache, kv_bytes
from specd.services.engine.model import BatchLayout, ModelInfo, eos_ids_of
from specd.services.engine.weight_pages import start_move

if TYPE_CHECKING:
    from specd.services.engine.quantized_store import QuantizedStore

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters the forward needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int


@functools.cache
def onednn_bf16_prepack_supported() -> bool:
    """Whether oneDNN can pack bf16 linear weights on this CPU (it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT; an AVX2-only CPU such as AMD Zen 3 refuses at load time)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


QUANTIZE_MODES = ("int8", "int4")
# Rows up to which fp32 layers use our kernel, beyond which torch's (MKL's) matmul is faster. On the
# 2-core Zen 3 VM, one layer alone ([M, 1536] x [1536, 8960] and its transpose): ours 2-4x faster at
# 2-8 rows, level at 16-40 (noisy), 1.3-2x slower from 60. Whole fp32 rounds of the 1.5B target at 20
# rows: 1.6 s on ours against 2.3 s on MKL, so the line is drawn at 32.
F32_KERNEL_MAX_ROWS = 32
INT4_GROUP = 32  # weights per (scale, min) pair; the kernel's layout depends on it


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8_reference`, by the compiled kernel where it is available (the same bytes,
    tested; the Python one took seconds of a cold start for the 0.5B draft)."""
    from specd.services.engine import kernels

    if weight.device.type == "cpu" and kernels.ensure_built():
        return tuple(torch.ops.specd_kernels.quantize_int8(weight))
    return quantize_int8_reference(weight)


def quantize_int8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only int8, one fp32 scale per output row: ``weight ~= q * scale[:, None]``."""
    # Row by row in blocks, in place: a whole-matrix float copy per step cost seconds at load.
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for r0 in range(0, weight.shape[0], 4096):
        w = weight[r0 : r0 + 4096].float()
        s = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).div_(127).clamp_min_(1e-12)
        q[r0 : r0 + 4096] = w.div_(s[:, None]).round_().clamp_(-127, 127)
        scale[r0 : r0 + 4096] = s
    return q, scale


INT4_SUPER = 256  # weights per super-block: one fp16 (d, dmin) pair over 8 groups' uint8 (sc, m)


def int4_row_bytes(k: int) -> int:
    """Bytes of one int4 row record of ``k`` weights (see :func:`quantize_int4`)."""
    return k // 2 + 2 * (k // INT4_GROUP) + 4 * -(-k // INT4_SUPER)


def pack_int4(
    nibbles: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The int4 kernel's row records from their parts: ``nibbles`` uint8 [N, G, 32] (0..15), ``sc`` and
    ``m`` uint8 [N, G], ``d`` and ``dmin`` fp16 [N, S]. Groups go in pairs: byte ``j`` of the 32 of groups
    ``2p`` and ``2p + 1`` holds weight ``j`` of the first in its low nibble and of the second in its high
    one (Q4_K's order); an odd last group takes 16 bytes, byte ``j`` holding its weights ``j`` and ``j + 16``."""
    n, g, _ = nibbles.shape
    k = g * INT4_GROUP
    out = torch.empty(n, int4_row_bytes(k), dtype=torch.uint8)
    even = g - g % 2
    pairs = nibbles[:, :even].reshape(n, even // 2, 2, INT4_GROUP)
    out[:, : even * 16] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)
    if g % 2:
        out[:, even * 16 : k // 2] = nibbles[:, -1, :16] | (nibbles[:, -1, 16:] << 4)
    out[:, k // 2 : k // 2 + g] = sc
    out[:, k // 2 + g : k // 2 + 2 * g] = m
    out[:, k // 2 + 2 * g :] = torch.cat([d.half(), dmin.half()], dim=1).view(torch.uint8)
    return out


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor]:
    """:func:`quantize_int4_reference`, computed by the compiled kernel where it is available (the
    same bytes, tested; the Python one takes tens of seconds for a 1.5B model)."""
    from specd.services.engine import kernels

    if weight.shape[1] % INT4_GROUP:
        raise ValueError(f"int4 needs a multiple of {INT4_GROUP} input features, got {weight.shape[1]}")
    if weight.device.type == "cpu" and kernels.ensure_built():
        return (torch.ops.specd_kernels.quantize_int4(weight),)
    return quantize_int4_reference(weight)


def quantize_int4_reference(weight: torch.Tensor) -> tuple[torch.Tensor]:
    """Weight-only int4 in llama.cpp's Q4_K arrangement with 8-bit sub-scales, as the int4 kernel reads
    it (``kernels/linear.h``): each row in super-blocks of up to 256 weights (8 groups of 32), weight
    ``i`` of group ``g`` in super-block ``s`` being ``d[s] * sc[g] * q - dmin[s] * m[g]``, with ``q`` a
    nibble, ``sc`` and ``m`` uint8 and ``d``, ``dmin`` fp16. Returns one uint8 record per row,
    [N, :func:`int4_row_bytes` (K)]: nibbles (:func:`pack_int4`), sc, m, d, dmin.

    Each group's range is its min (at most 0, as in Q4_K) to its max; the super-block's largest scale
    and min set d and dmin, the group's are rounded to 8 bits against them, and the nibbles are chosen
    against the rounded values the kernel will use."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs a multiple of {INT4_GROUP} input features, got {k}")
    g, s = k // INT4_GROUP, -(-k // INT4_SUPER)
    per = INT4_SUPER // INT4_GROUP
    parts = []
    for r0 in range(0, n, 2048):
        w = weight[r0 : r0 + 2048].float().view(-1, g, INT4_GROUP)
        lo = w.amin(dim=2).clamp_max(0.0)
        scale = (w.amax(dim=2) - lo) / 15
        neg_min = 0.0 - lo  # +0.0 where lo is 0 (a -0.0 would reach the fp16 dmin)

        def super_max(v: torch.Tensor) -> torch.Tensor:  # [rows, G] -> [rows, S]
            padded = torch.zeros(v.shape[0], s * per)
            padded[:, :g] = v
            return padded.view(v.shape[0], s, per).amax(dim=2)

        d = (super_max(scale) / 255).half()
        dmin = (super_max(neg_min) / 255).half()
        d_g = d.float().repeat_interleave(per, dim=1)[:, :g]
        dmin_g = dmin.float().repeat_interleave(per, dim=1)[:, :g]
        sc = torch.where(d_g > 0, scale / d_g, torch.zeros_like(scale)).round_().clamp_(0, 255)
        m = torch.where(dmin_g > 0, neg_min / dmin_g, torch.zeros_like(neg_min)).round_().clamp_(0, 255)
        step, offset = (d_g * sc)[..., None], (dmin_g * m)[..., None]
        q = torch.where(step > 0, (w + offset) / step, torch.zeros_like(w)).round_().clamp_(0, 15)
        parts.append(pack_int4(q.to(torch.uint8), sc.to(torch.uint8), m.to(torch.uint8), d, dmin))
    return (torch.cat(parts),)


def dequantize_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 weights [N, k] an int4 layer stands for (for tests, quality checks and GGUF imports)."""
    n, g, s = packed.shape[0], k // INT4_GROUP, -(-k // INT4_SUPER)
    per = INT4_SUPER // INT4_GROUP
    even = g - g % 2
    pairs = packed[:, : even * 16].reshape(n, even // 2, 1, INT4_GROUP)
    nib = torch.cat([pairs & 15, pairs >> 4], dim=2).reshape(n, even, INT4_GROUP)
    if g % 2:
        last = packed[:, even * 16 : k // 2]
        nib = torch.cat([nib, torch.cat([last & 15, last >> 4], dim=1)[:, None]], dim=1)
    sc = packed[:, k // 2 : k // 2 + g].float()
    m = packed[:, k // 2 + g : k // 2 + 2 * g].float()
    dd = packed[:, k // 2 + 2 * g :].contiguous().view(torch.float16).float()
    d = dd[:, :s].repeat_interleave(per, dim=1)[:, :g]
    dmin = dd[:, s:].repeat_interleave(per, dim=1)[:, :g]
    return (nib.float() * (d * sc)[..., None] - (dmin * m)[..., None]).reshape(n, k)


class Linear:
    """y = x W^T (+ b): through oneDNN with a weight packed once at load time (``prepack``), through
    our AVX2 bf16 or fp32 kernel (``kernel``, :mod:`specd.services.engine.kernels`), through the int8 or int4
    kernel with the weight quantized at load (``quantize="int8"`` / ``"int4"``), or through ``F.linear``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        prepack: bool,
        kernel=None,
        quantize: str | None = None,
        store: QuantizedStore | None = None,
        name: str = "",
    ) -> None:
        """``store``: quantized weights saved by an earlier start, looked up (and added to) by ``name``."""
        self.bias = bias
        self.scales: tuple[torch.Tensor, ...] = ()  # int8: (scale,); int4: (scale, min)
        self.prepacked = prepack and quantize is None
        self.kernel = None if self.prepacked else kernel
        if quantize == "int4" and weight.shape[1] % INT4_GROUP:
            quantize = "int8"  # int4 groups need a multiple of 32 input features; only tiny models lack it
        if quantize is not None:
            from specd.services.engine import kernels

            self.kernel = kernels.int8_linear() if quantize == "int8" else kernels.int4_linear()
            if self.kernel is None:
                raise ValueError(f"{quantize} weights need the AVX2 kernels, which are unavailable on this machine")
            key = f"{name}:{quantize}"
            ready = store.get(key, 2 if quantize == "int8" else 1) if store is not None else None
            if ready is None:
                ready = quantize_int8(weight) if quantize == "int8" else quantize_int4(weight)
                if store is not None:
                    store.put(key, ready)
            weight, *scales = ready
            self.scales = tuple(scales)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.prepacked else weight
        # fp32 (only decoding's few rows beat MKL's sgemm; at many rows its blocked GEMM wins)
        self.kernel_max_rows = F32_KERNEL_MAX_ROWS if weight.dtype == torch.float32 else None

    @classmethod
    def from_int4_records(cls, records: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """An int4 layer from ready records (a GGUF file's Q4_K blocks,
        :mod:`specd.services.model_store.gguf_blocks`)."""
        from specd.services.engine import kernels

        lin = cls.__new__(cls)
        lin.bias, lin.scales, lin.prepacked, lin.weight, lin.kernel_max_rows = bias, (), False, records, None
        lin.kernel = kernels.int4_linear()
        if lin.kernel is None:
            raise ValueError("int4 weights need the AVX2 kernels, which are unavailable on this machine")
        return lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.scales:
            return self.kernel(x, self.weight, *self.scales, self.bias)
        few_rows = self.kernel_max_rows is None or x.numel() <= self.kernel_max_rows * x.shape[-1]
        if self.kernel is not None and few_rows:
            return self.kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class LinearParts:
    """Linear layers whose outputs are concatenated: a layer's q, k and v projections (or gate and up)
    kept as separate weights for the fused forward, each in its own format (a GGUF file's Q4_K q and
    k beside its Q6_K v, say). Called directly (the per-op path's tests) it concatenates outputs."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def out_features(self) -> int:
        return sum(p.weight.shape[0] for p in self.parts)


class RowParallelLinear:
    """A linear whose input features are split across tensor-parallel ranks: each rank's partial
    product is summed over the ranks by ``reduce``, and the bias is added once, after the sum."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.linear, self.bias, self.reduce = linear, bias, reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear | LinearParts
    o: Linear | RowParallelLinear
    mlp_norm: torch.Tensor
    gate_up: Linear | LinearParts
    down: Linear | RowParallelLinear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op; for fp32 it is bit-identical to transformers' LlamaRMSNorm.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Other dtypes: transformers' op order (normalise in fp32, cast, then scale).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_NO_LENGTHS = torch.empty(0, dtype=torch.long)  # the fused forward's "every row holds T tokens"


class LlamaLM:
    """A Llama-family causal LM with the ``CausalLM`` interface of :mod:`specd.services.engine.model`.

    Tensor parallel (:mod:`specd.services.engine.tensor_parallel`): ``shape`` and ``state`` are one rank's
    shard (its heads, its slice of the MLP) and ``reduce`` all-reduces the outputs of ``o_proj``
    and ``down_proj`` across ranks; everything else runs unchanged on every rank.
    """

    def __init__(
        self,
        shape: LlamaShape,
        state: dict[str, torch.Tensor],
        inv_freq: torch.Tensor,
        attention_scaling: float,
        info: ModelInfo,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prepack: bool | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        quantize: str | None = None,
        int4_records: Mapping[str, torch.Tensor] | None = None,
        quantized_store: QuantizedStore | None = None,
    ) -> None:
        """``int4_records``: under ``quantize="int4"``, ready int4 records by weight name (a GGUF file's
        Q4_K tensors, :func:`specd.services.model_store.gguf_blocks.read_q4k_linears`) used as they are.
        ``quantized_store``: weights quantized by an earlier start, read instead of quantizing again;
        what this start quantizes is saved to it."""
        self.shape = shape
        self.info = info
        self.dtype = dtype
        self.device = torch.device(device)
        kernel = None
        if prepack is not True and self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
            from specd.services.engine.kernels import bf16_linear, f32_linear

            kernel = bf16_linear() if dtype == torch.bfloat16 else f32_linear()  # None where it does not apply
        if prepack is None:
            # bf16 on a CPU: our AVX2 kernels and the fused forward wherever they build (batch invariant
            # end to end, so bf16 speculation is exact against the same model alone; oneDNN's packed
            # matmul and bf16 attention are not), else oneDNN's packing where the CPU has it.
            prepack = kernel is None and self.device.type == "cpu" and dtype == torch.bfloat16
            prepack = prepack and onednn_bf16_prepack_supported()
        if prepack:
            kernel = None
        self.prepacked = prepack
        if quantize is not None and (quantize not in QUANTIZE_MODES or self.device.type != "cpu"):
            raise ValueError(f"weight quantization {quantize!r} is not available on {self.device.type}")
        kernel_dtype = "bf16" if dtype == torch.bfloat16 else "f32"
        self.kernel_name = "onednn-prepacked" if prepack else (f"specd-avx2-{kernel_dtype}" if kernel else "torch")
        if quantize:
            self.kernel_name = f"specd-avx2-{quantize}"

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in state else None

        def cat_opt(names: list[str]) -> torch.Tensor | None:
            parts = [opt(n) for n in names]
            if all(p is None for p in parts):
                return None
            sizes = [state[n.replace(".bias", ".weight")].shape[0] for n in names]
            return torch.cat(
                [p if p is not None else torch.zeros(s, dtype=dtype, device=self.device) for p, s in zip(parts, sizes)]
            )

        records = int4_records or {}
        # The fused forward takes a layer's q/k/v (and gate/up) as separate parts: no concatenated copy
        # of the weights at load, which stay views of the checkpoint's memory map.
        fusable = self._fusable(kernel, quantize, reduce)

        def linear(names: list[str], bias: torch.Tensor | None) -> Linear | LinearParts:
            """One linear layer over the row-concatenated weights ``names`` (``bias``: theirs,
            concatenated). Under int4 from a GGUF file's own Q4_K blocks where they are Q4_K there,
            and int8 where the file keeps them at more bits (Q4_K_M's Q6_K tensors)."""
            if fusable and len(names) > 1:
                return LinearParts([linear([n], opt(n.removesuffix(".weight") + ".bias")) for n in names])
            mode = quantize
            if mode == "int4" and records:
                if all(n in records for n in names):
                    return Linear.from_int4_records(torch.cat([records[n] for n in names]), bias)
                mode = "int8"
            weight = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            return Linear(weight, bias, prepack, kernel, mode, quantized_store, "+".join(names))

        def row_linear(prefix: str) -> Linear | RowParallelLinear:
            if reduce is None:
                return linear([prefix + ".weight"], opt(prefix + ".bias"))
            return RowParallelLinear(linear([prefix + ".weight"], None), opt(prefix + ".bias"), reduce)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        # Under int4 the head stays int8 (as llama.cpp's Q4_K_M keeps it at 6 bits): it decides every
        # token, and is an eighth of the weights.
        head_quantize = "int8" if quantize == "int4" else quantize
        self.lm_head = Linear(
            head.to(device=self.device, dtype=dtype).contiguous(),
            None,
            prepack,
            kernel,
            head_quantize,
            quantized_store,
            "lm_head.weight",
        )
        self.layers: list[_Layer] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_b = None if fusable else cat_opt([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
            gu_b = None if fusable else cat_opt([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"])
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], qkv_b),
                    o=row_linear(a + "o_proj"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], gu_b),
                    down=row_linear(p + "mlp.down_proj"),
                )
            )
        if quantized_store is not None:
            quantized_store.save()
        self.fused = self._fused_decoder(inv_freq, attention_scaling) if fusable else None
        # What the fused decoder streams from the checkpoint's memory map, moved into huge pages in
        # the background (weight_pages.py: why not at load).
        self.huge_page_move = start_move(self.fused.in_place_weights()) if self.fused is not None else None
        if self.huge_page_move is not None:
            weakref.finalize(self, self.huge_page_move.cancel)  # a model dropped mid-move ends it
        self.forward_path = "fused" if self.fused is not None else "per-op"
        pos = torch.arange(shape.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(device=self.device, dtype=dtype)  # [P, D]
        self.sin = (emb.sin() * attention_scaling).to(device=self.device, dtype=dtype)

    def _fusable(self, kernel, quantize: str | None, reduce) -> bool:
        """Whether the whole forward can run in one C++ call (``kernels/decoder.cpp``): on a CPU, bf16,
        every linear layer on our AVX2 kernels (not oneDNN's prepacked path), no tensor parallelism."""
        s = self.shape
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or reduce is not None:
            return False
        if (kernel is None and quantize is None) or s.head_dim % 16 or s.hidden_size % 8:
            return False
        from specd.services.engine.kernels import fused_decoder_class

        return fused_decoder_class() is not None

    def _fused_decoder(self, inv_freq: torch.Tensor, attention_scaling: float):
        """The fused forward, over the same weight tensors as the per-op path (no extra memory)."""
        from specd.services.engine.kernels import fused_decoder_class

        s = self.shape
        empty = torch.empty(0)
        tensors: list[torch.Tensor] = [self.embed, self.norm, inv_freq.float()]
        parts_per_linear: list[int] = []

        def add(lin: Linear | LinearParts) -> None:
            parts = lin.parts if isinstance(lin, LinearParts) else [lin]
            parts_per_linear.append(len(parts))
            for part in parts:
                scale = part.scales[0] if part.scales and part.weight.dtype == torch.int8 else empty
                bias = empty if part.bias is None else part.bias.float().contiguous()
                tensors.extend([part.weight, scale, bias])

        add(self.lm_head)
        for ly in self.layers:
            tensors += [ly.attn_norm, ly.mlp_norm]
            for lin in (ly.qkv, ly.o, ly.gate_up, ly.down):
                add(lin)
        dims = [s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim]
        return fused_decoder_class()(tensors, parts_per_linear, dims, s.rms_eps, float(attention_scaling))

    def _fused_forward(
        self, input_ids: torch.Tensor, cache: KVCache | PagedKVCache, layout: BatchLayout, logits_for: str
    ) -> torch.Tensor | None:
        s = self.shape
        if isinstance(cache, PagedKVCache):
            table, block_size, k, v = layout.table, layout.block_size, cache.k, cache.v
        else:  # a static slot cache is a paged one with one block per slot
            block_size = cache.k.shape[2]
            table = torch.tensor(layout.slots, dtype=torch.long)[:, None]
            k = cache.k.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)
            v = cache.v.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)
        starts = torch.tensor(layout.starts, dtype=torch.long)
        mode = {"none": 0, "last": 1, "all": 2}[logits_for]
        lengths = _NO_LENGTHS if layout.lengths is None else torch.tensor(layout.lengths, dtype=torch.long)
        return self.fused.forward(input_ids, starts, table, block_size, k, v, mode, lengths)

    # ------------------------------------------------------------------------------ cache

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """Preallocate a cache for ``num_slots`` sequences of up to ``max_len`` positions."""
        s = self.shape
        return KVCache(s.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, self.dtype, self.device)

    def new_paged_cache(self, num_slots: int, num_blocks: int, block_size: int, max_len: int) -> PagedKVCache:
        """A pool of ``num_blocks`` blocks of ``block_size`` positions shared by up to ``num_slots``
        sequences of up to ``max_len`` positions (:class:`PagedKVCache`)."""
        s = self.shape
        return PagedKVCache(
            s.num_layers,
            num_slots,
            num_blocks,
            block_size,
            max_len,
            s.num_kv_heads,
            s.head_dim,
            self.dtype,
            self.device,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one position in this model's (or this rank's) cache."""
        s = self.shape
        return kv_bytes(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)

    @property
    def skips_padding(self) -> bool:
        """Whether forward computes only each row's ``layout.lengths`` tokens: the fused forward does;
        the per-op one runs the padding too (see CausalLM.skips_padding)."""
        return self.fused is not None

    # ---------------------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        layout: BatchLayout,
        logits_for: str = "all",
    ) -> torch.Tensor | None:
        """Run ``input_ids`` [B, T] at positions ``layout.starts[b] + t`` and write their K/V.

        ``logits_for``: "all" -> [B, T, V] float32, "last" -> [B, 1, V], "none" -> None (prefill).
        """
        if self.fused is not None:
            return self._fused_forward(input_ids, cache, layout, logits_for)
        s = self.shape
        B, T = input_ids.shape
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        cos = self.cos[layout.positions].unsqueeze(2)  # [B, T, 1, D]
        sin = self.sin[layout.positions].unsqueeze(2)
        x = F.embedding(input_ids, self.embed)  # [B, T, d]
        scale = D**-0.5
        # Grouped-query attention as plain attention: the G query heads that share a K/V head are
        # folded into the query-length axis ([B, Hkv, G*T, D], rows g-major), so K and V are never
        # expanded. Against enable_gqa=True, measured with torch 2.13 on one core (bf16, 12 heads
        # over 2): 66 vs 372 us per layer at 100 cached positions, 405 vs 3,313 at 1,000; fp32 gains
        # less (243 vs 534 at 1,000). Each query row still meets the same keys in the same order.
        G = H // Hkv
        mask = layout.mask if layout.mask is None or G == 1 else layout.mask.repeat(1, 1, G, 1)  # [B, 1, G*T, S]
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, s.rms_eps)
            qkv = layer.qkv(h)
            qk, v = qkv.split([(H + Hkv) * D, Hkv * D], dim=-1)
            qk = qk.view(B, T, H + Hkv, D)
            qk = qk * cos + _rotate_half(qk) * sin  # RoPE on queries and keys in one go
            q, k = qk.split([H, Hkv], dim=2)
            ck, cv = cache.k[li], cache.v[li]  # [slots, L, Hkv, D]
            layout.write(ck, k)
            layout.write(cv, v.view(B, T, Hkv, D))
            keys = layout.read(ck).transpose(1, 2)  # [B, Hkv, S, D]
            vals = layout.read(cv).transpose(1, 2)
            qg = q.transpose(1, 2).reshape(B, Hkv, G * T, D)
            attn = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)  # [B, Hkv, G*T, D]
            # reshape, not view: a CUDA kernel may hand back attn with other strides (a view failed there).
            x = x + layer.o(attn.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))
            h = _rms_norm(x, layer.mlp_norm, s.rms_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if logits_for == "none":
            return None
        if logits_for == "last":
            x = x[:, -1:]
        return self.lm_head(_rms_norm(x, self.norm, s.rms_eps)).float()


@dataclass(frozen=True)
class LlamaCheckpoint:
    """Everything :class:`LlamaLM` is built from: shape, weights (full, unsharded), RoPE, model info.

    ``state`` is a plain dict when read out of a loaded ``transformers`` model, or a lazy
    :class:`~specd.services.engine.checkpoint.SafetensorsState` that reads each tensor when asked.
    """

    shape: LlamaShape
    state: Mapping[str, torch.Tensor]
    inv_freq: torch.Tensor
    attention_scaling: float
    info: ModelInfo


def _shape_and_info(cfg, eos_token_ids: tuple[int, ...]) -> tuple[LlamaShape, ModelInfo]:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_pos = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < max_pos:
        # Within the window sliding-window attention is plain causal attention; cap the context there.
        max_pos = window
    shape = LlamaShape(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_eps=cfg.rms_norm_eps,
        max_positions=max_pos,
    )
    info = ModelInfo(
        name=getattr(cfg, "_name_or_path", "") or cfg.model_type,
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        max_context=max_pos,
        eos_token_ids=eos_token_ids,
        backend="specd-llama",
    )
    return shape, info


def read_llama(hf_model) -> LlamaCheckpoint:
    """Shape, weights, RoPE frequencies and model info of an already-loaded Llama-family model."""
    shape, info = _shape_and_info(hf_model.config, eos_ids_of(hf_model))
    rotary = hf_model.model.rotary_emb
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return LlamaCheckpoint(shape, state, rotary.inv_freq.detach(), float(rotary.attention_scaling), info)


def _default_rope(cfg) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention scaling) of plain RoPE, computed as ``transformers`` does, bit for bit;
    None for any scaled or partial variant (those go through ``transformers``' own class)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        return None
    if theta is None or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return None
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    return inv_freq, 1.0


def _rope(cfg) -> tuple[torch.Tensor, float]:
    """RoPE frequencies and scaling for ``cfg``: plain RoPE directly (importing a ``transformers``
    modeling module costs seconds at start-up), every other variant from ``transformers``' class."""
    plain = _default_rope(cfg)
    if plain is not None:
        return plain
    rotary = _rotary_embedding(cfg)
    return rotary.inv_freq, float(rotary.attention_scaling)


def _rotary_embedding(cfg) -> torch.nn.Module:
    """The model's own ``transformers`` rotary embedding, built from the config alone (no weights),
    so every RoPE variant gets exactly the ``inv_freq`` and scaling ``transformers`` computes."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # By name, importing only this model's module: resolving the class through the lazy
    # MODEL_FOR_CAUSAL_LM_MAPPING imported every architecture's module (4.7 s of a 6 s load here).
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]  # e.g. qwen2 -> Qwen2ForCausalLM
    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    return getattr(module, cls_name.removesuffix("ForCausalLM") + "RotaryEmbedding")(config=cfg)


def open_llama_checkpoint(name_or_path: str) -> LlamaCheckpoint | None:
    """A lazy checkpoint over the model's safetensors files (local dir or hub id), without loading
    any weight yet; None when there are no safetensors files to read (load through transformers)."""
    from specd.services.engine.checkpoint import SafetensorsState, local_checkpoint_dir, safetensors_files

    directory = local_checkpoint_dir(name_or_path)
    files = safetensors_files(directory) if directory is not None else None
    if files is None:
        return None
    cfg, generation = plain_config(directory), None
    if cfg is not None and _default_rope(cfg) is not None:
        generation = _json_or_none(directory / "generation_config.json")
        generation = SimpleNamespace(**generation) if generation is not None else None
    else:
        from transformers import AutoConfig, GenerationConfig

        cfg = AutoConfig.from_pretrained(directory)
        try:
            generation = GenerationConfig.from_pretrained(directory)
        except OSError:  # no generation_config.json
            generation = None
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"no own forward for model_type {cfg.model_type!r}")
    shape, info = _shape_and_info(cfg, eos_ids_of(SimpleNamespace(config=cfg, generation_config=generation)))
    info = dataclasses.replace(info, name=name_or_path)
    inv_freq, attention_scaling = _rope(cfg)
    return LlamaCheckpoint(shape, SafetensorsState(files), inv_freq, attention_scaling, info)


# What the own forward reads from config.json; a file that names all of them (and plain RoPE) is read
# without transformers, whose config classes cost a second of a cold start to import.
_PLAIN_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def _json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def plain_config(directory: str | Path) -> SimpleNamespace | None:
    """A Llama-family folder's config.json as attributes, when it holds every field the own forward
    reads (``num_key_value_heads`` and ``head_dim`` default as in transformers); else None, and the
    caller uses transformers' ``AutoConfig``."""
    raw = _json_or_none(Path(directory) / "config.json")
    if raw is None or raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    if any(k not in raw for k in _PLAIN_CONFIG_KEYS):
        return None
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        return None
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    raw["_name_or_path"] = str(directory)
    return SimpleNamespace(**raw)


def load_llama(
    hf_model, dtype: torch.dtype, device: torch.device | str, prepack: bool | None, quantize: str | None = None
) -> LlamaLM:
    """Build a :class:`LlamaLM` from an already-loaded ``transformers`` Llama-family model."""
    c = read_llama(hf_model)
    return LlamaLM(c.shape, c.state, c.inv_freq, c.attention_scaling, c.info, dtype, device, prepack, quantize=quantize)
