"""Logit processing, n-gram lookup and incremental detokenization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.services.common.constants import CATCH_UP_TOKENS
from specd.services.engine.detokenize import Detokenizer
from specd.services.engine.drafters import NGramDrafter
from specd.services.engine.sampling import BatchSampling, SamplingParams, processed_probs


def _reference(logits: torch.Tensor, t: float, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward one-row implementation (HF's TopK then TopP warper order)."""
    x = logits / t
    if top_k:
        kth = torch.topk(x, top_k).values[-1]
        x = torch.where(x < kth, torch.tensor(float("-inf")), x)
    p = torch.softmax(x, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += p[i].item()
        if mass >= top_p:
            break
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize(
    ("t", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 10, 0.8), (2.0, 1, 0.5)]
)
def test_processed_probs_matches_reference(t: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 40, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p)] * 3
    got = processed_probs(logits, BatchSampling.from_params(params))
    for b in range(3):
        for j in range(2):
            assert torch.allclose(got[b, j], _reference(logits[b, j], t, top_k, top_p), atol=1e-6)


def test_processed_probs_mixes_per_row_settings() -> None:
    logits = torch.randn(2, 1, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3)]
    got = processed_probs(logits, BatchSampling.from_params(params))
    assert (got[0, 0] > 0).all()
    assert int((got[1, 0] > 0).sum()) == 3


def test_ngram_lookup_prefers_longest_and_latest_match() -> None:
    d = NGramDrafter(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # Suffix (6, 7) appears at 1 and 5; (2, 6, 7) nowhere before; the latest 2-gram match wins.
    assert d.lookup(tokens, 3) == [9, 2, 6]
    assert d.lookup([1, 2, 3], 4) == []  # nothing repeats
    assert d.lookup([4, 4], 2) == [4]  # continuation is cut at the context's end


def test_ngram_min_n_is_respected() -> None:
    assert NGramDrafter(min_n=2, max_n=3).lookup([1, 2, 3, 9, 3], 2) == []
    assert NGramDrafter(min_n=1, max_n=3).lookup([1, 2, 3, 9, 3], 2) == [9, 3]


class _CharTokenizer:
    """One token per character; id 0 is a special token that decodes to nothing."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _ids(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_detokenizer_holds_back_possible_stop_prefix() -> None:
    d = Detokenizer(_CharTokenizer(), stop=("END",))
    assert d.push(_ids("hello E")) == ("hello ", 7)
    assert d.push(_ids("N")) == ("", 1)  # "EN" may still become "END"
    assert d.push(_ids("Dxyz")) == ("", 1)  # stop completes on the first id: the rest is dropped
    assert d.stopped and d.flush() == ""


def test_detokenizer_releases_held_text_when_no_stop() -> None:
    d = Detokenizer(_CharTokenizer(), stop=("END",))
    assert d.push(_ids("abcE")) == ("abc", 4)
    assert d.push(_ids("x")) == ("Ex", 1)
    assert d.push(_ids("EN")) == ("", 2)
    assert d.flush() == "EN"


def test_detokenizer_holds_incomplete_utf8() -> None:
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    d = Detokenizer(Bytes())
    snow = "é".encode()
    assert d.push([ord("a"), snow[0]]) == ("a", 2)
    assert d.push([snow[1]]) == ("é", 1)


def test_model_drafter_asked_again_without_new_tokens_repeats_its_guesses(micro_pair) -> None:
    """Asked again with nothing accepted and nothing new committed, the drafter re-feeds the last
    committed token and guesses the same tokens (it used to fail on an empty step-0 input)."""
    from specd.services.engine.drafters import DraftRow, ModelDrafter
    from specd.services.engine.model import load_model

    drafter = ModelDrafter(load_model(str(micro_pair[1]), torch.float32, "cpu"), 2, 64)
    tokens = [3, 7, 5, 9, 2]
    drafter.add("s", tokens)
    greedy = BatchSampling.from_params([SamplingParams(0.0)], "cpu")
    first = drafter.propose([DraftRow("s", tokens, 4, True)], greedy).token_ids.tolist()
    drafter.accepted("s", 0)
    again = drafter.propose([DraftRow("s", tokens, 4, True)], greedy).token_ids.tolist()
    assert again == first and min(first[0]) >= 0


def test_model_drafter_counts_the_tokens_it_catches_up(micro_pair) -> None:
    """``unseen`` says how many committed tokens the next proposal feeds first (what auto prices a
    row at, CostModel.d_catch), and a proposal reports those past CATCH_UP_TOKENS (Proposal.caught_up)."""
    from specd.services.engine.drafters import DraftRow, ModelDrafter
    from specd.services.engine.model import load_model

    drafter = ModelDrafter(load_model(str(micro_pair[1]), torch.float32, "cpu"), 2, 64)
    greedy = BatchSampling.from_params([SamplingParams(0.0)], "cpu")
    tokens = [3, 7, 5, 9, 2]
    drafter.add("s", tokens)
    drafter.prefill(16)
    assert drafter.unseen("s", len(tokens)) == 1  # the prompt's last token, fed by the first proposal
    prop = drafter.propose([DraftRow("s", tokens, 3, True)], greedy)
    assert prop.caught_up == 0
    drafter.accepted("s", 3)  # the whole block passed: the last guess and the bonus are new to it
    tokens = tokens + prop.token_ids[0].tolist() + [1]
    assert drafter.unseen("s", len(tokens)) == 2
    assert drafter.propose([DraftRow("s", tokens, 2, True)], greedy).caught_up == 0
    drafter.accepted("s", 0)
    tokens = tokens + [4, 6, 8, 1, 3, 5]  # the replaced guess, then five rounds it sat out
    assert drafter.unseen("s", len(tokens)) == 6
    assert drafter.propose([DraftRow("s", tokens, 2, True)], greedy).caught_up == 6 - CATCH_UP_TOKENS


def test_model_drafter_after_a_long_catch_up_guesses_as_if_fed_from_the_start(micro_pair) -> None:
    """Rows back after rounds without the draft (their backlogs fed without logits in a pass of
    their own, their last tokens with the other rows': ModelDrafter._catch_up), two of different
    lengths batched with a row that needs one token, get the guesses and draft probabilities of a
    drafter that prefilled the same tokens (float32)."""
    from specd.services.engine.drafters import DraftRow, ModelDrafter
    from specd.services.engine.model import load_model

    model = load_model(str(micro_pair[1]), torch.float32, "cpu")
    seeds = {"s": 1, "t": 2, "u": 3}
    sampled = BatchSampling.from_params([SamplingParams(1.0, seed=x) for x in seeds.values()], "cpu")
    tokens = {"s": [3, 7, 5, 9, 2], "t": [4, 4, 6, 1], "u": [2, 8, 8]}
    back = ModelDrafter(model, 3, 64)
    for sid, ids in tokens.items():
        back.add(sid, ids)
    back.prefill(64)
    back.propose([DraftRow(sid, tokens[sid], 2, False, seed=seeds[sid]) for sid in tokens], sampled)
    for sid in tokens:
        back.accepted(sid, 0)
    tokens["s"] = tokens["s"] + [8, 1, 3, 5, 6, 2, 7, 9, 4, 1]  # ten rounds it sat out
    tokens["t"] = tokens["t"] + [5]
    tokens["u"] = tokens["u"] + [6, 6, 1, 3]  # four
    rows = [DraftRow(sid, tokens[sid], 3, False, seed=seeds[sid]) for sid in tokens]
    unseen = {sid: back.unseen(sid, len(ids)) for sid, ids in tokens.items()}
    # The paths tested: two long backlogs of different lengths, and a row with the usual catch-up.
    assert unseen["s"] > unseen["u"] > CATCH_UP_TOKENS >= unseen["t"]
    got = back.propose(rows, sampled)
    fresh = ModelDrafter(model, 3, 64)
    for sid, ids in tokens.items():
        fresh.add(sid, ids)
    fresh.prefill(64)
    want = fresh.propose(rows, sampled)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=1e-4)


def _lookup_by_definition(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) that occurred earlier; its latest occurrence's continuation."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for end in range(L - 2, n - 2, -1):  # the occurrence ends at `end` (before the suffix's end)
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_lookup_matches_its_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        min_n, max_n = sorted(int(x) for x in rng.integers(1, 6, 2))
        k = int(rng.integers(1, 6))
        got = NGramDrafter(min_n=min_n, max_n=max_n).lookup(tokens, k)
        assert got == _lookup_by_definition(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


@pytest.mark.parametrize("seed", range(10))
def test_ngram_index_answers_as_the_definition_while_the_sequence_grows(seed: int) -> None:
    """A sequence's index, brought up to date at each lookup (one to several tokens appended in
    between, as rounds emit), answers every lookup as the definition does; ``remove`` drops it."""
    rng = np.random.default_rng(100 + seed)
    min_n, max_n = sorted(int(x) for x in rng.integers(1, 5, 2))
    drafter = NGramDrafter(min_n=min_n, max_n=max_n)
    tokens = rng.integers(0, 4, int(rng.integers(1, 6))).tolist()
    for _ in range(60):
        k = int(rng.integers(1, 6))
        got = drafter.lookup(tokens, k, "s")
        assert got == _lookup_by_definition(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        tokens.extend(rng.integers(0, 4, int(rng.integers(1, 4))).tolist())
    assert "s" in drafter._indexes
    drafter.remove("s")
    assert "s" not in drafter._indexes
    # A shorter sequence under a known id is not the one indexed: the index starts again.
    drafter.lookup(tokens, 3, "t")
    short = tokens[: len(tokens) // 2]
    assert drafter.lookup(short, 3, "t") == _lookup_by_definition(short, 3, min_n, max_n)


def test_engine_drops_a_finished_sequence_s_ngram_index(tiny_pair) -> None:
    from specd.services.engine.builder import ModelSpec, build_engine
    from specd.services.engine.engine import EngineConfig, Request, SpecConfig
    from specd.services.engine.sampling import SamplingParams

    target, draft = tiny_pair
    eng = build_engine(
        ModelSpec(target=str(target), draft=str(draft), target_dtype="float32", draft_dtype="float32"),
        EngineConfig(max_batch_size=2, max_model_len=256, warm_up=False),
    )
    ids = eng.tokenizer.encode("def f(x):\n    return x\ndef f(x):\n    return")
    for method in ("ngram", "auto"):
        # Greedy and past EOS: exactly 12 tokens every run (sampled, an early EOS made it flaky).
        req = Request(
            f"r-{method}", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), SpecConfig(method, 3)
        )
        assert len(eng.generate([req])[req.request_id].token_ids) == 12
    assert eng.ngram._indexes == {}
