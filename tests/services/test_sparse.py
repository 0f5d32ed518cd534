"""Sparse proposal distributions: exact round trip, and the same output law as dense q."""

from __future__ import annotations

import torch
from scipy import stats

from specd.services.engine.rejection import rejection_sample
from specd.services.engine.sparse import to_dense, to_sparse, truncate_probs

V = 10
N = 200_000


def test_truncate_keeps_the_top_mass_and_renormalises() -> None:
    q = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    t = truncate_probs(q, 2)
    assert torch.allclose(t, torch.tensor([[0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0]]))
    assert torch.equal(truncate_probs(q, 5), q)


def test_sparse_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(4, 3, 50, generator=g), dim=-1)
    t = truncate_probs(q, 8)
    ids, probs = to_sparse(t, 8)
    assert ids.shape == (4, 3, 8)
    assert torch.equal(to_dense(ids, probs, 50), t)
    # Zero-mass padding entries (repeated ids) must not overwrite real mass.
    ids_pad = torch.cat([ids, torch.zeros_like(ids[..., :2])], dim=-1)
    probs_pad = torch.cat([probs, torch.zeros_like(probs[..., :2])], dim=-1)
    assert torch.equal(to_dense(ids_pad, probs_pad, 50), t)


def _emitted_first_token(q_proposal: torch.Tensor, p: torch.Tensor, seed: int) -> torch.Tensor:
    """N one-guess rounds: the guess drawn from q_proposal, verified against p with q_proposal."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q_proposal.expand(N, V), 1, replacement=True, generator=g)  # [N, 1]
    tp = p.expand(N, 2, V).contiguous()
    qp = q_proposal.expand(N, 1, V).contiguous()
    tokens, _ = rejection_sample(tp, draft, qp, torch.Generator().manual_seed(seed + 1))
    return torch.bincount(tokens[:, 0], minlength=V)


def test_sparse_truncated_and_dense_q_give_the_target_distribution() -> None:
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    ids, probs = to_sparse(truncate_probs(q, 3), 3)  # what travels over the wire: 3 of 10 tokens
    q_sparse = to_dense(ids, probs, V)
    dense = _emitted_first_token(q, p, seed=1)
    sparse = _emitted_first_token(q_sparse, p, seed=2)
    for counts in (dense, sparse):
        assert stats.chisquare(counts.numpy(), (p.double() / p.double().sum() * N).numpy()).pvalue > 1e-3
    # And the two samples are indistinguishable from each other.
    table = torch.stack([dense, sparse]).numpy()
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_the_chi_square_has_power_against_a_wrong_q() -> None:
    """Verifying with the untruncated q while guessing from the truncated one is biased; detect it."""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    q_trunc = truncate_probs(q, 3)
    gen = torch.Generator().manual_seed(3)
    draft = torch.multinomial(q_trunc.expand(N, V), 1, replacement=True, generator=gen)
    tokens, _ = rejection_sample(
        p.expand(N, 2, V).contiguous(), draft, q.expand(N, 1, V).contiguous(), torch.Generator().manual_seed(4)
    )
    counts = torch.bincount(tokens[:, 0], minlength=V)
    assert stats.chisquare(counts.numpy(), (p.double() / p.double().sum() * N).numpy()).pvalue < 1e-6
