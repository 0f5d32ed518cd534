"""The committed demo pair: loads as plain Hugging Face models, and greedy speculation is lossless.

Criterion 4: with an fp32 target, greedy output with speculation (draft model and n-gram, k = 1..8;
"auto", whose controller picks k and drafter per row and round, up to 3 and 8; all 20 prompts
batched together) is token-identical to ``transformers`` ``generate(do_sample=False)``
on the target. A difference is tolerated only at an exact near-tie of the target's top two logits
(different kernel shapes for k+1 tokens vs 1 token can flip it); each one is reported with its gap.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.chat import encode_chat, encode_text
from specd.services.engine.engine import EngineConfig, Request, SpecConfig
from specd.services.engine.sampling import SamplingParams

CODE = [
    "def binary_search(items, target):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef walk(top):\n",
    "    def __repr__(self):\n        return",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "        if not isinstance(key, str):\n            raise TypeError(",
    "try:\n    import threading\nexcept ImportError:\n",
    "def _check_arg_types(funcname, *args):\n",
    "    for i, line in enumerate(lines):\n",
    "class HTTPError(Exception):\n",
]
QUESTIONS = [
    "Explain `json.loads`.",
    "What does `os.getcwd` do?",
    "How do I use `collections.Counter`?",
    "Describe the function `shutil.copy` from the `shutil` module.",
    "Explain `re.compile`.",
    "What does `math.isclose` do?",
    "How do I use `functools.lru_cache`?",
    "Explain `pathlib.Path`.",
    "What does `random.choice` do?",
    "Describe the function `time.sleep` from the `time` module.",
]
NEW_TOKENS = 32
TIE_GAP = 1e-3  # logit gap below which fp32 kernel-shape effects may legitimately flip the argmax


@pytest.fixture(scope="module")
def fp32_engine(demo_pair):
    target, draft = demo_pair
    return build_engine(
        ModelSpec(str(target), str(draft), target_dtype="float32", draft_dtype="float32"),
        EngineConfig(max_batch_size=20, max_model_len=512),
    )


@pytest.fixture(scope="module")
def hf_target(demo_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_pair[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(fp32_engine) -> list[tuple[int, ...]]:
    tok = fp32_engine.tokenizer
    return [tuple(encode_text(tok, c)) for c in CODE] + [
        tuple(encode_chat(tok, [{"role": "user", "content": q}])) for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def references(hf_target, prompts) -> list[list[int]]:
    """transformers' float32 greedy tokens per prompt, made once for every method's test."""
    refs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_target.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        refs.append(out[0, len(ids) :].tolist())
    return refs


def test_demo_models_are_standard_hf_checkpoints(demo_pair) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    total = 0
    for path in demo_pair:
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert model.config.model_type == "llama"
        assert len(tok) == model.config.vocab_size == 8192
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        assert "<|im_start|>" in cfg["chat_template"]
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        total += (path / "model.safetensors").stat().st_size
    assert total < 80e6
    n_target = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(demo_pair[0]).parameters())
    n_draft = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(demo_pair[1]).parameters())
    assert 25e6 < n_target < 40e6 and 1e6 < n_draft < 4e6


def _tie_gap(hf, ids: tuple[int, ...], upto: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([list(ids) + upto])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("method", ["draft", "ngram", "hybrid", "auto"])
def test_greedy_speculation_is_token_identical_to_transformers(
    fp32_engine, hf_target, prompts, references, method
) -> None:
    refs = references
    ties, failures = [], []
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    accepted = 0
    for k in (3, 8) if method == "auto" else range(1, 9):
        reqs = [Request(f"{method}-{k}-{i}", ids, params, SpecConfig(method, k)) for i, ids in enumerate(prompts)]
        results = fp32_engine.generate(reqs)  # all 20 in one batch
        for i, ids in enumerate(prompts):
            got = results[f"{method}-{k}-{i}"]
            accepted += got.stats.accepted_tokens
            if got.token_ids == refs[i]:
                continue
            first = next(j for j, (a, b) in enumerate(zip(got.token_ids, refs[i])) if a != b)
            gap = _tie_gap(hf_target, ids, refs[i][:first])
            (ties if gap < TIE_GAP else failures).append((k, i, first, gap))
    for k, i, pos, gap in ties:
        warnings.warn(f"{method} k={k} prompt {i}: near-tie at token {pos}, top-2 logit gap {gap:.2e}", stacklevel=1)
    assert not failures, f"greedy output differs from transformers (k, prompt, position, logit gap): {failures}"
    assert accepted > 0  # speculation really happened
    assert fp32_engine.active_slots == 0
