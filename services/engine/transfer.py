"""Host data onto a model's device without making the host wait for the GPU.

A plain host-to-GPU copy (``torch.tensor(..., device="cuda")``, ``t.to("cuda")``) returns only once
every kernel queued before it has run: each one in a round drains the GPU's queue. Counted on an
H200 with torch's sync debug mode (tests/test_cuda.py), a greedy target-only round waited 5 times,
one with the draft model 19 times and a sampled one 30; with these copies every round waits once,
where it reads its tokens. A non-blocking copy from ordinary (pageable) memory is staged by the
driver before the call returns, so the source may be dropped at once; pinning each small tensor
first was measured slower on the tiny test pair. On the CPU nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list, a number or a tensor) as a tensor on ``device``, copied from the host
    without waiting for the work already queued on a GPU."""
    device = torch.device(device)
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return data.to(device=device, dtype=dtype)
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)
