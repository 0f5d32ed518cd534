"""Speculative verification: the lossless rejection sampler and greedy verification.

Pure tensor functions, vectorised over the batch and the block; no Python loop over tokens.

Conventions shared by both functions:
- ``draft_token_ids`` [B, k] long. ``-1`` marks "no proposal" at that position (a drafter that had
  fewer than k guesses for this row, or a row with speculation off). A -1 is never accepted and, as
  its q is zero, the token emitted there comes from the target distribution itself.
- The result is ``(token_ids [B, k+1] long padded with -1, num_emitted [B] long)``: row b emits
  ``token_ids[b, :num_emitted[b]]``, i.e. its accepted draft tokens followed by one token from the
  target (the recovered token after a rejection, or the bonus token when every guess passed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.services.engine.sampling import argmax_last, sample_from, uniforms

# One generator for the batch, or per row a generator or a round's seed (sampling.uniforms).
Generators = torch.Generator | Sequence[torch.Generator | int] | None


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """Assemble [B, k+1]: accepted drafts, then ``final_token`` at position num_accepted, then -1."""
    B, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device).unsqueeze(0)  # [1, k+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], dim=1)
    out = torch.where(pos < num_accepted.unsqueeze(1), padded, padded.new_full((), -1))
    return out.scatter(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))


def recovered_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim: where a rejected guess's replacement is drawn from.

    With q = 0 (no guess, or the bonus position) it is p itself. max(0, p - q) has no mass only if
    p == q, which a rejection rules out up to rounding; p is used there rather than nothing.
    """
    return _normalised((p - q).clamp_min(0.0), p)


def _normalised(residual: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``residual`` [..., V] divided by its sum, or ``p`` where it has no mass: the last step of
    :func:`recovered_distribution`, shared with the round without guesses (_sample_alone), whose
    draws must be the general path's bit for bit."""
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. Algorithm 1, batched.

    target_probs [B, k+1, V] float: the target's processed distributions p_1..p_{k+1}.
    draft_token_ids [B, k] long: proposals (-1 = none at this position).
    draft_probs [B, k, V] float or None: the proposal distributions q the drafts were sampled from;
        None means point-mass proposals (n-gram lookup), q(d) = 1.
    generator: one generator for the whole batch, one per row (a generator or a round's seed: seeded
        requests), or None (global RNG).
    Returns (token_ids [B, k+1] long padded with -1, num_emitted [B] long).

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    emitted token is drawn from norm(max(0, p_i - q_i)); if all k pass, a bonus token is drawn from
    p_{k+1}. The emitted tokens then follow p exactly, whatever q is.
    """
    B, k1, V = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    if k == 0:
        return _sample_alone(target_probs, generator)
    has_draft = draft_token_ids >= 0  # [B, k]
    safe_ids = draft_token_ids.clamp_min(0).unsqueeze(-1)  # [B, k, 1]
    p_d = target_probs[:, :k].gather(-1, safe_ids).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(-1, safe_ids).squeeze(-1)  # [B, k]

    # One uniform for the final token, then one per guess: the final one comes first so that, with
    # a fresh generator per round, a row's draws are the same whatever the batch's k is.
    u_all = uniforms((k + 1,), generator, B, device)  # [B, k+1]
    u_final, u = u_all[:, 0], u_all[:, 1:]
    # Strict '<' so that p_d == 0 is never accepted, even when u == 0.
    accepted = has_draft & (u * q_d < p_d)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B], length of the accepted prefix

    # Distribution of the final token: position num_accepted of p, minus q there when that position
    # held a (rejected) proposal. At the bonus position (num_accepted == k) q is zero.
    rows = torch.arange(B, device=device)
    p_sel = target_probs[rows, num_accepted]  # [B, V]
    at = num_accepted.clamp_max(max(k - 1, 0))
    rejected_here = (
        (num_accepted < k) & has_draft[rows, at] if k > 0 else torch.zeros(B, dtype=torch.bool, device=device)
    )
    if draft_probs is None:
        q_sel = torch.zeros_like(p_sel)
        if k > 0:
            q_sel.scatter_(1, safe_ids[rows, at], 1.0)
    else:
        q_sel = draft_probs[rows, at] if k > 0 else torch.zeros_like(p_sel)
    q_sel = q_sel * rejected_here.unsqueeze(1).to(q_sel.dtype)
    residual = recovered_distribution(p_sel, q_sel)  # [B, V]
    final = sample_from(residual, u_final)  # [B]
    return _emit(draft_token_ids, num_accepted, final), num_accepted + 1


def _sample_alone(target_probs: torch.Tensor, generator: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample` for a round without guesses (target alone, or `auto` resting), the
    same draws: one uniform a row (the final token's, drawn first there too), the token from
    ``recovered_distribution(p, 0)`` through the same normalisation (_normalised). The general path's
    gathers, masks and zero q cost the demo target alone about 7% of its speed at a temperature
    (docs/benchmarks.md); this is the same arithmetic on the same values, so the same tokens bit
    for bit. A test checks a seeded row's draws against a wider round's (a different uniform would
    fail it; a change of the normalisation's rounding, too rare to show, would not).

    target_probs [B, 1, V] -> (token_ids [B, 1], num_emitted [B] of ones)."""
    B = target_probs.shape[0]
    u_final = uniforms((1,), generator, B, target_probs.device)[:, 0]
    p = target_probs[:, 0]  # [B, V], contiguous as the general path's gathered copy is
    # (p - 0).clamp_min(0) is p itself, so recovered_distribution(p, 0) is this.
    final = sample_from(_normalised(p, p), u_final)
    return final.unsqueeze(1), torch.ones(B, dtype=torch.long, device=target_probs.device)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while d_i == argmax p_i; the first mismatch becomes argmax p_i.

    target_logits [B, k+1, V] (logits or probabilities: only the argmax is used).
    draft_token_ids [B, k] long (-1 = none). Returns (token_ids [B, k+1], num_emitted [B]) as
    :func:`rejection_sample` does. The result is exactly target-only greedy decoding.
    """
    k = draft_token_ids.shape[1]
    best = argmax_last(target_logits)  # [B, k+1]
    if k == 0:
        # A round without guesses (target alone, or `auto` resting): the argmax is the whole answer,
        # and the dozen small ops below cost a demo-target token about 4% of its time.
        return best, torch.ones(best.shape[0], dtype=torch.long, device=best.device)
    match = draft_token_ids == best[:, :k]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    final = best.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _emit(draft_token_ids, num_accepted, final), num_accepted + 1
