"""Load a target, an optional draft and the tokenizer, and assemble an :class:`Engine`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specd.services.common.constants import DEFAULT_DTYPE, DEMO_DRAFT, DEMO_TARGET, DTYPE_NAMES
from specd.services.engine.engine import Engine, EngineConfig
from specd.services.engine.model import CausalLM, VocabMismatchError, check_same_vocab, load_model

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class ModelSpec:
    """Which models to load and how to run them."""

    target: str = str(DEMO_TARGET)
    draft: str | None = str(DEMO_DRAFT)
    target_dtype: str = DEFAULT_DTYPE
    # Packed bf16 for the draft too. Timed alone, its fp32 (MKL) step is faster (0.55 vs 0.70 ms),
    # but inside the loop, right after a oneDNN target pass, it costs 1.1-1.35 ms against 0.77-0.86.
    draft_dtype: str = DEFAULT_DTYPE
    device: str = "cpu"
    backend: str = "auto"  # "auto" | "own" | "transformers"
    tensor_parallel_size: int = 1  # target only (services/engine/tensor_parallel.py); the draft is never sharded
    # "int8": the draft's weights quantized at load (half the bytes per draft step). Exactness depends
    # only on the target, so any draft keeps the output unchanged; only acceptance can move.
    draft_quantize: str | None = None
    # "int8" | "int4": the target's own weights quantized at load, the user's choice of model: the
    # output is then exactly that quantized target's (speculation changes nothing), not the bf16 one's.
    target_quantize: str | None = None


def load_tokenizer(path: str, for_chat: bool = False):
    """The model's tokenizer (:mod:`specd.services.engine.tokenizer`: without importing transformers
    where it can; ``for_chat`` loads what renders chat templates up front)."""
    from specd.services.engine.tokenizer import load_tokenizer as load
    from specd.services.model_store.gguf_import import resolve_model_path

    return load(resolve_model_path(path), for_chat)


def _same_tokenizer_file(target: str, draft: str) -> bool:
    """Both local folders hold byte-identical tokenizer.json files (then the vocabularies agree)."""
    from pathlib import Path

    from specd.services.model_store.gguf_import import resolve_model_path

    a, b = Path(resolve_model_path(target)) / "tokenizer.json", Path(resolve_model_path(draft)) / "tokenizer.json"
    try:
        return a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Same vocabulary size is not enough: the same id must mean the same token."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise VocabMismatchError(
            f"draft tokenizer ({draft_name}) maps tokens to different ids than the target's ({target_name})"
        )


def load_target(spec: ModelSpec) -> CausalLM:
    """The target model: in this process, or sharded over ``spec.tensor_parallel_size`` processes
    (this one is rank 0 and drives the others)."""
    from specd.services.model_store.gguf_import import resolve_model_path

    if spec.tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {spec.tensor_parallel_size}")
    spec = dataclasses.replace(spec, target=resolve_model_path(spec.target))
    if spec.tensor_parallel_size > 1:
        from specd.services.engine.tensor_parallel import start_tensor_parallel

        if spec.target_quantize:
            raise ValueError("a quantized target cannot be sharded yet (--quantize with --tensor-parallel-size)")

        return start_tensor_parallel(
            spec.target, spec.target_dtype, spec.tensor_parallel_size, spec.device, spec.backend
        )
    return load_model(spec.target, DTYPES[spec.target_dtype], spec.device, spec.backend, quantize=spec.target_quantize)


def build_engine(spec: ModelSpec, config: EngineConfig = EngineConfig()) -> Engine:
    """Load everything named in ``spec`` and return a ready engine."""
    tokenizer = load_tokenizer(spec.target)
    target = load_target(spec)
    draft = None
    if spec.draft:
        draft = load_model(
            spec.draft, DTYPES[spec.draft_dtype], spec.device, spec.backend, quantize=spec.draft_quantize
        )
        check_same_vocab(target.info, draft.info)
        if not _same_tokenizer_file(spec.target, spec.draft):  # loading a second 150k-entry tokenizer: ~2 s
            check_same_tokenizer(tokenizer, load_tokenizer(spec.draft), spec.target, spec.draft)
    return Engine(target, tokenizer, draft, config)
