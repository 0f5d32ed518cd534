"""CPU kernels of our own, compiled on first use, for where PyTorch's are slow.

``fused_decoder``: the whole forward of a Llama-family model in one call (``decoder.cpp``), for
bf16 activations over bf16, int8 or int4 weights: no per-op dispatch, and batch invariant end to
end, attention included (:class:`specd.services.engine.llama.LlamaLM` uses it where it applies).

``bf16_linear``: bf16-weight linear layers on AVX2 CPUs, written for those without oneDNN's bf16
support (AMD Zen 1-3, Intel before AVX-512) and used on any with AVX2, where the fused decoder's
batch invariance needs it. Measured on a 2-core Zen 3 at batch 1 (``specd bench --pair``), torch's own
bf16 matmul there streams weights at about half the machine's read bandwidth and costs k+1 times as
much to verify k+1 tokens as to decode one, which leaves speculation nothing to win. The kernel
(``linear.h``, ops in ``linear_ops.cpp``) streams each weight row once per block of up to 7 rows, with a software
prefetch 4 KB ahead of its loads, and is batch
invariant, so verification is exact against one-token decoding. Where the CPU has AVX-512, its
blocks run the same arithmetic in 512-bit registers, bit for bit the AVX2 blocks' (``SPECD_AVX512=0``
keeps the AVX2 ones).

``f32_linear``: the same kernel over fp32 weights, for float32 models on the CPU (the exact mode of
the identity tests). torch's fp32 matmul is MKL's sgemm, which on AMD CPUs streams weights at a
fraction of the read bandwidth at decoding's few rows: measured on the 2-core Zen 3 VM, an
[M, 1536] x [1536, 8960] product took 3.4 ms at M = 1 and 11-14 ms at M = 2-8 (4-16 GB/s of weights;
the machine read 26 GB/s that hour), so verifying k+1 tokens cost 3-4 times one. Layers use it up to
``llama.F32_KERNEL_MAX_ROWS`` rows a call and MKL beyond, and fp32 attention stays torch's, so fp32
output is not batch invariant end to end as the bf16 fused forward is; the identity tests compare it
with ``transformers`` up to float rounding (exact near-ties only), as before.

``int8_linear``: the same kernel over weight-only int8 with one scale per output row, half the bytes
of bf16, for drafts (``--draft-quantize int8``: a draft may be anything, speculation stays exact)
and for targets the user chose to quantize (``--quantize int8``).

``int4_linear``: weight-only int4 in groups of 32 (fp16 scale and min), multiplied in integers
against activations quantized per row to int8 (``--quantize int4``, ``--draft-quantize int4``).
Where the CPU has AVX-512 VNNI, rows of whole 256-weight super-blocks run in 512-bit registers, bit
for bit the AVX2 blocks' (``SPECD_AVX512=0`` again keeps the AVX2 ones).

On CPUs with AVX512-BF16 and no AMX tile unit (AMD Zen 4 and later) bf16 layers round each input
row to bf16 and multiply with ``vdpbf16ps`` (``linear.h``, ``bf16_dot_rows``), half the arithmetic of
the fp32-input blocks, which bounds verifying several rows on a 2-core Zen 4; batch invariant among
themselves, so speculation stays token-identical to the target alone, while the activations lose
their low 16 bits at every layer's input (as a bf16 model's do in ``transformers`` and llama.cpp).
``SPECD_BF16_DOT=0`` keeps the fp32-input blocks.

``kernel_tuning``: what this process's kernels chose for the CPU (``linear.h``): how far ahead each
kernel family prefetches its weights and into which cache (``SPECD_PREFETCH``, ``SPECD_PREFETCH_QUANT``),
how many weight rows a one-input-row bf16 block takes at a time (``SPECD_BF16_ONE_ROW_WEIGHT_ROWS``),
whether bf16 layers use the dot products (``SPECD_BF16_DOT``), and whether threads take tiles of each
other's share of a layer (``SPECD_WORK_STEALING``); the switches are for A/B runs.

``advise_huge_pages``: transparent huge pages under what decoding streams (``huge_pages.h``). The
fused decoder puts every weight it reads there itself (on the 2-core Xeon VM the 1.5B target
decoded 1.22x faster for it, its weights' TLB misses gone); the bandwidth benchmark's buffer asks
through this, so that the bound it measures is read from the same pages.

Built with ``torch.utils.cpp_extension`` into ``$SPECD_CACHE/torch_extensions`` (about 30 s once,
then loaded in milliseconds). If the build fails, or the CPU lacks AVX2/FMA, the callers keep
torch's matmul: slower, never wrong.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "linear_ops.cpp", HERE / "decoder.cpp")
HEADERS = (HERE / "linear.h", HERE / "huge_pages.h")
# SPECD_BF16_KERNEL=0 keeps torch's matmul (for A/B runs and as an escape hatch).
ENV_SWITCH = "SPECD_BF16_KERNEL"
# SPECD_F32_KERNEL=0 keeps torch's fp32 matmul likewise.
F32_SWITCH = "SPECD_F32_KERNEL"
FUSED_SWITCH = "SPECD_FUSED"
# -ffp-contract=off: the compiler may not fuse a*b+c into one FMA on its own. It would do so in some
# template instantiations (rows per block) and not others, and the rows' results would then differ
# in the last bit with the batch size; every FMA the kernels use is written out.
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]


def _cpu_has(*features: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``features`` (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return set(features) <= set(flags.split())


def _cpu_has_avx2_fma() -> bool:
    return _cpu_has("avx2", "fma", "f16c")


def _cpu_has_avx512() -> bool:
    """The features of the 512-bit bf16 blocks (linear.h: use_avx512)."""
    return _cpu_has("avx512f", "avx512bw", "avx512dq", "avx512vl")


def _cpu_has_avx512_vnni() -> bool:
    """The features of the 512-bit int4 and int8 blocks and the packed int8 layout (linear.h: use_avx512_vnni)."""
    return _cpu_has_avx512() and _cpu_has("avx512_vnni")


def _build_dir() -> Path:
    from specd.services.model_store.fetch import cache_root

    sources = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join(COMPILE_FLAGS).encode() + torch.__version__.encode())
    digest = digest.hexdigest()[:12]
    return cache_root() / "torch_extensions" / f"specd_kernels-{digest}"


def bf16_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """The compiled ``specd_kernels::bf16_linear(x, weight, bias)`` op, or None where it does not apply."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not ensure_built():
        return None
    return torch.ops.specd_kernels.bf16_linear


def f32_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """The compiled ``specd_kernels::f32_linear(x, weight, bias)`` op, or None where it does not apply."""
    if os.environ.get(F32_SWITCH, "1") == "0" or not ensure_built():
        return None
    return torch.ops.specd_kernels.f32_linear


def int8_linear() -> Callable[..., torch.Tensor] | None:
    """The compiled ``specd_kernels::int8_linear(x, weight, scale, bias)`` op, or None where it does not apply."""
    return torch.ops.specd_kernels.int8_linear if ensure_built() else None


@functools.cache
def ensure_built() -> bool:
    if not _cpu_has_avx2_fma():
        return False
    build = _build_dir()
    library = build / "specd_kernels.so"
    try:
        if not library.is_file():
            from torch.utils import cpp_extension

            build.mkdir(parents=True, exist_ok=True)
            # pip installs ninja into the venv's bin, which is not on PATH unless the venv is active.
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
            print("specd: compiling the AVX2 linear kernels (once, about 30 s)", file=sys.stderr, flush=True)
            cpp_extension.load(
                name="specd_kernels",
                sources=[str(p) for p in SOURCES],
                extra_cflags=COMPILE_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
        else:
            torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # a missing compiler, say: fall back, loudly
        warnings.warn(f"specd: the AVX2 kernels are unavailable ({exc}); using torch's matmul", stacklevel=2)
        return False


def int4_linear() -> Callable[..., torch.Tensor] | None:
    """The compiled ``specd_kernels::int4_linear(x, packed, bias)`` op, or None where it does not apply."""
    return torch.ops.specd_kernels.int4_linear if ensure_built() else None


def fused_decoder_class():
    """``torch.classes.specd_kernels.FusedDecoder`` (see ``decoder.cpp``), or None where it does not apply
    (no AVX2 kernels, or ``SPECD_FUSED=0``, which keeps the per-op forward for A/B runs)."""
    if os.environ.get(FUSED_SWITCH, "1") == "0" or not ensure_built():
        return None
    return torch.classes.specd_kernels.FusedDecoder


def amx_usable() -> bool:
    """Whether the kernels run bf16 layers on AMX tiles here (linear.h: use_amx)."""
    return ensure_built() and bool(torch.ops.specd_kernels.amx_usable())


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for transparent huge pages under a CPU tensor (``huge_pages.h``): where decoding streams a
    buffer, 4 KB pages cost it a TLB miss every 4 KB. Advise before writing, so fresh pages fault in
    2 MB at a time; pages already there are folded into huge ones (a copy). False where nothing was advised
    (no kernels, not a CPU tensor, under 2 MB, or the kernel's THP off). ``SPECD_HUGE_PAGES=0``
    keeps 4 KB pages."""
    if t.device.type != "cpu" or not ensure_built():
        return False
    return bool(torch.ops.specd_kernels.advise_huge_pages(t))


def move_to_huge_pages(t: torch.Tensor, offset: int, length: int) -> int:
    """Move the 2 MB pages that bytes ``[offset, offset + length)`` of ``t``'s data touch into huge
    pages where a private file mapping holds them (a checkpoint's memory map): copied into fresh 2 MB
    pages that then take the old pages' place at the same addresses (``huge_pages.h``). The bytes
    moved; 0 where nothing could be (no kernels, not a file mapping, already moved, THP off,
    ``SPECD_HUGE_PAGES=0``). ``weight_pages.py`` runs it in the background."""
    if t.device.type != "cpu" or not ensure_built():
        return 0
    return int(torch.ops.specd_kernels.move_to_huge_pages(t, offset, length))


class Prefetch(NamedTuple):
    """A kernel family's software prefetch: how far ahead of its loads, and into which cache."""

    bytes_ahead: int
    into_l2: bool


class KernelTuning(NamedTuple):
    """What this process's kernels chose for the CPU (``linear.h``), each with an A/B switch."""

    float_prefetch: Prefetch  # bf16 and fp32 kernels (SPECD_PREFETCH)
    quant_prefetch: Prefetch  # int8 and int4 (SPECD_PREFETCH_QUANT)
    bf16_one_row_weight_rows: int  # weight rows per step of a one-input-row bf16 block (SPECD_BF16_ONE_ROW_WEIGHT_ROWS)
    bf16_dot: bool  # bf16 layers multiply with AVX512-BF16 dot products, inputs rounded to bf16 (SPECD_BF16_DOT)
    # With them, the fused decoder packs rows longer than this many weights in chunks (0: never; SPECD_DOT_CHUNK)
    dot_chunk: int
    work_stealing: bool  # threads done with their share of a layer take tiles of another's (SPECD_WORK_STEALING)


def kernel_tuning() -> KernelTuning | None:
    """The kernels' per-CPU choices in this process (fixed when they load); None without the kernels."""
    if not ensure_built():
        return None
    fb, fl2, qb, ql2, rows, dot, chunk, stealing = torch.ops.specd_kernels.kernel_tuning()
    return KernelTuning(Prefetch(fb, bool(fl2)), Prefetch(qb, bool(ql2)), rows, bool(dot), chunk, bool(stealing))
