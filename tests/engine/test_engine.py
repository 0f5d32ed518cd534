"""The batched engine on the tiny pair: greedy identity, batching, stops, aborts, cache hygiene."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.controller import MODEL, SpeculationController
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.model import VocabMismatchError
from specd.services.engine.sampling import SamplingParams

PROMPTS = [
    "def wrap(text, width=70, **kwargs):\n",
    "import bisect\n",
    'class TextWrapper:\n    """Object for wrapping/filling text.',
    "x",
    "def insort_right(a, x, lo=0, hi=None, *, key=None):\n    if key is None:\n        lo = bisect_right(a, x, lo, hi)",
    "    return ''.join(lines)\n",
]


@pytest.fixture(scope="module")
def engine(tiny_pair) -> Engine:
    target, draft = tiny_pair
    spec = ModelSpec(target=str(target), draft=str(draft), target_dtype="float32", draft_dtype="float32")
    return build_engine(spec, EngineConfig(max_batch_size=8, max_model_len=256))


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()


def _ids(engine: Engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _hf_greedy(hf, ids: tuple[int, ...], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("method", ["draft", "ngram", "hybrid", "auto"])
def test_greedy_identity_with_transformers_for_k_1_to_8(engine: Engine, hf_target, method: str) -> None:
    refs = {p: _hf_greedy(hf_target, _ids(engine, p), 24) for p in PROMPTS}
    # "auto" picks k (up to num_tokens) and the drafter per row and round itself.
    for k in (2, 8) if method == "auto" else range(1, 9):
        reqs = [
            Request(f"{method}{k}-{i}", _ids(engine, p), _greedy(24), SpecConfig(method, k))
            for i, p in enumerate(PROMPTS)
        ]
        res = engine.generate(reqs)  # all six prompts batched together
        for i, p in enumerate(PROMPTS):
            assert res[f"{method}{k}-{i}"].token_ids == refs[p], (method, k, p)
    assert engine.active_slots == 0


def test_speculation_accepts_guesses_on_tiny_pair(engine: Engine) -> None:
    """Sanity: the tiny draft is a noisy copy of the target, so most guesses pass."""
    res = engine.generate([Request("acc", _ids(engine, PROMPTS[0]), _greedy(40), SpecConfig("draft", 4))])["acc"]
    s = res.stats
    assert s.proposed_tokens > 0 and s.acceptance_rate > 0.5
    assert s.target_forward_passes < 40  # fewer verifications than tokens


def test_batch_equals_each_alone_greedy_and_seeded(engine: Engine) -> None:
    """Different prompt lengths, methods, k and accept counts in one batch = each run alone."""
    mixes = [("draft", 3), ("ngram", 5), ("none", 0), ("hybrid", 8), ("ngram", 2), ("draft", 1)]
    params = [
        _greedy(30),
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=8, ignore_eos=True),
    ]
    reqs = [Request(f"b{i}", _ids(engine, p), params[i % 3], SpecConfig(*mixes[i])) for i, p in enumerate(PROMPTS)]
    together = engine.generate(reqs)
    accepted = {r.stats.accepted_tokens for r in together.values()}
    assert len(accepted) > 2, "the batch should mix different accept counts"
    for r in reqs:
        alone = engine.generate([r])[r.request_id]
        assert alone.token_ids == together[r.request_id].token_ids, r


def test_auto_batch_equals_each_alone_greedy_and_seeded(engine: Engine) -> None:
    """Method "auto": rows batched with each other and with fixed methods give what each gives alone: greedy
    ones because any k yields the target's greedy tokens, seeded sampled ones because they are
    planned from their own history only. Unseeded sampled auto rows (planned from timings) finish."""
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=8, ignore_eos=True),
    ]
    specs = [("auto", 6), ("auto", 6), ("auto", 3), ("draft", 2), ("auto", 8), ("ngram", 4)]
    params = [_greedy(30), seeded[0], _greedy(30), seeded[1], seeded[1], _greedy(30)]
    reqs = [Request(f"au{i}", _ids(engine, p), params[i], SpecConfig(*specs[i])) for i, p in enumerate(PROMPTS)]
    unseeded = Request("au-free", _ids(engine, PROMPTS[0]), SamplingParams(0.8, max_tokens=30, ignore_eos=True))
    together = engine.generate([*reqs, unseeded])
    auto_stats = [together[r.request_id].stats for r in reqs if r.spec.method == "auto"]
    assert sum(s.proposed_tokens for s in auto_stats) > 0 and any(s.mean_block_size > 0 for s in auto_stats)
    assert len(together["au-free"].token_ids) == 30 and together["au-free"].finish_reason == "length"
    for r in reqs:
        alone = engine.generate([r])[r.request_id]
        assert alone.token_ids == together[r.request_id].token_ids, r
    assert engine.active_slots == 0 and engine.model_drafter.active == 0


def test_a_resting_controller_skips_plans_except_with_a_seeded_row(engine: Engine) -> None:
    """While the controller rests from planning (SpeculationController.dormant), a batch of greedy
    and unseeded "auto" rows runs plain rounds, and greedy output stays the target's; a batch that
    holds a seeded sampled "auto" row plans every round, so that row gives what it gives alone."""
    greedy = [
        Request(f"rest-g{i}", _ids(engine, p), _greedy(12), SpecConfig("auto", 4)) for i, p in enumerate(PROMPTS[:2])
    ]
    seeded = Request(
        "rest-s",
        _ids(engine, PROMPTS[1]),
        SamplingParams(0.9, max_tokens=20, seed=5, ignore_eos=True),
        SpecConfig("auto", 4),
    )
    free = Request(
        "rest-f", _ids(engine, PROMPTS[0]), SamplingParams(0.8, max_tokens=20, ignore_eos=True), SpecConfig("auto", 4)
    )
    try:
        engine.controller._dormant = 1000  # as after plans that chose speculation off everywhere
        rested = engine.generate(greedy)
        assert 1000 - 12 <= engine.controller._dormant < 1000  # consulted once a round, 12 tokens
        assert all(rested[r.request_id].stats.proposed_tokens == 0 for r in greedy)
        engine.controller._dormant = 0
        for r in greedy:
            assert rested[r.request_id].token_ids == engine.generate([r])[r.request_id].token_ids
        consulted: list[bool] = []
        engine.controller.dormant = lambda: consulted.append(True) or True  # would rest if asked
        together = engine.generate([seeded, free])
        del engine.controller.dormant
        assert not consulted
        assert together["rest-s"].stats.proposed_tokens > 0
        assert together["rest-s"].token_ids == engine.generate([seeded])["rest-s"].token_ids
    finally:
        engine.controller.__dict__.pop("dormant", None)
        engine.controller._dormant = 0  # the engine is shared with the other tests
    assert engine.active_slots == 0


def test_measured_seeded_plans_plan_a_seeded_row_like_any_other(tiny_pair) -> None:
    """EngineConfig(pin_seeded=False) (`--seeded-plans measured`): a seeded sampled "auto" row is
    planned from timings like any other, so a resting controller runs it plain with its batch (it
    can back off under load; its text may then differ from alone), and alone it takes the batch of
    one's path. The default keeps it out of rests (test above)."""
    target, draft = tiny_pair
    spec = ModelSpec(target=str(target), draft=str(draft), target_dtype="float32", draft_dtype="float32")
    engine = build_engine(spec, EngineConfig(max_batch_size=8, max_model_len=256, pin_seeded=False))
    params = SamplingParams(0.9, max_tokens=20, seed=5, ignore_eos=True)
    try:
        assert engine.config.pin_seeded is False
        seeded = Request("m-s", _ids(engine, PROMPTS[1]), params, SpecConfig("auto", 4))
        free = Request(
            "m-f", _ids(engine, PROMPTS[0]), SamplingParams(0.8, max_tokens=20, ignore_eos=True), SpecConfig("auto", 4)
        )
        engine.controller._dormant = 1000
        rested = engine.generate([seeded, free])
        assert 1000 - 20 <= engine.controller._dormant < 1000  # consulted with a seeded row in the batch
        assert rested["m-s"].stats.proposed_tokens == 0 and len(rested["m-s"].token_ids) == 20
        engine.controller._dormant = 0
        planned_alone: list[int] = []
        plan_one = engine.controller.plan_one
        engine.controller.plan_one = lambda *a, **kw: planned_alone.append(1) or plan_one(*a, **kw)
        alone = engine.generate([Request("m-a", _ids(engine, PROMPTS[1]), params, SpecConfig("auto", 4))])
        assert planned_alone and len(alone["m-a"].token_ids) == 20
    finally:
        engine.close()


def test_requests_join_between_rounds(engine: Engine) -> None:
    """Continuous batching: a request added mid-flight gives the same tokens as alone."""
    a = Request("join-a", _ids(engine, PROMPTS[0]), _greedy(30), SpecConfig("draft", 4))
    b = Request("join-b", _ids(engine, PROMPTS[2]), _greedy(20), SpecConfig("ngram", 3))
    engine.add_request(a)
    got: dict[str, list[int]] = {"join-a": [], "join-b": []}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
        steps += 1
        if steps == 3:
            engine.add_request(b)
    assert got["join-a"] == engine.generate([a])["join-a"].token_ids
    assert got["join-b"] == engine.generate([b])["join-b"].token_ids


def test_seeded_sampling_repeats_exactly(engine: Engine) -> None:
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, seed=1234, ignore_eos=True)
    r1 = engine.generate([Request("s1", _ids(engine, PROMPTS[1]), p, SpecConfig("draft", 4))])["s1"]
    r2 = engine.generate([Request("s1", _ids(engine, PROMPTS[1]), p, SpecConfig("draft", 4))])["s1"]
    assert r1.token_ids == r2.token_ids and len(r1.token_ids) == 25


def test_max_tokens_and_length_finish(engine: Engine) -> None:
    for k in (0, 3, 8):
        res = engine.generate([Request("len", _ids(engine, PROMPTS[0]), _greedy(5), SpecConfig("draft", k))])["len"]
        assert len(res.token_ids) == 5 and res.finish_reason == "length"


def test_context_limit_finishes_with_length(tiny_pair) -> None:
    target, draft = tiny_pair
    eng = build_engine(
        ModelSpec(str(target), str(draft), "float32", "float32"), EngineConfig(max_batch_size=2, max_model_len=40)
    )
    ids = _ids(eng, PROMPTS[4])[:30]
    res = eng.generate([Request("ctx", ids, _greedy(100), SpecConfig("draft", 8))])["ctx"]
    assert res.finish_reason == "length" and len(ids) + len(res.token_ids) == 40
    with pytest.raises(ValueError, match="context"):
        eng.add_request(Request("long", tuple(range(3, 43)), _greedy(5)))


def test_eos_stops_and_is_reported(engine: Engine, hf_target) -> None:
    """Find where greedy output would hit an EOS id, make that id the model's EOS, and stop there."""
    ids = _ids(engine, PROMPTS[0])
    free = _hf_greedy(hf_target, ids, 30)
    stop_tok = free[9]
    first = free.index(stop_tok)
    eng = Engine(engine.target, engine.tokenizer, None, EngineConfig(max_batch_size=2, max_model_len=256))
    eng.eos = frozenset({stop_tok})
    res = eng.generate([Request("eos", ids, SamplingParams(temperature=0, max_tokens=30), SpecConfig("ngram", 4))])[
        "eos"
    ]
    assert res.finish_reason == "stop"
    assert res.token_ids == free[: first + 1]


def test_stop_string_cuts_text_and_finishes(engine: Engine) -> None:
    ids = _ids(engine, PROMPTS[0])
    free = engine.generate([Request("free", ids, _greedy(30), SpecConfig("draft", 4))])["free"]
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.find(stop)
    p = SamplingParams(temperature=0, max_tokens=30, stop=(stop,), ignore_eos=True)
    res = engine.generate([Request("stop", ids, p, SpecConfig("draft", 4))])["stop"]
    assert res.finish_reason == "stop"
    assert res.text == text[:cut]
    assert res.token_ids == free.token_ids[: len(res.token_ids)]
    assert engine.active_slots == 0


def test_abort_frees_both_caches(engine: Engine) -> None:
    engine.add_request(Request("ab", _ids(engine, PROMPTS[0]), _greedy(100), SpecConfig("draft", 4)))
    engine.step()
    drafter = engine.model_drafter
    assert engine.active_slots == 1 and drafter.active == 1
    engine.abort("ab")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("ab", "abort")]
    assert engine.active_slots == 0 and drafter.active == 0 and not engine.has_work()


def test_streaming_yields_each_round(engine: Engine) -> None:
    engine.add_request(Request("st", _ids(engine, PROMPTS[0]), _greedy(20), SpecConfig("draft", 4)))
    outs = list(engine.stream())
    assert len(outs) > 1 and all(1 <= len(o.token_ids) <= 5 for o in outs)
    assert sum(len(o.token_ids) for o in outs) == 20 and outs[-1].finished


def test_bad_requests_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Request("e", ()))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(Request("v", (10**6,)))
    with pytest.raises(ValueError):
        SpecConfig("medusa", 4)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert not engine.has_work()


def test_draft_with_other_vocabulary_is_refused(tiny_pair, micro_pair) -> None:
    with pytest.raises(VocabMismatchError, match="vocabulary"):
        build_engine(ModelSpec(str(tiny_pair[0]), str(micro_pair[1]), "float32", "float32"))


def test_auto_counts_a_draft_that_gives_a_row_nothing_as_a_failed_guess(engine: Engine, monkeypatch) -> None:
    """A draft that answers a row with no guesses (a remote one still prefilling it, or out of
    time) is recorded as a first guess that failed, so what method auto expects of the model for
    that row counts how often the model gives it anything (test_controller: a row whose guesses
    fail gets k = 0). Uncounted, the starved row kept the engine-wide rate and was planned as if
    its guesses would come. Its batch mate's rounds are recorded as they went; both stay exact."""
    drafter, ctl = engine.model_drafter, SpeculationController()  # no history from other tests
    propose, plan, observe = drafter.propose, engine._plan, ctl.observe_rows
    names: dict[int, str] = {}
    records: dict[str, list[tuple[int, int, int]]] = {"a": [], "b": []}

    def starve_a(rows, sampling):
        prop = propose(rows, sampling)
        token_ids = prop.token_ids.clone()
        for i, row in enumerate(rows):
            if row.seq_id == "a":
                token_ids[i] = -1
        return dataclasses.replace(prop, token_ids=token_ids)

    def keep_names(seqs, ks, routes):
        names.update((id(s.acceptance), s.req.request_id) for s in seqs)
        return plan(seqs, ks, routes)

    def keep_records(rows):
        for seq, _greedy_row, drafter_code, proposed, accepted in rows:
            records[names[id(seq)]].append((drafter_code, proposed, accepted))
        observe(rows)

    monkeypatch.setattr(drafter, "propose", starve_a)
    monkeypatch.setattr(engine, "_plan", keep_names)
    monkeypatch.setattr(ctl, "observe_rows", keep_records)
    monkeypatch.setattr(engine, "controller", ctl)
    ids = _ids(engine, PROMPTS[0])
    reqs = [Request(name, ids, _greedy(40), SpecConfig("auto", 4)) for name in ("a", "b")]
    out = engine.generate(reqs)
    base = engine.generate([Request("base", ids, _greedy(40), SpecConfig("none", 0))])["base"].token_ids
    assert out["a"].token_ids == base and out["b"].token_ids == base
    asked_a = [r for r in records["a"] if r[0] == MODEL]
    assert asked_a and all(r[1:] == (1, 0) for r in asked_a), records["a"]
    # The mate's model rounds, where it had any, record the guesses that came.
    assert all(r[1] >= 1 for r in records["b"] if r[0] == MODEL), records["b"]


def test_warm_up_runs_each_model_and_leaves_both_caches_empty(tiny_pair) -> None:
    from specd.services.engine.model import load_model
    from specd.services.engine.warmup import warm_up

    target, draft = tiny_pair
    spec = ModelSpec(target=str(target), draft=str(draft), target_dtype="float32", draft_dtype="float32")
    cold = build_engine(spec, EngineConfig(max_batch_size=2, max_model_len=64, warm_up=False))
    warm = build_engine(spec, EngineConfig(max_batch_size=2, max_model_len=64))
    for e in (cold, warm):
        assert e.cache.free_slots == 2 and e.cache.free_blocks == e.cache.num_blocks
        assert e.model_drafter.cache.free_slots == 2
        assert e.model_drafter.cache.free_blocks == e.model_drafter.cache.num_blocks
    # Warmed up or not, the same greedy text.
    outs = [
        e.generate([Request("w", _ids(e, PROMPTS[0]), _greedy(24), SpecConfig("draft", 3))])["w"].token_ids
        for e in (cold, warm)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 24

    model = load_model(str(target), torch.float32, "cpu")
    calls = []
    forward = model.forward
    model.forward = lambda ids, *a, **kw: calls.append(tuple(ids.shape)) or forward(ids, *a, **kw)
    cache = model.new_paged_cache(1, 8, 16, 64)
    assert warm_up(model, cache, (1, 4))
    assert calls == [(1, 16), (1, 1), (1, 4)]  # a prefill, then a decode pass per width
    assert cache.free_slots == 1 and cache.free_blocks == 8
    cache.allocate()  # no slot left: nothing runs, nothing fails
    assert not warm_up(model, cache, (1, 4)) and len(calls) == 3


def test_auto_prices_and_times_a_row_s_catch_up_on_the_draft_model(engine: Engine, monkeypatch) -> None:
    """A row kept off the draft model for some rounds comes back with the tokens it missed to feed:
    the plan gets them (RowPlan.catch_up: past the usual CATCH_UP_TOKENS) and the round's timing
    reports them (observe_costs' caught_up), so the cost model prices them apart from the guesses.
    The output is still the target's."""
    from specd.services.common.constants import CATCH_UP_TOKENS
    from specd.services.engine.controller import solo_choice

    off_rounds = 6

    class OffThenOn(SpeculationController):
        """k = 0 for the first rounds, then the draft model at k = 2; the rest of the controller real."""

        def __init__(self) -> None:
            super().__init__()
            self.catch_ups: list[int] = []
            self.caught_up: list[int] = []

        def plan_one(self, seq, greedy, cap, model_ok, context, match_len, catch_up=0):
            super().plan_one(seq, greedy, cap, model_ok, context, match_len, catch_up)
            self.catch_ups.append(catch_up)
            return solo_choice(0 if len(self.catch_ups) <= off_rounds else min(2, cap), MODEL)

        def observe_costs(self, *args, **kwargs):
            super().observe_costs(*args, **kwargs)
            self.caught_up.append(args[7])

    ctl = OffThenOn()
    monkeypatch.setattr(engine, "controller", ctl)
    ids = _ids(engine, PROMPTS[0])
    out = engine.generate([Request("a", ids, _greedy(20), SpecConfig("auto", 4))])["a"]
    base = engine.generate([Request("base", ids, _greedy(20), SpecConfig("none", 0))])["base"].token_ids
    assert out.token_ids == base
    # Off: one more unseen token a round (the prompt's last is the usual one); the first round back
    # pays for them, and the rounds after it catch up nothing.
    assert ctl.catch_ups[: off_rounds + 1] == [max(0, n - CATCH_UP_TOKENS + 1) for n in range(off_rounds + 1)]
    assert ctl.caught_up[off_rounds] == ctl.catch_ups[off_rounds] > 0
    assert ctl.caught_up[:off_rounds] == [0] * off_rounds and set(ctl.caught_up[off_rounds + 1 :]) == {0}
