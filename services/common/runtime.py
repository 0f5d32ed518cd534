"""Process-level settings: the CPU's, applied once at the CLI edge before torch is imported, and the
garbage collector's, once a service has loaded."""

from __future__ import annotations

import os

# On a small CPU machine the draft and target processes share the cores. libgomp's default
# spin-wait (OMP_WAIT_POLICY unset: ~300k spins) keeps an idle process's threads burning the cores
# the busy one needs; a gRPC round cost +6.5-9 ms instead of +1.3-2.4 ms with a short spin
# (cpu-calibration.md). OMP_WAIT_POLICY=PASSIVE was worse (threads sleep and wake slowly).
DEFAULT_SPINCOUNT = "10000"


def configure_openmp() -> None:
    """Set a short OpenMP spin unless the user set one. Must run before torch is imported: libgomp
    reads its environment once, when it is loaded."""
    os.environ.setdefault("GOMP_SPINCOUNT", DEFAULT_SPINCOUNT)


def configure_torch_threads(num_threads: int | None) -> None:
    """Pin intra-op threads (None keeps torch's default: one per core)."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)


def freeze_startup_heap() -> None:
    """Take what start-up allocated (modules, model, tokenizer: about 300k objects in a loaded
    target process) out of the garbage collector's sight, as vLLM's server does after it starts.
    Otherwise every oldest-generation collection walks all of it: one such pause in the target
    measured 80 ms, a stall of every stream in the batch. Call once, when loading is done."""
    import gc

    gc.collect()
    gc.freeze()
