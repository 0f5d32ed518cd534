"""Host data onto a model's device without asking the host to wait for the GPU.

A plain host-to-GPU copy (``torch.tensor(..., device="cuda")``, ``t.to("cuda")``) makes torch
synchronize the stream after it: the host waits for every kernel queued before. Counted on an H200
with torch's sync debug mode (tests/test_cuda.py), a greedy target-only round did that 5 times, one
with the draft model 19 times and a sampled one 30; with these copies torch synchronizes once a
round, where it reads the round's tokens. A non-blocking copy from ordinary (pageable) memory is
complete or staged by the CUDA driver when the call returns (the driver may still wait on the stream
to stage it, which torch's count cannot see), so the source may change at once. Pinning each small
tensor first was measured slower on the tiny test pair, and this version was not shown faster than
the plain copies there either (docs/tests.md). On the CPU nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list, a number or a tensor) as a tensor on ``device``, copied from the host
    without a stream synchronization of torch's own."""
    device = torch.device(device)
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return data.to(device=device, dtype=dtype)
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)
