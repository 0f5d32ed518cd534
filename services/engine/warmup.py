"""Running a model once before it serves, so no request (and no timing) pays for the first call.

A model's first passes on a CPU are several times slower than the ones after (the real pair's draft:
a 39-token prefill 767 ms, then 200; its first decode step 230 ms, then 53): allocations, lazy
kernel set-up. Served cold, the first request's time to first token pays for it, and worse, the
first round's timings are the ones ``method="auto"``'s cost model starts from: a draft step priced
at four times its cost turns speculation off until exploration happens to time it again. So each
model runs a short prefill and a decode pass per width it will see, in a scratch slot, before the
engine or the draft service takes requests (TGI's and llama.cpp's servers warm up likewise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.services.engine.model import CausalLM
from specd.services.engine.prefill import PrefillRow, prefill_pass

WARMUP_PROMPT_TOKENS = 16
# A decode step and a typical verify block. The first call is the slow one; later first calls at
# other widths cost little more than warm ones (the real target: 7 tokens 168 ms, 17 tokens 371
# the first time and 386 the second).
WARMUP_WIDTHS = (1, 4)


@torch.inference_mode()
def warm_up(
    model: CausalLM, cache, widths: Sequence[int] = WARMUP_WIDTHS, prompt_tokens: int = WARMUP_PROMPT_TOKENS
) -> bool:
    """One prefill pass of ``prompt_tokens`` and one batch-1 forward of each width in ``widths``, in
    a slot of ``cache`` that is freed again (its blocks too); False when the cache has no room
    (nothing was run). Token id 0 throughout: the values do not matter, the shapes do."""
    if cache.free_slots == 0:
        return False
    slot = cache.allocate()
    try:
        if not cache.reserve(slot, prompt_tokens + max(widths, default=0) + 1):
            return False
        prefill_pass(model, cache, [PrefillRow(slot, 0, [0] * prompt_tokens)])
        for w in widths:
            ids = torch.zeros((1, w), dtype=torch.long, device=model.device)
            model.forward(ids, cache, cache.layout([slot], [prompt_tokens], w, model.device), "all")
        return True
    finally:
        cache.release(slot)
