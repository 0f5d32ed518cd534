"""Per-request randomness on any device: the seed logic on the CPU, the sampled engine path on CUDA."""

from __future__ import annotations

import pytest
import torch

from specd.services.engine.rejection import rejection_sample
from specd.services.engine.sampling import draw_seed, make_generator, round_generator, uniforms


def test_same_seed_same_draws_whatever_the_batch() -> None:
    """A row's uniforms depend only on its own generator: alone or beside any companions."""
    alone = uniforms((5,), [round_generator(make_generator(7))], 1, "cpu")
    assert uniforms((2,), [None, make_generator(7)], 2, "cpu").shape == (2, 2)  # greedy rows carry None
    companions = [make_generator(1), make_generator(7), make_generator(None)]
    together = uniforms((5,), [round_generator(g) for g in companions], 3, "cpu")
    assert torch.equal(alone[0], together[1])
    assert not torch.equal(together[0], together[1])  # other seeds, other streams
    # Successive rounds of one request differ, and repeat under the same seed.
    g1, g2 = make_generator(7), make_generator(7)
    seeds1 = [draw_seed(g1) for _ in range(4)]
    assert seeds1 == [draw_seed(g2) for _ in range(4)] and len(set(seeds1)) == 4


def test_rejection_sampling_with_per_row_generators_is_batch_independent() -> None:
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(3, 4, 50), -1)
    q = torch.softmax(torch.randn(3, 3, 50), -1)
    guesses = torch.randint(0, 50, (3, 3))
    rows = [
        rejection_sample(p[i : i + 1], guesses[i : i + 1], q[i : i + 1], [make_generator(100 + i)]) for i in range(3)
    ]
    tokens, n = rejection_sample(p, guesses, q, [make_generator(100 + i) for i in range(3)])
    for i, (t, m) in enumerate(rows):
        assert torch.equal(tokens[i], t[0]) and int(n[i]) == int(m[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampled_engine_path_on_cuda(tiny_pair) -> None:
    """temperature > 0 on a GPU: drafts, verification and the remote drafter's seed draw all work,
    a seeded request repeats exactly, and a CUDA generator can feed every draw too."""
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.engine import EngineConfig, Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    target, draft = tiny_pair
    spec = ModelSpec(str(target), str(draft), "float32", "float32", device="cuda")
    engine = build_engine(spec, EngineConfig(max_batch_size=4, max_model_len=128))
    ids = tuple(engine.tokenizer("def f(x):\n", add_special_tokens=False)["input_ids"])
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True)
    reqs = [Request(f"c{m}", ids, params, SpecConfig(m, 3)) for m in ("draft", "ngram", "hybrid", "none")]
    first = engine.generate(reqs)
    again = engine.generate(reqs)
    for r in reqs:
        assert len(first[r.request_id].token_ids) == 20
        assert first[r.request_id].token_ids == again[r.request_id].token_ids
    cuda_gen = make_generator(5, "cuda")
    assert uniforms((3,), [cuda_gen], 1, "cuda").device.type == "cuda"
    assert uniforms((3,), cuda_gen, 2, "cpu").device.type == "cpu"
    assert isinstance(draw_seed(make_generator(5, "cuda")), int)
