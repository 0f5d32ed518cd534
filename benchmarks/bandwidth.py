"""The physical limit of decoding on this machine: weight bytes read per token over memory bandwidth.

At batch 1 a decoder reads every weight once per forward (all layers and the output head; of the
embedding only one row), so tokens/s can not exceed bandwidth / bytes-per-token. The bandwidth is
measured here, in the same run, by streaming a buffer much larger than the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.services.engine import kernels

EMBEDDING_NAMES = ("model.embed_tokens.weight", "token_embd.weight")


@dataclass(frozen=True)
class Bandwidth:
    """Best and median read bandwidth over the repetitions, in GB/s (1e9 bytes); each repetition counts
    the faster of two streaming reads (torch's ``sum`` and the kernels' prefetching read)."""

    best_gb_s: float
    median_gb_s: float
    buffer_bytes: int
    threads: int


def _stream_read() -> Callable[[torch.Tensor], int] | None:
    return torch.ops.specd_kernels.stream_read if kernels.ensure_built() else None


def read_buffer(buffer_gb: float) -> torch.Tensor:
    """A float32 buffer of ``buffer_gb`` GB for :func:`measure_read_bandwidth`, every page faulted in:
    one buffer serves many readings (on a VM that hands free memory back to its host, faulting 1 GB
    of huge pages in takes seconds)."""
    x = torch.empty(int(buffer_gb * 1e9 / 4), dtype=torch.float32)
    # In huge pages where the kernels can have them, as the decoder's weights are: the bound is the
    # most a plain read reaches, and in 4 KB pages it reached 22 GB/s here against 26-30 in 2 MB ones.
    kernels.advise_huge_pages(x)
    x.fill_(1.0)
    return x


def measure_read_bandwidth(buffer_gb: float = 2.0, reps: int = 12, buffer: torch.Tensor | None = None) -> Bandwidth:
    """Stream a float32 buffer of ``buffer_gb`` GB (or ``buffer``, from :func:`read_buffer`) on torch's
    threads (the same threads the engine decodes with), ``reps`` times, through ``sum`` and through the
    linear kernels' own prefetching read (``specd_kernels::stream_read``, where the kernels are
    built); a read-only reduction is bound by memory, not arithmetic. Each repetition counts the
    faster of the two, so the bound is the most a plain read reached, not what one particular loop
    does."""
    x = buffer if buffer is not None else read_buffer(buffer_gb)
    n = x.numel()
    readers: list[Callable[[torch.Tensor], object]] = [torch.sum]
    stream = _stream_read()
    if stream is not None:
        readers.append(stream)
    for read in readers:
        read(x)  # every page and reader warm before timing
    rates = []
    for _ in range(reps):
        best = 0.0
        for read in readers:
            t0 = time.perf_counter()
            read(x)
            best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        rates.append(best)
    rates.sort()
    return Bandwidth(round(rates[-1], 2), round(rates[len(rates) // 2], 2), n * 4, torch.get_num_threads())


def safetensors_bytes_per_token(folder: str | Path, bytes_per_param: int = 2) -> int:
    """Weight bytes one decode step reads from a Hugging Face folder served at ``bytes_per_param``
    (2 for bf16): every tensor, except the embedding, of which one row."""
    from specd.services.engine.checkpoint import SafetensorsState, safetensors_files

    files = safetensors_files(Path(folder))
    if files is None:
        raise ValueError(f"no safetensors files in {folder}")
    state = SafetensorsState(files)
    total = 0
    for name in state:
        shape = state.shape_of(name)
        numel = 1
        for d in shape:
            numel *= d
        total += shape[-1] * bytes_per_param if name in EMBEDDING_NAMES else numel * bytes_per_param
    return total


def model_bytes_per_token(model) -> int:
    """Weight bytes one decode step of a loaded :class:`~specd.services.engine.llama.LlamaLM` reads, in the
    layouts it runs (quantized weights with their scales): every linear layer and the output head,
    and one embedding row."""

    def linear_bytes(lin) -> int:
        lin = getattr(lin, "linear", lin)  # a row-parallel wrapper
        if hasattr(lin, "parts"):  # separate q/k/v (gate/up) weights of the fused forward
            return sum(linear_bytes(p) for p in lin.parts)
        tensors = [lin.weight, *lin.scales, *([lin.bias] if lin.bias is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)

    total = linear_bytes(model.lm_head) + model.embed.shape[1] * model.embed.element_size()
    for layer in model.layers:
        total += sum(linear_bytes(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return total


def gguf_bytes_per_token(path: str | Path) -> int:
    """Weight bytes one decode step reads from a GGUF file, in its own (quantized) encoding: every
    tensor except the embedding, of which one row."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(path)).tensors:
        if t.name in EMBEDDING_NAMES:
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # gguf shapes are innermost first
            total += int(t.n_bytes) // max(rows, 1)
        else:
            total += int(t.n_bytes)
    return total
