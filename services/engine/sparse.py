"""Sparse proposal distributions, so the draft's q can cross the network.

A dense q is vocab-sized per guessed token (about 600 KB per token for a 150k vocabulary in
float32). Instead the draft samples from an *exactly truncated* q: the processed distribution kept
on its ``support`` most likely tokens and renormalised. Its guesses really are drawn from that
truncated q, and the rejection rule min(1, p/q) followed by a resample from norm(max(0, p - q)) is
lossless for *any* proposal q, so sending only the truncated entries loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseProbs:
    """Proposal distributions as they cross the network: per row and guess the support's token ids
    and their probabilities, padded with probability 0. The engine densifies them once, into its
    round's q (:func:`to_dense` is the same scatter)."""

    ids: torch.Tensor  # [B, K, m] long
    probs: torch.Tensor  # [B, K, m] float32


def truncate_probs(q: torch.Tensor, support: int) -> torch.Tensor:
    """Keep each row's ``support`` largest entries, zero the rest and renormalise.

    q: [..., V] probabilities. Returns the same shape. Rows with fewer non-zero entries are unchanged.
    """
    if support >= q.shape[-1]:
        return q
    top, idx = q.topk(support, dim=-1)  # [..., m]
    out = torch.zeros_like(q).scatter_(-1, idx, top)
    return out / out.sum(dim=-1, keepdim=True)


def to_sparse(q: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token ids [..., m], probs [..., m]) holding all of q's mass, m = min(support, V).

    For a q that :func:`truncate_probs` produced with the same ``support`` this is exact; entries
    with zero mass may appear in the result and carry probability 0.
    """
    probs, ids = q.topk(min(support, q.shape[-1]), dim=-1)
    return ids, probs


def to_dense(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`to_sparse`: scatter [..., m] entries into [..., V] (padding ids may repeat
    as long as their probs are 0: entries are added, not overwritten)."""
    out = torch.zeros((*ids.shape[:-1], vocab_size), dtype=torch.float32, device=ids.device)
    return out.scatter_add_(-1, ids.long(), probs.float())
