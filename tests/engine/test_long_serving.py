"""Serving at real lengths on the tiny pair: chunked prefill, the paged KV pool and its budget."""

from __future__ import annotations

import types

import pytest
import torch

from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.engine import MAX_SPECULATIVE_TOKENS, Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.kv_cache import KVCache
from specd.services.engine.model import BatchLayout, load_model
from specd.services.engine.prefill import MIN_PREFILL_CHUNK, chunk_budget, plan_chunk, sliced_budget
from specd.services.engine.sampling import SamplingParams

TEXT = (
    "def wrap(text, width=70, **kwargs):\n    w = TextWrapper(width=width, **kwargs)\n    return w.wrap(text)\n"
    "import bisect\nclass TextWrapper:\n    def __init__(self, width=70):\n        self.width = width\n"
)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _engine(tiny_pair, **cfg) -> Engine:
    target, draft = tiny_pair
    spec = ModelSpec(str(target), str(draft), "float32", "float32")
    return build_engine(spec, EngineConfig(**({"max_batch_size": 4} | cfg)))


def _ids(engine: Engine, text: str, n: int | None = None) -> tuple[int, ...]:
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    while n is not None and len(ids) < n:
        ids = ids + ids
    return tuple(ids[:n] if n else ids)


@pytest.fixture(scope="module")
def chunked(tiny_pair) -> Engine:
    # Without the prefix cache: these tests count the passes that prefill a prompt seen before.
    return _engine(tiny_pair, prefill_chunk=7, max_model_len=400, prefix_caching=False)


def test_plan_chunk_packs_prompts_within_the_budget() -> None:
    assert plan_chunk([100, 30], 64) == [64, 0]  # the head prompt fills the pass
    assert plan_chunk([10, 12, 9, 40], 40) == [10, 12, 9, 0]  # 3 rows x 12 <= 40; a 4th row would be 4 x 40
    assert plan_chunk([0, 5, 5], 64) == [0, 5, 5]  # rows with nothing left are skipped
    assert plan_chunk([3], 1) == [1]


def test_chunk_budget_follows_the_decode_round() -> None:
    assert chunk_budget(512, 0) == 512  # nothing decodes: nobody waits for the pass
    assert chunk_budget(512, 4) == MIN_PREFILL_CHUNK  # one stream at k = 3
    assert chunk_budget(512, 64) == 64  # 16 streams at k = 3
    assert chunk_budget(32, 64) == 32  # --prefill-chunk caps it


def test_sliced_budget_bounds_a_pass_by_its_measured_time() -> None:
    assert sliced_budget(512, 0.01, None) == 512  # no slice: tokens alone
    assert sliced_budget(512, None, 0.1) == MIN_PREFILL_CHUNK  # nothing measured yet: the smallest pass
    assert sliced_budget(512, 0.001, 0.1) == 100  # 0.1 s at 1 ms a token
    assert sliced_budget(512, 0.01, 0.1) == MIN_PREFILL_CHUNK  # never below the smallest pass
    assert sliced_budget(64, 1e-5, 0.1) == 64  # nor above the budget


def test_a_draft_worker_sizes_its_prefill_passes_by_their_measured_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefill_slice set, each pass between rounds takes about that long at the speed the
    worker measured on its earlier passes (a round's own pass is sized the same way): the first
    pass, unmeasured, is the smallest; a draft that prefills faster gets longer passes, and one slowed down (by a target
    busy on the same cores, say) shorter ones at the next pass. Without it, passes keep their
    token budget (512 tokens took the real pair's draft 2.9 s, past the target's round timeout)."""
    from specd.services.draft import worker as worker_module
    from specd.services.draft.worker import PREFILL_RATE_DECAY, DraftWorker

    clock = [0.0]
    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Prefilling:
        """As much of a long prompt as each pass may take, at ``seconds`` a token on the clock."""

        vocab_size = 100

        def __init__(self) -> None:
            self.seconds = 1e-3
            self.budgets: list[int] = []

        def prefill(self, budget: int) -> int:
            self.budgets.append(budget)
            clock[0] += budget * self.seconds
            return budget

    drafter = Prefilling()
    sliced = DraftWorker(drafter, 4096, 0, MAX_SPECULATIVE_TOKENS, prefill_chunk=512, prefill_slice=0.1)
    for _ in range(2):
        sliced.prefill_idle()
    drafter.seconds = 4e-3
    for _ in range(3):
        sliced.prefill_idle()
    rate = 1e-3 + (1 - PREFILL_RATE_DECAY) * (4e-3 - 1e-3)  # after the first slow pass
    assert drafter.budgets == [MIN_PREFILL_CHUNK, 100, 100, int(0.1 / rate), drafter.budgets[-1]]
    assert drafter.budgets[-1] < drafter.budgets[-2] < 100
    assert sliced.prefilled_tokens == sum(drafter.budgets)
    drafter.budgets.clear()
    whole = DraftWorker(drafter, 4096, 0, MAX_SPECULATIVE_TOKENS, prefill_chunk=512)
    whole.prefill_idle()
    assert drafter.budgets == [512]


def test_chunked_prefill_keeps_greedy_identity_with_transformers(chunked: Engine, tiny_pair) -> None:
    """Prompts prefilled 7 tokens a pass, several sharing a pass, decode exactly as transformers does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    prompts = [_ids(chunked, TEXT, n) for n in (60, 9, 23, 2)]
    passes = chunked.prefill_passes
    reqs = [
        Request(f"c{i}", p, _greedy(16), SpecConfig(m, 3))
        for i, (p, m) in enumerate(zip(prompts, ("draft", "ngram", "hybrid", "none")))
    ]
    res = chunked.generate(reqs)
    for r, p in zip(reqs, prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert res[r.request_id].token_ids == ref[0, len(p) :].tolist(), r.request_id
    assert chunked.prefill_passes - passes >= 59 // 7  # the long prompt took several passes
    assert chunked.active_slots == 0 and chunked.cache.free_blocks == chunked.cache.num_blocks


def test_running_stream_gets_tokens_every_step_while_a_long_prompt_prefills(chunked: Engine) -> None:
    a = Request("run", _ids(chunked, TEXT, 12), _greedy(380), SpecConfig("draft", 3))
    b = Request("long", _ids(chunked, TEXT, 300), _greedy(3), SpecConfig("draft", 3))
    chunked.add_request(a)
    chunked.step()
    chunked.add_request(b)
    steps_before_first = 0
    got: dict[str, list[int]] = {"run": [], "long": []}
    while not got["long"]:
        outs = {o.request_id: o for o in chunked.step()}
        got["run"] += outs["run"].token_ids  # the running stream got a round in every step
        if "long" in outs:
            got["long"] += outs["long"].token_ids
        steps_before_first += 1
    assert steps_before_first >= 299 // 7 and got["run"]
    for out in chunked.stream():
        got[out.request_id] += out.token_ids
    assert (
        got["run"]
        == chunked.generate([Request("run2", a.prompt_ids, a.params, a.spec)])["run2"].token_ids[: len(got["run"])]
    )


def test_full_pool_makes_requests_wait_and_preempts_never_fails(tiny_pair) -> None:
    """A pool of 4 blocks of 32 positions for 4 slots: requests wait for blocks, decoding sequences
    that outgrow the pool preempt the youngest, which is prefilled again; every output equals the
    request run alone."""
    probe = _engine(tiny_pair)
    per_token = probe.target.kv_bytes_per_token
    eng = _engine(tiny_pair, kv_cache_memory=4 * 32 * per_token, kv_block_size=32, prefill_chunk=16)
    assert eng.cache.num_blocks == 4 and eng.max_len == 4 * 32 - MAX_SPECULATIVE_TOKENS - 2
    reqs = [
        Request(f"w{i}", _ids(probe, TEXT[i * 7 :], 20 + 3 * i), _greedy(40), SpecConfig(("draft", "ngram")[i % 2], 3))
        for i in range(5)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    assert eng.waiting, "the pool admits only what its free blocks hold"
    got = {r.request_id: [] for r in reqs}
    for out in eng.stream():
        assert out.finish_reason in (None, "length")
        got[out.request_id] += out.token_ids
    assert eng.preemptions > 0
    alone = _engine(tiny_pair)
    for r in reqs:
        assert got[r.request_id] == alone.generate([r])[r.request_id].token_ids, r.request_id
    assert eng.cache.free_blocks == eng.cache.num_blocks and eng.model_drafter.cache.free_slots == 4


def test_max_model_len_defaults_to_the_models_context(tiny_pair) -> None:
    eng = _engine(tiny_pair)
    assert eng.max_len == eng.target.info.max_context == 512


def test_paged_cache_forward_equals_the_static_cache(tiny_pair) -> None:
    """Scattered blocks (a freed hole, sequences interleaved) give bit-identical logits."""
    model = load_model(str(tiny_pair[0]), torch.float32, "cpu")
    ids = torch.randint(3, model.info.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    static = model.new_cache(2, 80)
    paged = model.new_paged_cache(3, 24, 8, 80)
    hole = paged.allocate()
    a, b = paged.allocate(), paged.allocate()
    paged.reserve(hole, 16)
    paged.reserve(a, 20)
    paged.reserve(b, 30)
    paged.release(hole)  # a owns blocks 2-4 and b 5-8; a grows into 0-1, then past b
    assert paged.reserve(a, 78) and paged.reserve(b, 78)
    assert paged.blocks[a][:5] == [2, 3, 4, 0, 1]
    want = [model.forward(ids[:, :60], static, BatchLayout([0, 1], [0, 0], 60))]
    got = [model.forward(ids[:, :60], paged, paged.layout([a, b], [0, 0], 60))]
    want.append(model.forward(ids[:, 60:], static, BatchLayout([0, 1], [60, 60], 10)))
    got.append(model.forward(ids[:, 60:], paged, paged.layout([a, b], [60, 60], 10)))
    want.append(model.forward(ids[:1, 60:], static, BatchLayout([0], [60], 10)))
    got.append(model.forward(ids[:1, 60:], paged, paged.layout([a], [60], 10)))
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert isinstance(static, KVCache)


def test_draft_worker_prefills_in_chunks_without_errors(tiny_pair) -> None:
    """The draft service opens a long sequence and answers empty blocks (no error) until its
    prompt is prefilled, a chunk a round; then it guesses as one-shot prefill would."""
    from specd.services.draft.worker import BlockError, DraftWorker, OpenSeq, ProposeReq
    from specd.services.engine.drafters import ModelDrafter

    model = load_model(str(tiny_pair[1]), torch.float32, "cpu")
    tokens = list(range(5, 125))
    greedy = SamplingParams(temperature=0.0)

    def run(chunk: int) -> tuple[int, list[int]]:
        worker = DraftWorker(ModelDrafter(model, 2, 200), 180, 0, MAX_SPECULATIVE_TOKENS, prefill_chunk=chunk)
        assert worker.open("s", OpenSeq("x", tokens, greedy)) is BlockError.NONE
        rounds = 0
        while True:
            rounds += 1
            (block,) = worker.propose("s", [ProposeReq("x", 0, [], len(tokens), 3, 0)])
            assert block.error is BlockError.NONE
            if block.token_ids:
                return rounds, block.token_ids

    slow_rounds, slow = run(16)
    fast_rounds, fast = run(1000)
    assert (
        slow == fast and fast_rounds == 1 and slow_rounds == -(-119 // 16)
    )  # the last chunk and the guesses share a round
