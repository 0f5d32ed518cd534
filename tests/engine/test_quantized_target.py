"""A quantized target (``--quantize int8|int4``) is a different model, chosen by the user; speculation
must keep its output exactly: greedy output identical to the same quantized target decoding alone,
and sampled output following its law. Greedy identity holds in the configuration served by default,
bf16 on the fused CPU forward, which is batch invariant end to end (tests/engine/test_fused_decoder.py):
verifying k+1 tokens computes each row exactly as decoding it alone does. The per-op forward (float32
here, or any model the fused one cannot run) is not: its attention over k+1 query rows may differ in
the last bit from one row's, and the int8 rounding of the next layer's activations can turn that
into a different token at a near-tie. The sampling-law test needs no bitwise identity.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.chat import encode_text
from specd.services.engine.engine import EngineConfig, Request, SpecConfig
from specd.services.engine.kernels import _cpu_has_avx2_fma
from specd.services.engine.model import BatchLayout, load_model
from specd.services.engine.sampling import BatchSampling, SamplingParams, processed_probs
from tests.engine.test_sampling_distribution import PROMPT, _chi2_pvalue

pytestmark = pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the quantized kernels need AVX2, FMA and F16C")


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_greedy_speculation_is_identical_to_the_quantized_target_alone(demo_pair, quantize: str) -> None:
    target, draft = demo_pair
    engine = build_engine(
        ModelSpec(str(target), str(draft), "bfloat16", "bfloat16", draft_quantize="int4", target_quantize=quantize),
        EngineConfig(max_batch_size=4, max_model_len=256),
    )
    assert engine.target.kernel_name == f"specd-avx2-{quantize}" and engine.target.forward_path == "fused"
    prompts = [tuple(encode_text(engine.tokenizer, p)) for p in ("def f(x):\n", "import os\n", "class A:\n")]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = engine.generate([Request(f"n{i}", p, greedy, SpecConfig("none", 0)) for i, p in enumerate(prompts)])
    for method, k in (("draft", 2), ("draft", 4), ("ngram", 3), ("hybrid", 3)):
        got = engine.generate(
            [Request(f"{method}{k}{i}", p, greedy, SpecConfig(method, k)) for i, p in enumerate(prompts)]
        )
        if method != "ngram":
            assert sum(got[f"{method}{k}{i}"].stats.accepted_tokens for i in range(3)) > 0
        assert [got[f"{method}{k}{i}"].token_ids for i in range(3)] == [ref[f"n{i}"].token_ids for i in range(3)]


def test_the_quantized_target_stays_close_to_the_unquantized_one(demo_pair) -> None:
    """Quantization changes the model, a little: greedy text agrees with the float32 target for a
    while (int8 almost everywhere). A broken quantizer (wrong nibble order, scale or min) does not."""
    target, _ = demo_pair
    prompts = ("def f(x):\n", "import os\n", "class A:\n", "for i in range(")
    outputs = {}
    for quantize in (None, "int8", "int4"):
        engine = build_engine(
            ModelSpec(str(target), None, "float32", target_quantize=quantize), EngineConfig(max_batch_size=4)
        )
        ids = [tuple(encode_text(engine.tokenizer, p)) for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        res = engine.generate([Request(f"r{i}", p, params, SpecConfig("none", 0)) for i, p in enumerate(ids)])
        outputs[quantize] = [res[f"r{i}"].token_ids for i in range(len(prompts))]

    def agreement(a: list[list[int]], b: list[list[int]]) -> float:
        """Mean fraction of each output that matches before the first difference."""
        prefix = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) / len(u) for u, v in zip(a, b)]
        return sum(prefix) / len(prefix)

    assert agreement(outputs["int8"], outputs[None]) >= 0.75
    assert agreement(outputs["int4"], outputs[None]) >= 0.25


def _exact_joint(model, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) under ``model`` (our own forward, quantized as served), [V, V, V]."""
    V = model.info.vocab_size
    sampling = BatchSampling.from_params([params])

    def dist(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        cache = model.new_cache(len(prefixes), ids.shape[1])
        logits = model.forward(ids, cache, BatchLayout(list(range(len(prefixes))), [0] * len(prefixes), ids.shape[1]))
        rows = [processed_probs(logits[i : i + 1, -1:], sampling)[0, 0] for i in range(len(prefixes))]
        return torch.stack(rows).double()

    p1 = dist([()])[0]
    p2 = dist([(a,) for a in range(V)])
    p3 = dist(list(itertools.product(range(V), range(V)))).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def test_speculative_sampling_follows_the_quantized_target(micro_pair) -> None:
    target, draft = micro_pair
    params = SamplingParams(temperature=1.0)
    exact = _exact_joint(load_model(str(target), torch.float32, quantize="int4"), params)
    assert abs(exact.sum() - 1) < 1e-6
    engine = build_engine(
        ModelSpec(str(target), str(draft), "float32", "float32", draft_quantize="int4", target_quantize="int4"),
        EngineConfig(max_batch_size=64, max_model_len=64),
    )
    reqs = [
        Request(f"r{i}", PROMPT, SamplingParams(1.0, seed=i, max_tokens=3, ignore_eos=True), SpecConfig("draft", 3))
        for i in range(4000)
    ]
    res = engine.generate(reqs)
    proposed = sum(r.stats.proposed_tokens for r in res.values())
    accepted = sum(r.stats.accepted_tokens for r in res.values())
    assert proposed > 0 and 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejects"
    counts = np.zeros_like(exact)
    for r in res.values():
        counts[tuple(r.token_ids)] += 1
    assert _chi2_pvalue(counts, exact) > 1e-3
