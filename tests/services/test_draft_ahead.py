"""Drafting ahead stays lossless (services/draft/ahead.py).

- A prepared block is the block a fresh draft makes on the same committed prefix with the same
  round seed: same guesses, same q (so the rejection rule sees exactly the q each guess was drawn
  from), for every outcome the draft prepared for, greedy and sampled.
- Through the real servicer and the target's client (in process, every prepared block finished
  before the next round): the sampling law of the output is the target's, greedy output equals the
  target alone, and a seeded request gives the same tokens with drafting ahead on and off.
- The bookkeeping: shared cache blocks go back with their last holder, nothing leaks on release, and
  the policy widens, narrows and switches itself off as the spare time allows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.services.draft.ahead import (
    GROW_AFTER_ON_TIME,
    MAX_WIDTH,
    PAUSE_ROUNDS,
    STARVED_ROUNDS,
    AheadPolicy,
    OfferTiming,
)
from specd.services.draft.server import DraftServerConfig, build_worker
from specd.services.draft.worker import BlockError, DraftWorker, OpenSeq, ProposeReq
from specd.services.engine.builder import load_tokenizer
from specd.services.engine.drafters import ALTERNATIVES, likeliest, other_than, other_than_list
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.kv_cache import PagedKVCache
from specd.services.engine.model import load_model
from specd.services.engine.sampling import SamplingParams
from specd.services.engine.sparse import to_dense
from specd.services.target import draft_client
from tests.engine.test_sampling_distribution import PROMPT, _chi2_pvalue
from tests.services.loopback import loopback_drafter
from tests.tiny_models import build_micro_pair

N_SAMPLES = 4000


def _worker(draft_dir, support: int = 8) -> DraftWorker:
    worker, _ = build_worker(DraftServerConfig(model=str(draft_dir), port=0, dtype="float32", support=support))
    return worker


def _fresh_block(draft_dir, committed: list[int], params: SamplingParams, k: int, seed: int, worker=None):
    """The block a draft that never drafted ahead makes on ``committed`` with ``seed`` (in a
    sequence of its own on ``worker``, a fresh worker if None)."""
    w = worker or _worker(draft_dir)
    seq = f"fresh{len(w.states)}"
    assert w.open("f", OpenSeq(seq, committed, params)) is BlockError.NONE
    while not w.drafter.ready(w.key("f", seq)):
        w.drafter.prefill(64)
    (b,) = w.propose("f", [ProposeReq(seq, 0, [], len(committed), k, seed)])
    return b


def _dense(b, vocab: int) -> torch.Tensor:
    return torch.stack(
        [to_dense(torch.tensor(i), torch.tensor(p), vocab) for i, p in zip(b.sparse_ids, b.sparse_probs)]
    )


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_every_prepared_block_is_the_block_a_fresh_draft_makes(tiny_pair, temperature: float) -> None:
    draft_dir = tiny_pair[1]
    params = SamplingParams(temperature, top_p=0.95 if temperature else 1.0)
    prompt = [5, 17, 99, 23, 8, 41, 77, 3]
    k, seed1, seed2 = 4, 11, 12345
    w = _worker(draft_dir)
    w.open("s", OpenSeq("x", prompt, params))
    key = w.key("s", "x")
    while not w.drafter.ready(key):
        w.drafter.prefill(64)
    (first,) = w.propose("s", [ProposeReq("x", 0, [], len(prompt), k, seed1, seed2)], ahead=True)
    assert len(first.token_ids) == k and len(first.alternatives) == k
    assert all(len(a) == ALTERNATIVES and first.token_ids[j] not in a for j, a in enumerate(first.alternatives))
    lane = w.lanes["s"]
    lane.policy.width = MAX_WIDTH
    lane.plans[key].width = MAX_WIDTH
    while w.ahead_step("s"):
        pass
    plan = lane.plans[key]
    # Main line, second bonus token, a rejection at every position with each replacement token:
    # k * ALTERNATIVES + 2 outcomes prepared, no two alike.
    assert len(plan.branches) == k * ALTERNATIVES + 2
    assert len({br.suffix for br in plan.branches}) == len(plan.branches)
    vocab = w.vocab
    other = _worker(draft_dir)
    for br in plan.branches:
        assert len(br.tokens) == k
        committed = prompt + list(br.suffix)
        fresh = _fresh_block(draft_dir, committed, params, k, seed2, other)
        assert br.tokens == fresh.token_ids, br.suffix
        if temperature:
            got = _dense(type(fresh)("x", br.tokens, br.sparse_ids, br.sparse_probs), vocab)
            torch.testing.assert_close(got, _dense(fresh, vocab), atol=1e-5, rtol=1e-4)
    # The outcome of one branch arrives: that branch answers at once, with the same block.
    br = plan.branches[1]  # the rejection at position 1
    (second,) = w.propose(
        "s",
        [ProposeReq("x", len(br.suffix) - 1, list(br.suffix), len(prompt) + len(br.suffix), k, seed2, 777)],
        ahead=True,
    )
    assert second.source == "prepared" and second.token_ids == br.tokens
    # Its siblings' slots went back; the sequence holds one slot again (plus the new plan's forks
    # only once a step runs).
    assert set(w.drafter.seqs) == {key}


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_offers_are_the_prepared_branches_and_a_taken_offer_is_served_as_offered(tiny_pair, temperature) -> None:
    """Each complete branch is offered once, with its outcome, the round's seed and its q; a round
    that took an offer gets that same block back (source "offered"); one that took an offer the
    draft no longer holds drops the sequence (OUT_OF_SYNC) with every slot freed."""
    params = SamplingParams(temperature, top_p=0.95 if temperature else 1.0)
    prompt = [5, 17, 99, 23, 8, 41, 77, 3]
    k, seed1, seed2 = 3, 11, 12345
    w = _worker(tiny_pair[1])
    w.open("s", OpenSeq("x", prompt, params))
    key = w.key("s", "x")
    while not w.drafter.ready(key):
        w.drafter.prefill(64)
    w.propose("s", [ProposeReq("x", 0, [], len(prompt), k, seed1, seed2)], ahead=True, offer=True)
    lane = w.lanes["s"]
    lane.plans[key].width = MAX_WIDTH
    offers = []
    while w.ahead_step("s"):
        offers += w.take_offers("s")
    plan = lane.plans[key]
    assert len(offers) == len(plan.branches) == k * ALTERNATIVES + 2
    by_outcome = {o.assumed: o for o in offers}
    for br in plan.branches:
        o = by_outcome[br.suffix]
        assert o.base == len(prompt) and list(o.tokens) == br.tokens
        assert o.seed == (seed2 if temperature else 0)
        assert len(o.sparse_ids) == (k if temperature else 0)
    assert w.take_offers("s") == []  # each once
    taken = plan.branches[-1]
    (served,) = w.propose(
        "s",
        [
            ProposeReq(
                "x", len(taken.suffix) - 1, list(taken.suffix), len(prompt) + len(taken.suffix), k, seed2, 7, True
            )
        ],
        ahead=True,
        offer=True,
    )
    assert served.source == "offered" and served.token_ids == list(by_outcome[taken.suffix].tokens)
    # The draft lost the plan the target took an offer from: the sequence is dropped, nothing kept.
    lane.drop_all()
    committed = len(prompt) + len(taken.suffix)
    (lost,) = w.propose("s", [ProposeReq("x", 1, [served.token_ids[0], 4], committed + 2, k, 7, 8, True)])
    assert lost.error is BlockError.OUT_OF_SYNC
    assert w.active == 0 and not w.drafter.seqs


def test_a_branch_prepared_in_part_is_finished_when_its_outcome_arrives(tiny_pair) -> None:
    draft_dir = tiny_pair[1]
    params = SamplingParams(0.0)
    prompt = [5, 17, 99, 23, 8, 41, 77, 3]
    w = _worker(draft_dir)
    w.open("s", OpenSeq("x", prompt, params))
    key = w.key("s", "x")
    while not w.drafter.ready(key):
        w.drafter.prefill(64)
    (first,) = w.propose("s", [ProposeReq("x", 0, [], len(prompt), 3, 0)], ahead=True)
    assert w.ahead_step("s") and w.ahead_step("s")  # the bonus step, then one guess of the main line
    main = w.lanes["s"].plans[key].branches[0]
    assert main.holder == key and len(main.tokens) == 1
    outcome = list(first.token_ids) + [main.suffix[-1]]
    (second,) = w.propose("s", [ProposeReq("x", 3, outcome, len(prompt) + 4, 5, 0)], ahead=False)
    assert second.source == "continued"
    assert second.token_ids == _fresh_block(draft_dir, prompt + outcome, params, 5, 0).token_ids


def test_no_matching_branch_drafts_afresh_and_the_rollback_is_right(tiny_pair) -> None:
    """An outcome nobody guessed: the prepared work is dropped and the fresh block equals a draft
    that never drafted ahead (the cache was rolled back past the positions written ahead)."""
    draft_dir = tiny_pair[1]
    params = SamplingParams(0.0)
    prompt = [5, 17, 99, 23, 8, 41, 77, 3]
    w = _worker(draft_dir)
    w.open("s", OpenSeq("x", prompt, params))
    key = w.key("s", "x")
    while not w.drafter.ready(key):
        w.drafter.prefill(64)
    (first,) = w.propose("s", [ProposeReq("x", 0, [], len(prompt), 3, 0)], ahead=True)
    while w.ahead_step("s"):
        pass
    guessed = {b.suffix for b in w.lanes["s"].plans[key].branches}
    bonus = next(t for t in range(w.vocab) if (*first.token_ids, t) not in guessed)
    outcome = list(first.token_ids) + [bonus]
    (second,) = w.propose("s", [ProposeReq("x", 3, outcome, len(prompt) + 4, 3, 0)])
    assert second.source == "fresh"
    assert second.token_ids == _fresh_block(draft_dir, prompt + outcome, params, 3, 0).token_ids
    assert set(w.drafter.seqs) == {key}


def test_releasing_frees_every_branch_and_shared_block(tiny_pair) -> None:
    w = _worker(tiny_pair[1])
    free = w.drafter.cache.free_blocks
    prompt = list(range(3, 3 + 70))  # spans several cache blocks: the forks share full ones
    for i in range(3):
        w.open("s", OpenSeq(f"x{i}", prompt, SamplingParams(0.0)))
    while not all(w.drafter.ready(w.key("s", f"x{i}")) for i in range(3)):
        w.drafter.prefill(256)
    w.propose("s", [ProposeReq(f"x{i}", 0, [], len(prompt), 4, 0) for i in range(3)], ahead=True)
    for plan in w.lanes["s"].plans.values():
        plan.width = MAX_WIDTH
    while w.ahead_step("s"):
        pass
    assert len(w.drafter.seqs) > 3
    assert w.release("s", "x0")
    # The two others, each its own slot (the main line) plus a fork per other branch: the second
    # bonus token and every rejection with each replacement.
    assert len(w.drafter.seqs) == 2 * (2 + 4 * ALTERNATIVES)
    assert w.release_stream("s") == 2
    assert not w.drafter.seqs and w.drafter.cache.free_blocks == free and w.drafter.free_slots == 64


def test_fork_shares_full_blocks_copies_the_partial_one_and_frees_with_the_last_holder() -> None:
    cache = PagedKVCache(1, 3, 8, 4, 64, 1, 2, torch.float32)
    a = cache.allocate()
    assert cache.reserve(a, 10)  # blocks for positions 0..9: three of four positions each
    cache.k[0, :] = torch.arange(cache.k.shape[1], dtype=torch.float32)[:, None, None]
    b = cache.allocate()
    assert cache.fork(a, b, 6)  # positions 0..5: block 0 shared, block 1 copied
    assert cache.blocks[b][0] == cache.blocks[a][0] and cache.blocks[b][1] != cache.blocks[a][1]
    src, dst = cache.blocks[a][1], cache.blocks[b][1]
    assert torch.equal(cache.k[0, dst * 4 : dst * 4 + 4], cache.k[0, src * 4 : src * 4 + 4])
    assert cache.free_blocks == 8 - 4
    cache.release(a)  # the shared block stays with b
    assert cache.free_blocks == 8 - 2
    cache.release(b)
    assert cache.free_blocks == 8


def test_policy_widens_narrows_and_pauses() -> None:
    p = AheadPolicy(width=2, max_width=4)
    p.observe(steps=5, complete=True, idle_seconds=0.01, step_seconds=0.001)
    assert p.planned_width() == 3
    p.observe(steps=5, complete=True, idle_seconds=0.0001, step_seconds=0.001)  # finished just in time
    assert p.planned_width() == 3
    p.observe(steps=3, complete=False, idle_seconds=0.0, step_seconds=0.001)
    assert p.planned_width() == 2
    for _ in range(STARVED_ROUNDS):  # rounds keep arriving before a useful step is done
        p.observe(steps=1, complete=False, idle_seconds=0.0, step_seconds=0.001)
        p.round()
    assert p.planned_width() == 0
    for _ in range(PAUSE_ROUNDS):
        p.round()
    assert p.planned_width() == 1


def test_offering_policy_grows_after_a_run_on_time_and_shrinks_when_an_offer_was_late() -> None:
    p = AheadPolicy(width=3, max_width=5)
    lots_idle = {"steps": 5, "complete": True, "idle_seconds": 0.01, "step_seconds": 0.001, "offering": True}
    for _ in range(GROW_AFTER_ON_TIME - 1):  # idle time alone does not widen an offering plan
        p.observe(**lots_idle, timing=OfferTiming.ON_TIME)
    assert p.planned_width() == 3
    p.observe(**lots_idle, timing=OfferTiming.NONE)  # an outcome not prepared for, in time all the same
    assert p.planned_width() == 4
    p.observe(**lots_idle, timing=OfferTiming.LATE)  # complete, idle, but the target had asked first
    assert p.planned_width() == 3
    for _ in range(GROW_AFTER_ON_TIME - 1):
        p.observe(**lots_idle, timing=OfferTiming.ON_TIME)
    p.observe(**lots_idle, timing=OfferTiming.LATE)  # a late round starts the count again
    for _ in range(GROW_AFTER_ON_TIME - 1):
        p.observe(**lots_idle, timing=OfferTiming.ON_TIME)
    assert p.planned_width() == 2


def test_a_prepared_block_the_target_asked_for_is_judged_late(tiny_pair) -> None:
    worker = _worker(tiny_pair[1])
    prompt = [5, 9, 13, 2, 7]
    assert worker.open("s", OpenSeq("a", prompt, SamplingParams(temperature=0.0))) is BlockError.NONE
    while not worker.drafter.ready(worker.key("s", "a")):
        worker.drafter.prefill(64)
    committed = list(prompt)
    (b,) = worker.propose("s", [ProposeReq("a", 0, [], len(committed), 3, 0)], ahead=True, offer=True)
    lane = worker.lanes["s"]
    while lane.pending():
        worker.ahead_step("s")
    (offer,) = [o for o in worker.take_offers("s") if o.assumed[:3] == tuple(b.token_ids)]
    width = lane.policy.width
    new = list(offer.assumed)
    committed += new
    # The outcome the main line assumed, but the round does not say the target took its offer.
    (b2,) = worker.propose("s", [ProposeReq("a", 3, new, len(committed), 3, 0)], ahead=True, offer=True)
    assert b2.source == "prepared" and b2.token_ids == list(offer.tokens)
    assert lane.policy.width == width - 1


# ----------------------------------------------------------------------- through the client


def _loopback_engine(pair, draft_ahead: bool, support: int = 4, offer_prepared: bool = True) -> Engine:
    target = load_model(str(pair[0]), torch.float32, "cpu")
    drafter, _ = loopback_drafter(
        str(pair[1]), target.info.vocab_size, draft_ahead, support, offer_prepared=offer_prepared
    )
    return Engine(target, load_tokenizer(str(pair[0])), None, EngineConfig(64, 64), drafter=drafter)


def _exact_joint4(target_dir, params: SamplingParams) -> np.ndarray:
    """P(t1..t4 | PROMPT) under the target with the requested processing, [V, V, V, V]."""
    import itertools

    from transformers import AutoModelForCausalLM

    from specd.services.engine.sampling import BatchSampling, processed_probs

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    joint = torch.ones(())
    for n in range(4):
        prefixes = list(itertools.product(range(V), repeat=n))
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1:]
        p = processed_probs(logits, BatchSampling.from_params([params] * len(prefixes)))[:, 0].double()
        joint = joint.reshape(-1, 1) * p
    return joint.reshape((V,) * 4).numpy()


@pytest.fixture(scope="module")
def close_micro_pair(tmp_path_factory) -> tuple:
    """The micro pair with a draft that resembles its target (so outcomes are often guessed)."""
    return build_micro_pair(tmp_path_factory.mktemp("close-micro"), draft_noise=0.3)


def test_sampling_law_with_drafting_ahead(close_micro_pair, monkeypatch) -> None:
    """k = 1 and four tokens: the main line (all accepted, the draft's bonus), the second bonus and
    the rejection branch all serve blocks in the later rounds, offered ahead of them (asked for at
    every batch size here, not only a target's single rows); the joints of tokens 1-3 and 2-4 are
    the target's."""
    monkeypatch.setattr(draft_client, "OFFER_MAX_ROWS", 64)
    params = SamplingParams(temperature=0.6, top_p=0.95)
    exact = _exact_joint4(close_micro_pair[0], params)
    engine = _loopback_engine(close_micro_pair, draft_ahead=True)
    reqs = [
        Request(
            f"r{i}", PROMPT, SamplingParams(0.6, 0, 0.95, seed=i, max_tokens=4, ignore_eos=True), SpecConfig("draft", 1)
        )
        for i in range(N_SAMPLES)
    ]
    try:
        res = engine.generate(reqs)
        sources = engine.model_drafter.blocks_by_source
    finally:
        engine.model_drafter.close()
    assert sources["offered"] > 150, sources  # about 300 expected: verified without a round trip
    proposed = sum(r.stats.proposed_tokens for r in res.values())
    accepted = sum(r.stats.accepted_tokens for r in res.values())
    assert 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejects"
    V = engine.target.info.vocab_size
    counts = np.zeros((V,) * 4)
    for r in res.values():
        counts[tuple(r.token_ids)] += 1
    assert _chi2_pvalue(counts.sum(axis=3), exact.sum(axis=3)) > 1e-3
    assert _chi2_pvalue(counts.sum(axis=0), exact.sum(axis=0)) > 1e-3


def test_greedy_identity_and_seeded_repeats_with_drafting_ahead(tiny_pair, monkeypatch) -> None:
    """Greedy output equals the target alone; seeded sampled output is token for token the same
    drafting in turn, drafting ahead, and drafting ahead with offered blocks (asked for at every
    batch size here; the prepared blocks are the blocks a fresh draft makes)."""
    monkeypatch.setattr(draft_client, "OFFER_MAX_ROWS", 64)
    prompts = [(5, 17, 99, 23), (1, 2, 3), (40, 40, 40, 40, 40), (11, 0, 6, 300)]
    greedy = SamplingParams(0.0, max_tokens=40, ignore_eos=True)
    outs, sources = {}, {}
    for ahead, offer in ((False, False), (True, False), (True, True)):
        engine = _loopback_engine(tiny_pair, ahead, support=16, offer_prepared=offer)
        try:
            reqs = [Request(f"g{i}", p, greedy, SpecConfig("draft", 4)) for i, p in enumerate(prompts)]
            reqs += [
                Request(
                    f"s{i}",
                    p,
                    SamplingParams(0.6, top_k=20, seed=i, max_tokens=40, ignore_eos=True),
                    SpecConfig("draft", 3),
                )
                for i, p in enumerate(prompts)
            ]
            res = engine.generate(reqs)
            sources[ahead, offer] = dict(engine.model_drafter.blocks_by_source)
        finally:
            engine.model_drafter.close()
        outs[ahead, offer] = {rid: r.token_ids for rid, r in res.items()}
    base = engine.generate([Request(f"b{i}", p, greedy, SpecConfig("none", 0)) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert outs[True, True][f"g{i}"] == base[f"b{i}"].token_ids
    assert outs[True, True] == outs[True, False] == outs[False, False]
    assert sources[True, False]["prepared"] >= 20, sources  # 44 of 99 blocks here (the schedule is deterministic)
    assert sources[True, True]["offered"] >= 20, sources
    assert sources[False, False]["prepared"] == sources[False, False]["continued"] == 0


def test_an_offer_the_draft_no_longer_holds_reopens_the_sequence_and_output_is_unchanged(tiny_pair) -> None:
    """The target verified an offered block without waiting, and the draft had lost the plan it came
    from: the late answer (OUT_OF_SYNC) makes the target open the sequence again, and the output is
    still the target's own."""
    target = load_model(str(tiny_pair[0]), torch.float32, "cpu")
    drafter, servicer = loopback_drafter(str(tiny_pair[1]), target.info.vocab_size, True, support=16)
    engine = Engine(target, load_tokenizer(str(tiny_pair[0])), None, EngineConfig(64, 64), drafter=drafter)
    worker = servicer.worker
    real_propose, real_open = worker.propose, worker.open
    lost, taken_after, opens = [], [], []

    def losing_propose(stream, reqs, ahead=False, offer=False):
        taken = any(r.offer_taken for r in reqs)
        if lost and taken:
            taken_after.append(stream)
        if not lost and taken:
            worker.lanes[stream].drop_all()  # as if cache pressure had dropped the prepared work
            out = real_propose(stream, reqs, ahead, offer)
            lost.extend(b.error for b in out)
            return out
        return real_propose(stream, reqs, ahead, offer)

    def counting_open(stream, seq):
        opens.append(seq.seq_id)
        return real_open(stream, seq)

    worker.propose, worker.open = losing_propose, counting_open
    prompt = (5, 17, 99, 23)
    greedy = SamplingParams(0.0, max_tokens=40, ignore_eos=True)
    try:
        spec = engine.generate([Request("g", prompt, greedy, SpecConfig("draft", 4))])
    finally:
        drafter.close()
    base = engine.generate([Request("b", prompt, greedy, SpecConfig("none", 0))])
    assert lost == [BlockError.OUT_OF_SYNC]
    assert opens == ["g", "g"]  # opened again after the loss
    assert taken_after, "offers were taken again after the re-open"
    assert spec["g"].token_ids == base["b"].token_ids
    assert worker.active == 0  # released at the end, nothing leaked


def test_offers_are_asked_for_only_in_rounds_of_one_row(tiny_pair) -> None:
    """Past OFFER_MAX_ROWS rows a round does not ask for offers (they rarely spare the wait there):
    two sequences together are served from prepared blocks, none offered; one alone is offered."""
    assert draft_client.OFFER_MAX_ROWS == 1
    greedy = SamplingParams(0.0, max_tokens=24, ignore_eos=True)
    sources = {}
    for n in (2, 1):
        engine = _loopback_engine(tiny_pair, draft_ahead=True)
        try:
            engine.generate([Request(f"g{i}", (5, 17, 99, 23 + i), greedy, SpecConfig("draft", 4)) for i in range(n)])
            sources[n] = dict(engine.model_drafter.blocks_by_source)
        finally:
            engine.model_drafter.close()
    assert sources[2]["offered"] == 0 and sources[2]["prepared"] > 0, sources
    assert sources[1]["offered"] > 0, sources


def test_a_sequence_served_from_a_prepared_branch_leaves_its_answer_cached_under_its_salt(tiny_pair) -> None:
    """The draft service keeps a finished sequence's committed blocks for a next turn, also when its
    last block came from a prepared branch (a forked slot the sequence adopted): found under the
    request's salt, not under another."""
    params = SamplingParams(0.0)
    prompt = [5 + i % 50 for i in range(60)]
    k = 4
    w = _worker(tiny_pair[1])
    w.open("s", OpenSeq("x", prompt, params, cache_salt="t"))
    key = w.key("s", "x")
    while not w.drafter.ready(key):
        w.drafter.prefill(64)
    w.propose("s", [ProposeReq("x", 0, [], len(prompt), k, 1, 2)], ahead=True)
    lane = w.lanes["s"]
    lane.plans[key].width = MAX_WIDTH
    while w.ahead_step("s"):
        pass
    # Every guess passes and the target's bonus token is the draft's second choice: a forked branch.
    (bonus2,) = [b for b in lane.plans[key].branches if len(b.suffix) == k + 1 and b.holder != key]
    committed = prompt + list(bonus2.suffix)
    (served,) = w.propose("s", [ProposeReq("x", k, list(bonus2.suffix), len(committed), k, 2, 3)], ahead=True)
    assert served.source == "prepared"
    assert w.release("s", "x")
    block = w.drafter.cache.block_size
    assert len(committed) > 2 * block > len(prompt) - 1  # the answer completes a block the prompt did not

    nxt = [*committed, 1, 2]

    def cached(seq_id: str, salt: str) -> tuple[int, list[int]]:
        w.open("n", OpenSeq(seq_id, nxt, params, cache_salt=salt))
        hit = w.drafter.seqs[w.key("n", seq_id)].cache_len
        while not w.drafter.ready(w.key("n", seq_id)):
            w.drafter.prefill(64)
        (b,) = w.propose("n", [ProposeReq(seq_id, 0, [], len(nxt), k, 4)])
        w.release("n", seq_id)
        return hit, b.token_ids

    fresh = _fresh_block(tiny_pair[1], nxt, params, k, 4).token_ids
    assert cached("other-tenant", "u") == (0, fresh)
    assert cached("next-turn", "t") == (2 * block, fresh)  # the cached K/V guess as computed ones do
    assert not w.drafter.seqs and w.drafter.cache.free_blocks == w.drafter.cache.num_blocks


def test_replacements_are_the_likeliest_tokens_other_than_the_guess() -> None:
    """other_than drops the guess from the likeliest tokens, in order; a sampled guess outside them
    (an unlikely draw) drops the last instead, so every row names the same number."""
    top = torch.tensor([[7, 3, 9], [7, 3, 9], [7, 3, 9], [7, 3, 9]])
    chosen = torch.tensor([7, 3, 9, 5])
    assert other_than(top, chosen).tolist() == [[3, 9], [7, 9], [7, 3], [7, 3]]
    # The host version (a drafting-ahead step), and blocks of steps at once (a fresh proposal).
    assert [other_than_list(t, c) for t, c in zip(top.tolist(), chosen.tolist())] == [[3, 9], [7, 9], [7, 3], [7, 3]]
    g = torch.Generator().manual_seed(5)
    tops = torch.stack([torch.randperm(50, generator=g)[: ALTERNATIVES + 1] for _ in range(24)]).view(4, 6, -1)
    picks = torch.where(torch.rand(4, 6, generator=g) < 0.7, tops[..., 0], torch.randint(0, 50, (4, 6), generator=g))
    blocks = other_than(tops, picks)
    assert blocks.shape == (4, 6, ALTERNATIVES)
    for b in range(4):
        assert torch.equal(blocks[b], other_than(tops[b], picks[b]))
        for j in range(6):
            assert blocks[b, j].tolist() == other_than_list(tops[b, j].tolist(), int(picks[b, j]))


def test_likeliest_is_argmax_and_topk_from_one_pass_ties_included() -> None:
    """likeliest (the draft's greedy guess and its top tokens from one top-k): argmax and topk on
    random rows, and argmax's lowest index where the two likeliest tie (topk alone may order
    those either way)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 300, generator=g)
    logits[4, [250, 17]] = 9.0  # a tie between two indices, the higher one listed first
    logits[9, [3, 299, 100]] = 7.5
    best, top = likeliest(logits)
    assert torch.equal(best, logits.argmax(-1))
    assert best[4] == 17 and best[9] == 3
    assert torch.equal(top, logits.topk(ALTERNATIVES + 1, dim=-1).indices)
