"""The rejection sampler and greedy verification as pure tensor functions.

Statistical tests use fixed seeds, so they are deterministic; their thresholds are set so that a
correct sampler passes with a wide margin and the deliberately wrong one below fails.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specd.services.engine.rejection import greedy_verify, recovered_distribution, rejection_sample

P = torch.tensor([0.2, 0.5, 0.3])
Q = torch.tensor([0.6, 0.3, 0.1])
N = 200_000


def _worked_example_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n independent one-guess rounds, guesses drawn from Q, target P at both positions."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(Q.expand(n, 3), 1, generator=g)  # [n, 1]
    target_probs = P.expand(n, 2, 3).contiguous()  # [n, k+1, V]
    draft_probs = Q.expand(n, 1, 3).contiguous()  # [n, k, V]
    return target_probs, draft, draft_probs


def test_worked_example_acceptance_fraction_is_0_6() -> None:
    tp, d, dp = _worked_example_batch(N, seed=1)
    _, emitted = rejection_sample(tp, d, dp, torch.Generator().manual_seed(2))
    accepted = (emitted == 2).float().mean().item()
    # Binomial sd at n=200k is ~0.0011; 0.005 is > 4 sd.
    assert abs(accepted - 0.6) < 0.005


def test_worked_example_residual_is_0_half_half() -> None:
    assert torch.allclose(recovered_distribution(P, Q), torch.tensor([0.0, 0.5, 0.5]))
    # And empirically: tokens emitted right after a rejection follow the residual.
    tp, d, dp = _worked_example_batch(N, seed=3)
    tokens, emitted = rejection_sample(tp, d, dp, torch.Generator().manual_seed(4))
    recovered = tokens[emitted == 1, 0]
    freq = torch.bincount(recovered, minlength=3).float() / recovered.numel()
    assert freq[0].item() == 0.0
    assert abs(freq[1].item() - 0.5) < 0.01 and abs(freq[2].item() - 0.5) < 0.01


def _first_token_chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens[:, 0], minlength=p.numel()).double().numpy()
    expected = p.double().numpy() / p.double().sum().item() * counts.sum()
    return stats.chisquare(counts, expected).pvalue


def test_worked_example_output_distribution_equals_p() -> None:
    tp, d, dp = _worked_example_batch(N, seed=5)
    tokens, _ = rejection_sample(tp, d, dp, torch.Generator().manual_seed(6))
    assert _first_token_chi2(tokens, P) > 1e-3


def test_chi_square_rejects_resampling_from_plain_p() -> None:
    """The test above can fail: the classic bug (resample from p, not the residual) gives [.28, .5, .22]."""
    tp, d, dp = _worked_example_batch(N, seed=7)
    g = torch.Generator().manual_seed(8)
    u = torch.rand(N, generator=g)
    accept = u * Q[d[:, 0]] < P[d[:, 0]]
    wrong = torch.where(accept, d[:, 0], torch.multinomial(P.expand(N, 3), 1, generator=g)[:, 0])
    assert _first_token_chi2(wrong.unsqueeze(1), P) < 1e-12


def test_identical_distributions_reject_nothing() -> None:
    g = torch.Generator().manual_seed(0)
    B, k, V = 64, 6, 50
    probs = torch.softmax(torch.randn(B, k + 1, V, generator=g) * 3, dim=-1)
    draft = torch.multinomial(probs[:, :k].reshape(-1, V), 1, generator=g).view(B, k)
    tokens, emitted = rejection_sample(probs, draft, probs[:, :k].clone(), g)
    assert torch.all(emitted == k + 1)
    assert torch.equal(tokens[:, :k], draft)


def test_point_mass_proposals() -> None:
    """draft_probs=None: accept with probability p(d); after a rejection never re-emit d."""
    V = 4
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    n = 100_000
    target = p.expand(n, 2, V).contiguous()
    draft = torch.full((n, 1), 1, dtype=torch.long)
    tokens, emitted = rejection_sample(target, draft, None, torch.Generator().manual_seed(9))
    assert abs((emitted == 2).float().mean().item() - 0.6) < 0.01
    recovered = tokens[emitted == 1, 0]
    assert not torch.any(recovered == 1)
    # Overall first-token distribution is still p.
    assert _first_token_chi2(tokens, p) > 1e-3


def test_no_guess_positions_sample_from_p() -> None:
    """-1 marks 'no guess': nothing is accepted there and the token comes from p itself."""
    V = 3
    n = 50_000
    target = P.expand(n, 3, V).contiguous()
    draft = torch.tensor([[-1, -1]]).expand(n, 2)
    tokens, emitted = rejection_sample(target, draft, None, torch.Generator().manual_seed(10))
    assert torch.all(emitted == 1)
    assert torch.all(tokens[:, 1:] == -1)
    assert _first_token_chi2(tokens, P) > 1e-3


def test_bonus_token_after_full_acceptance_comes_from_last_position() -> None:
    V = 5
    B = 20_000
    p_last = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])
    target = torch.zeros(B, 3, V)
    target[:, 0, 2] = 1.0  # guesses are certain to pass
    target[:, 1, 4] = 1.0
    target[:, 2] = p_last
    draft = torch.tensor([[2, 4]]).expand(B, 2)
    tokens, emitted = rejection_sample(target, draft, None, torch.Generator().manual_seed(11))
    assert torch.all(emitted == 3)
    assert _first_token_chi2(tokens[:, 2:], p_last) > 1e-3


def _random_block(B: int, k: int, V: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random p [B, k+1, V], q [B, k, V] and guesses drawn from q."""
    tp = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    dp = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    d = torch.multinomial(dp.reshape(-1, V), 1, generator=g).view(B, k)
    return tp, d, dp


def test_seeded_runs_repeat_exactly_and_per_row_generators_are_independent() -> None:
    B, k = 8, 4
    tp, d, dp = _random_block(B, k, 30, torch.Generator().manual_seed(0))
    a = rejection_sample(tp, d, dp, torch.Generator().manual_seed(42))
    b = rejection_sample(tp, d, dp, torch.Generator().manual_seed(42))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Per-row generators: row 3's result depends on its own seed only, not on its neighbours.
    gens = [torch.Generator().manual_seed(100 + i) for i in range(B)]
    full = rejection_sample(tp, d, dp, gens)
    alone = rejection_sample(tp[3:4], d[3:4], dp[3:4], [torch.Generator().manual_seed(103)])
    assert torch.equal(full[0][3:4], alone[0]) and torch.equal(full[1][3:4], alone[1])


@pytest.mark.parametrize("V", [7, 8192, 151_936])
def test_a_round_without_guesses_draws_what_a_row_without_guesses_draws_in_a_wider_round(V: int) -> None:
    """k = 0 (the target alone, or `auto` resting) takes a shorter path; a seeded row must draw the
    same token there as in a round where other rows guess and it has none (its uniform for the
    final token comes first either way, and its distribution is p at position 0 normalised). A
    different uniform fails this; a rounding-level change of the normalisation would rarely show."""
    B = 64
    g = torch.Generator().manual_seed(5)
    tp = torch.softmax(3 * torch.randn(B, 3, V, generator=g), -1)
    tp[0, 0] = 0.0  # a row with no mass at all: both paths fall back to p itself
    seeds = [int(x) for x in torch.randint(0, 2**62, (B,), generator=g)]
    no_guesses = torch.empty(B, 0, dtype=torch.long)
    alone, emitted = rejection_sample(tp[:, :1].contiguous(), no_guesses, None, seeds)
    guesses = torch.full((B, 2), -1)
    guesses[B // 2 :] = torch.randint(0, V, (B // 2, 2), generator=g)  # the other half guesses (n-gram)
    wider, _ = rejection_sample(tp, guesses, None, seeds)
    assert alone.shape == (B, 1) and torch.all(emitted == 1)
    assert torch.equal(alone[: B // 2, 0], wider[: B // 2, 0])


def test_a_round_without_guesses_samples_from_p() -> None:
    n = 50_000
    no_guesses = torch.empty(n, 0, dtype=torch.long)
    target = P.expand(n, 1, 3).contiguous()
    tokens, emitted = rejection_sample(target, no_guesses, None, torch.Generator().manual_seed(12))
    assert torch.all(emitted == 1)
    assert _first_token_chi2(tokens, P) > 1e-3


def test_output_layout_and_padding() -> None:
    g = torch.Generator().manual_seed(1)
    B, k = 32, 5
    tp, d, dp = _random_block(B, k, 20, g)
    tokens, emitted = rejection_sample(tp, d, dp, g)
    assert tokens.shape == (B, k + 1) and emitted.shape == (B,)
    assert torch.all((emitted >= 1) & (emitted <= k + 1))
    for b in range(B):
        n = int(emitted[b])
        assert torch.equal(tokens[b, : n - 1], d[b, : n - 1])  # accepted prefix is the guesses
        assert tokens[b, n - 1] >= 0
        assert torch.all(tokens[b, n:] == -1)


def test_multi_position_chain_matches_target_joint() -> None:
    """Two guesses: the joint law of the first two emitted tokens equals p1 x p2 (chi-square)."""
    V, n = 3, 200_000
    p1, p2 = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.1, 0.2, 0.7])
    q1, q2 = torch.tensor([0.2, 0.2, 0.6]), torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(12)
    d = torch.stack([torch.multinomial(q1, n, True, generator=g), torch.multinomial(q2, n, True, generator=g)], 1)
    target = torch.stack([p1, p2, p1]).expand(n, 3, V).contiguous()
    draft_probs = torch.stack([q1, q2]).expand(n, 2, V).contiguous()
    tokens, emitted = rejection_sample(target, d, draft_probs, g)
    # The second token is only defined when the first guess was accepted; otherwise a new round
    # would draw it from p2 (position-independent target here), so complete those with p2 draws.
    second = torch.where(emitted >= 2, tokens[:, 1], torch.multinomial(p2, n, True, generator=g))
    assert _first_token_chi2((tokens[:, :1] * V + second[:, None]), (p1[:, None] * p2[None, :]).flatten()) > 1e-3


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_verify_is_argmax_prefix(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    B, V = 16, 40
    logits = torch.randn(B, k + 1, V, generator=g)
    best = logits.argmax(-1)
    # Row b guesses the argmax for its first b % (k+1) positions, then something else.
    d = best[:, :k].clone()
    n_good = torch.arange(B) % (k + 1)
    for b in range(B):
        if n_good[b] < k:
            d[b, n_good[b]] = (best[b, n_good[b]] + 1) % V
    tokens, emitted = greedy_verify(logits, d)
    assert torch.equal(emitted, n_good + 1)
    for b in range(B):
        n = int(emitted[b])
        assert torch.equal(tokens[b, :n], best[b, :n])
        assert torch.all(tokens[b, n:] == -1)


def test_greedy_verify_with_no_guesses_is_one_argmax_step() -> None:
    logits = torch.tensor([[[0.1, 2.0, -1.0], [5.0, 0.0, 0.0]]])
    tokens, emitted = greedy_verify(logits, torch.tensor([[-1]]))
    assert tokens.tolist() == [[1, -1]] and emitted.tolist() == [1]


def test_greedy_verify_of_a_round_without_guesses() -> None:
    """k = 0 (target alone, `auto` at rest) takes a short path: one argmax token per row, the first
    maximum on ties, as the long form's layout ([B, 1] long, one token emitted per row)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-2, 3, (9, 1, 50), generator=g).float()  # many ties
    tokens, emitted = greedy_verify(logits, torch.empty(9, 0, dtype=torch.long))
    assert tokens.dtype == torch.long and emitted.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(-1)) and emitted.tolist() == [1] * 9


def test_argmax_last_is_torchs_argmax() -> None:
    """Greedy tokens come from argmax_last (numpy's argmax on a CPU, for speed): the same indices as
    torch's argmax on ties (the first maximum), NaN (the first NaN), infinities, signed zeros, strided
    views and any rank, and torch's own where numpy has no such dtype (bf16)."""
    from specd.services.engine.sampling import argmax_last

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (6, 5, 64), generator=g).float()  # many ties
    x[0, 0, 7] = float("nan")
    x[0, 1, 9] = x[0, 1, 20] = float("nan")
    x[1, 0] = float("-inf")
    x[1, 1, 3] = x[1, 1, 5] = float("inf")
    x[2, 0] = 0.0
    x[2, 0, ::2] = -0.0
    views = [x, x[:, 0], x[:, :, ::3], x.transpose(0, 1), x[0, 0], torch.randn(4, 8192, generator=g)]
    for v in views:
        got = argmax_last(v)
        assert got.dtype == torch.long and torch.equal(got, v.argmax(dim=-1)), v.shape
    b = x.bfloat16()
    assert torch.equal(argmax_last(b), b.argmax(dim=-1))
    with torch.inference_mode():
        assert torch.equal(argmax_last(x), x.argmax(dim=-1))
