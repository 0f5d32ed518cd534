"""Speculative sampling with real models follows the target's distribution (criterion 3).

On the micro pair (12-token vocabulary) the exact joint law of the first three generated tokens is
enumerated from the target with transformers. The engine then samples thousands of seeded requests
with speculation (the draft model; hybrid; auto, the controller's per-row choice of k and drafter),
batched, and a chi-square test compares the two. The same test with a
deliberately wrong rejection sampler must fail, which shows the test has power.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

import specd.services.engine.engine as engine_mod
from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.engine import EngineConfig, Request, SpecConfig
from specd.services.engine.rejection import rejection_sample
from specd.services.engine.sampling import BatchSampling, SamplingParams, make_generator, processed_probs

PROMPT = (3, 7, 5, 9)
N_SAMPLES = 4000
SETTINGS = [
    pytest.param(1.0, 1.0, "draft", id="T1.0-draft"),
    pytest.param(0.7, 0.9, "draft", id="T0.7-top_p0.9-draft"),
    pytest.param(1.0, 1.0, "hybrid", id="T1.0-hybrid"),  # rounds mix point-mass and model guesses
    # The controller's choice: k 0..3 and the drafter per row and round, from each row's own history.
    pytest.param(0.7, 0.9, "auto", id="T0.7-top_p0.9-auto"),
]


def _exact_joint(target_dir, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) under the target with the requested processing, [V, V, V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    sampling = BatchSampling.from_params([params])

    def dist(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1:]  # [n, 1, V]
        rows = [processed_probs(logits[i : i + 1], sampling)[0, 0] for i in range(len(prefixes))]
        return torch.stack(rows).double()

    p1 = dist([()])[0]  # [V]
    p2 = dist([(a,) for a in range(V)])  # [V, V]
    p3 = dist(list(itertools.product(range(V), range(V)))).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def _sample_joint(pair, params: SamplingParams, method: str = "draft", device: str = "cpu") -> np.ndarray:
    target, draft = pair
    engine = build_engine(
        ModelSpec(str(target), str(draft), "float32", "float32", device=device),
        EngineConfig(max_batch_size=64, max_model_len=64),
    )
    V = engine.target.info.vocab_size
    reqs = [
        Request(
            f"r{i}",
            PROMPT,
            SamplingParams(params.temperature, params.top_k, params.top_p, seed=i, max_tokens=3, ignore_eos=True),
            SpecConfig(method, 3),
        )
        for i in range(N_SAMPLES)
    ]
    counts = np.zeros((V, V, V))
    res = engine.generate(reqs)
    proposed = sum(r.stats.proposed_tokens for r in res.values())
    accepted = sum(r.stats.accepted_tokens for r in res.values())
    assert proposed > 0 and 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejects"
    for r in res.values():
        counts[tuple(r.token_ids)] += 1
    return counts


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells with expected count < 5 into one."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten()
    small = exp < 5
    obs_pooled = np.append(obs[~small], obs[small].sum())
    exp_pooled = np.append(exp[~small], exp[small].sum())
    exp_pooled *= obs_pooled.sum() / exp_pooled.sum()
    return stats.chisquare(obs_pooled, exp_pooled).pvalue


@pytest.mark.parametrize(("temperature", "top_p", "method"), SETTINGS)
def test_speculative_sampling_matches_target(micro_pair, temperature: float, top_p: float, method: str) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p)
    exact = _exact_joint(micro_pair[0], params)
    assert abs(exact.sum() - 1) < 1e-6
    counts = _sample_joint(micro_pair, params, method)
    assert _chi2_pvalue(counts, exact) > 1e-3


def _wrong_rejection_sample(target_probs, draft_token_ids, draft_probs, generator=None):
    """The classic bug: after a rejection, resample from p instead of norm(max(0, p - q))."""
    tokens, emitted = rejection_sample(target_probs, draft_token_ids, draft_probs, generator)
    k = draft_token_ids.shape[1]
    if k == 0:
        return tokens, emitted
    rows = torch.arange(tokens.shape[0])
    pos = emitted - 1
    rejected = (pos < k) & (draft_token_ids[rows, pos.clamp_max(k - 1)] >= 0)
    # From a stream of its own: the row's seed itself would replay the uniforms rejection_sample used.
    gens = [make_generator(seed + 1) for seed in generator]
    resampled = torch.stack([target_probs[b, pos[b]].multinomial(1, generator=gens[b])[0] for b in range(len(rows))])
    tokens[rows, pos] = torch.where(rejected, resampled, tokens[rows, pos])
    return tokens, emitted


def test_chi_square_catches_a_wrong_sampler(micro_pair, monkeypatch) -> None:
    params = SamplingParams(temperature=1.0)
    exact = _exact_joint(micro_pair[0], params)
    monkeypatch.setattr(engine_mod, "rejection_sample", _wrong_rejection_sample)
    counts = _sample_joint(micro_pair, params)
    pvalue = _chi2_pvalue(counts, exact)
    assert pvalue < 1e-6
