"""The engine with a *remote* draft service (the real draft servicer, over gRPC) is still lossless.

Same exact-law test as tests/engine/test_sampling_distribution.py, but every guess and its q now
cross gRPC, sparse, from a draft that samples from its q truncated to 4 of the 12 tokens: the
protocol, the per-round seeds, the rollback bookkeeping and the sparse q are all on the path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from specd.services.engine.builder import load_tokenizer
from specd.services.engine.controller import MODEL
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.model import load_model
from specd.services.engine.sampling import SamplingParams
from specd.services.target.draft_client import DraftClientConfig, RemoteDrafter
from tests.e2e.processes import free_port, spawn, stop_process, wait_grpc
from tests.engine.test_sampling_distribution import N_SAMPLES, PROMPT, _chi2_pvalue, _exact_joint
from tests.inprocess import GrpcThread, InProcessDraft, start_draft


@pytest.fixture(scope="module")
def micro_draft(micro_pair) -> Iterator[InProcessDraft]:
    """The draft service (its servicer, over gRPC on loopback) on the micro draft, sending q
    truncated to 4 of the 12 tokens."""
    grpc_thread = GrpcThread()
    try:
        yield start_draft(grpc_thread, micro_pair[1], support=4, max_sequences=64)
    finally:
        grpc_thread.close()


@pytest.fixture(scope="module")
def micro_draft_service(micro_draft: InProcessDraft) -> str:
    return micro_draft.address


@pytest.fixture(scope="module")
def micro_draft_process(micro_pair, tmp_path_factory) -> Iterator[str]:
    """A real ``specd draft`` process on the micro draft: drafting ahead needs the draft's own
    thread of execution (in this process it would wait on the target's Python for each step)."""
    port = free_port()
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    cmd = ["draft", "--model", str(micro_pair[1]), "--host", "127.0.0.1", "--port", str(port)]
    p = spawn([*cmd, "--dtype", "float32", "--proposal-support", "4", "--max-sequences", "64"], log)
    try:
        wait_grpc(port, p, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(p)


def _drafter(address: str, vocab_size: int, wait: bool = True, draft_ahead: bool = False) -> RemoteDrafter:
    """A RemoteDrafter of the draft at ``address``; ``wait``: until its stream is up (a target
    serves long after that)."""
    drafter = RemoteDrafter(DraftClientConfig((address,), round_timeout=30.0, draft_ahead=draft_ahead), vocab_size)
    deadline = time.monotonic() + 30
    while wait and not drafter.endpoints[0].up:
        assert time.monotonic() < deadline, "the draft stream never came up"
        time.sleep(0.02)
    return drafter


def _remote_engine(micro_pair, address: str, wait: bool = True, draft_ahead: bool = False) -> Engine:
    import torch

    target = load_model(str(micro_pair[0]), torch.float32, "cpu")
    drafter = _drafter(address, target.info.vocab_size, wait, draft_ahead)
    return Engine(target, load_tokenizer(str(micro_pair[0])), None, EngineConfig(64, 64), drafter=drafter)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)], ids=["T1.0", "T0.7-top_p0.9"])
def test_remote_sparse_speculation_matches_target(micro_pair, micro_draft_service, temperature, top_p) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p)
    exact = _exact_joint(micro_pair[0], params)
    engine = _remote_engine(micro_pair, micro_draft_service)
    try:
        V = engine.target.info.vocab_size
        reqs = [
            Request(
                f"r{i}",
                PROMPT,
                SamplingParams(temperature, 0, top_p, seed=i, max_tokens=3, ignore_eos=True),
                SpecConfig("draft", 3),
            )
            for i in range(N_SAMPLES)
        ]
        res = engine.generate(reqs)
    finally:
        engine.close()
    proposed = sum(r.stats.proposed_tokens for r in res.values())
    accepted = sum(r.stats.accepted_tokens for r in res.values())
    assert proposed > 0 and 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejects"
    counts = np.zeros((V, V, V))
    for r in res.values():
        counts[tuple(r.token_ids)] += 1
    assert _chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("way", ["in-turn", "ahead", "ahead-competing"])
def test_remote_greedy_equals_target_alone(micro_pair, micro_draft_process, way: str) -> None:
    """Greedy output equals the target alone, drafting in turn and drafting ahead (the draft
    process steps its prepared blocks between rounds, over the real stream). Drafting ahead is
    asked of a draft only when it does not compete with the target for its cores: with this
    target placed on another machine it is used, with it sharing the draft's cores it is not."""
    import dataclasses

    from specd.services.common.affinity import competes

    engine = _remote_engine(micro_pair, micro_draft_process, draft_ahead=way != "in-turn")
    drafter = engine.model_drafter
    ep = drafter.endpoints[0]
    ep.ask_info()
    ep.info.result(timeout=30)
    draft_at = ep.placement
    assert draft_at is not None and draft_at.host_id == drafter.placement.host_id  # one machine here
    if way == "ahead":
        drafter.placement = dataclasses.replace(drafter.placement, host_id="another machine")
    elif way == "ahead-competing":  # as many threads as the draft's cores, on those cores
        drafter.placement = dataclasses.replace(draft_at, threads=len(draft_at.cores))
        assert competes(drafter.placement, draft_at)
    try:
        prompts = [(3, 7, 5, 9), (1, 2, 3), (4, 4, 4, 4, 4), (11, 0, 6)]
        spec = engine.generate(
            [
                Request(f"s{i}", p, SamplingParams(0.0, max_tokens=30, ignore_eos=True), SpecConfig("draft", 4))
                for i, p in enumerate(prompts)
            ]
        )
        base = engine.generate(
            [
                Request(f"b{i}", p, SamplingParams(0.0, max_tokens=30, ignore_eos=True), SpecConfig("none", 0))
                for i, p in enumerate(prompts)
            ]
        )
        sources = drafter.blocks_by_source
    finally:
        engine.close()
    assert sum(r.stats.proposed_tokens for r in spec.values()) > 0
    for i in range(len(prompts)):
        assert spec[f"s{i}"].token_ids == base[f"b{i}"].token_ids
    served_ahead = sources["prepared"] + sources["continued"] + sources["offered"]
    assert served_ahead > 0 if way == "ahead" else served_ahead == 0, sources


def test_draft_asked_again_with_nothing_new_answers_and_keeps_the_stream(micro_draft_service) -> None:
    """A row with 0 accepted and no new token (the same question again) gets the same guesses,
    and the stream stays usable: it once raised in the draft and ended the stream."""
    import queue

    import grpc

    from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    tokens = [3, 7, 5, 9, 2]
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)

    def row(**kw) -> draft_pb2.DraftRound:
        return draft_pb2.DraftRound(round_id=kw.pop("round_id"), rows=[draft_pb2.ProposeRow(sequence_id="s", **kw)])

    opening = row(round_id=1, committed_length=len(tokens), num_tokens=3)
    opening.open.add(sequence_id="s", token_ids=tokens, sampling=greedy)
    requests: queue.Queue = queue.Queue()
    with grpc.insecure_channel(micro_draft_service) as channel:
        call = draft_pb2_grpc.DraftServiceStub(channel).Draft(iter(requests.get, None), timeout=30)
        replies = []
        for r in (opening, row(round_id=2, committed_length=len(tokens), num_tokens=3)):
            requests.put(r)
            replies.append(next(call))
        # Then a normal round: the first guess accepted, followed by the target's own token.
        g1 = replies[1].blocks[0].token_ids[0]
        requests.put(
            row(round_id=3, num_accepted=1, new_token_ids=[g1, 4], committed_length=len(tokens) + 2, num_tokens=2)
        )
        replies.append(next(call))
        requests.put(None)
        call.cancel()
    first, again, after = (rep.blocks[0] for rep in replies)
    assert not first.error and not again.error and not after.error
    assert len(first.token_ids) == 3 and list(again.token_ids) == list(first.token_ids)
    assert len(after.token_ids) == 2


def test_sampled_rows_decode_without_guesses_when_no_draft_answers(micro_pair) -> None:
    """With every draft service unreachable, sampled requests asking for the draft still complete,
    exactly as without speculation (same seed, same tokens). The engine once indexed the missing q
    and failed the whole batch."""
    engine = _remote_engine(micro_pair, f"127.0.0.1:{free_port()}", wait=False)  # nothing listens there
    try:
        prompts = [(3, 7, 5, 9), (1, 2, 3)]

        def requests(method: str, k: int) -> list[Request]:
            return [
                Request(
                    f"{method}{i}",
                    p,
                    SamplingParams(0.9, seed=10 + i, max_tokens=12, ignore_eos=True),
                    SpecConfig(method, k),
                )
                for i, p in enumerate(prompts)
            ]

        spec = engine.generate(requests("draft", 3))
        base = engine.generate(requests("none", 0))
    finally:
        engine.close()
    assert sum(r.stats.proposed_tokens for r in spec.values()) == 0  # the draft really never answered
    for i in range(len(prompts)):
        assert len(spec[f"draft{i}"].token_ids) == 12
        assert spec[f"draft{i}"].token_ids == base[f"none{i}"].token_ids


def test_remote_drafter_with_per_sequence_k_that_skips_rounds(micro_pair, micro_draft_service) -> None:
    """Method "auto" over a remote draft: each sequence's k changes every round and is often 0 (the
    sequence is then not sent at all), so the draft must catch up with several rounds of tokens at
    once. Greedy output still equals the target alone, and every guess asked for arrives (a desync
    would make the draft drop the sequence and the round go without guesses)."""
    import numpy as np

    from specd.services.engine.controller import MODEL, Choice, SpeculationController

    class Alternating(SpeculationController):
        """0, 1, 2, 3, 0, ... per row, shifted by row: k forced, the rest of the controller real."""

        rounds = 0

        def plan(self, rows, kmax):
            super().plan(rows, kmax)
            self.rounds += 1
            ks = np.array([min((self.rounds + i) % 4, r.cap) if r.model_ok else 0 for i, r in enumerate(rows)])
            return Choice(ks, np.where(ks > 0, MODEL, -1), int(ks.max()), int(ks.max()), 0.0, 1.0)

    engine = _remote_engine(micro_pair, micro_draft_service)
    engine.controller = Alternating()
    prompts = [(3, 7, 5, 9), (1, 2, 3), (4, 4, 4, 4, 4), (11, 0, 6)]
    greedy = SamplingParams(0.0, max_tokens=30, ignore_eos=True)
    sampled = SamplingParams(0.9, max_tokens=30, seed=5, ignore_eos=True)
    try:
        spec = engine.generate(
            [Request(f"a{i}", p, greedy, SpecConfig("auto", 3)) for i, p in enumerate(prompts)]
            + [Request("sampled", prompts[0], sampled, SpecConfig("auto", 3))]
        )
        base = engine.generate([Request(f"b{i}", p, greedy, SpecConfig("none", 0)) for i, p in enumerate(prompts)])
    finally:
        engine.close()
    for i in range(len(prompts)):
        assert spec[f"a{i}"].token_ids == base[f"b{i}"].token_ids
    for r in spec.values():
        assert len(r.token_ids) == 30
        assert r.stats.proposed_tokens == r.stats.block_tokens > 0  # every guess asked for came back
        assert r.stats.target_forward_passes > 30 / 4  # rounds with k = 0 did happen


@pytest.mark.parametrize("opened", ["when admitted, prefilled between rounds", "when admitted", "at the first ask"])
def test_rounds_that_make_the_draft_prefill_do_not_price_its_guesses(
    micro_pair, micro_draft: InProcessDraft, opened: str, monkeypatch
) -> None:
    """A sequence is opened on the draft service when the target admits it, and the draft prefills
    it between rounds: its first ask is then a timing of guesses like any other. Where the draft
    had no time between rounds, or the sequence is opened at its first ask (its draft was not up at
    admission, say), the draft prefills inside that round, says so (DraftBlocks.prefilled_tokens),
    and the round is no timing for method auto's cost model (Proposal.timed says why); the rounds
    after it are, and catch up nothing."""
    worker = micro_draft.servicer.worker
    engine = _remote_engine(micro_pair, micro_draft.address)
    drafter = engine.model_drafter
    if opened == "at the first ask":
        monkeypatch.setattr(drafter, "_open_admitted", lambda: drafter._unopened.clear())
    elif opened == "when admitted":
        monkeypatch.setattr(worker, "prefill_idle", lambda: False)  # the draft never idles
    else:
        open_admitted = drafter._open_admitted

        def open_and_wait() -> None:  # the target asks only once the draft has prefilled
            open_admitted()
            deadline = time.monotonic() + 30
            while not (worker.states and all(worker.drafter.ready(k) for k in worker.states)):
                assert time.monotonic() < deadline, "the draft never prefilled the opened sequence"
                time.sleep(0.01)

        monkeypatch.setattr(drafter, "_open_admitted", open_and_wait)
    opens: list[int] = []  # sequences each round to the draft opened
    for ep in drafter.endpoints:
        send = ep.stream.send
        ep.stream.send = lambda msg, send=send: (opens.append(len(msg.open)), send(msg))[-1]
    seen: list[tuple[int, int, int]] = []  # per timed round: model steps, model rows, tokens caught up
    observe = engine.controller.observe_costs

    def record(rows, width, verify_seconds, model_steps, model_rows, draft_seconds, keys, caught_up, tokens) -> None:
        seen.append((model_steps, model_rows, caught_up))
        observe(rows, width, verify_seconds, model_steps, model_rows, draft_seconds, keys, caught_up, tokens)

    engine.controller.observe_costs = record
    try:
        params = SamplingParams(0.0, max_tokens=12, ignore_eos=True)
        # auto (the rounds are observed only where it plans), nudged to the draft model: no n-gram match.
        res = engine.generate([Request("a", (3, 7, 5, 9, 1, 2), params, SpecConfig("auto", 3))])
    finally:
        engine.close()
    assert res["a"].stats.proposed_tokens > 0
    assert opens[0] == 1 and sum(opens) == 1, opens  # opened once: when admitted, or at the first ask
    if opened == "when admitted, prefilled between rounds":
        assert seen[0][0] > 0 and seen[0][1] == 1, seen  # the first ask is timed
    else:
        assert seen[0] == (0, 0, 0), seen  # the round in which the draft prefilled the sequence
        assert any(steps > 0 and rows == 1 for steps, rows, _ in seen[1:]), seen
    assert all(caught_up == 0 for _, _, caught_up in seen), seen


def test_sequences_are_opened_at_admission_only_while_the_draft_is_asked(micro_draft_service) -> None:
    """While rows ask for guesses, a sequence is opened on its draft when admitted; after
    OPEN_AT_ADMISSION_WITHIN_STEPS steps without an ask (speculation off under load) it is not (the
    draft would prefill it for nothing) and is opened, whole, at its first ask."""
    from specd.services.engine.drafters import DraftRow
    from specd.services.target.draft_client import OPEN_AT_ADMISSION_WITHIN_STEPS

    drafter = _drafter(micro_draft_service, 12)
    opened: list[tuple[int, int]] = []  # per message to the draft: (sequences opened, rows asked)
    ep = drafter.endpoints[0]
    send = ep.stream.send
    ep.stream.send = lambda msg: (opened.append((len(msg.open), len(msg.rows))), send(msg))[-1]
    prompt = [3, 7, 5, 9, 1, 2]
    try:
        drafter.add("early", prompt)
        drafter.prefill(16)
        assert opened == [(1, 0)]  # admitted while the draft counts as asked: opened at once
        drafter.propose([DraftRow("early", prompt, 2, True, None)], None)
        assert opened[-1] == (0, 1)
        drafter.add("held", prompt, prefill_ahead=False)  # the engine expects no ask soon
        drafter.prefill(16)
        assert opened[-1] == (0, 1), opened  # not opened, though the draft was asked a step ago
        assert drafter.unseen("held", len(prompt)) == len(prompt)
        for _ in range(OPEN_AT_ADMISSION_WITHIN_STEPS):
            drafter.prefill(16)
        drafter.add("late", prompt)
        drafter.prefill(16)
        assert opened[-1] == (0, 1), opened  # no round of opens: nobody has asked for a while
        assert drafter.unseen("late", len(prompt)) == len(prompt)  # what auto prices its first ask at
        prop = drafter.propose([DraftRow("late", prompt, 2, True, None)], None)
        assert opened[-1] == (1, 1)  # opened, with its whole context, by its first ask
        # The draft prefilled it in that round: not a timing of its guesses.
        assert prop.token_ids.shape == (1, 2) and not prop.timed and prop.caught_up == 0
        drafter.accepted("late", 1)
        assert drafter.unseen("late", len(prompt) + 2) == 1  # the usual: the replaced guess
        assert drafter.unseen("late", len(prompt) + 9) == 8  # after rounds it sat out
    finally:
        drafter.close()


def test_the_draft_prefills_ahead_only_what_a_batch_this_size_would_draft_for(micro_pair, micro_draft_service) -> None:
    """At admission the engine asks the controller whether a batch of the size it now runs would
    be given the draft model (SpeculationController.drafts_at, once per greedy / sampled); an
    "auto" request is opened on the draft at once only where it would. A fixed method, and a
    seeded sampled "auto" request (planned apart from the load), are opened at once whatever the
    answer. The text of the request not opened is the target's all the same."""
    engine = _remote_engine(micro_pair, micro_draft_service)
    asked: list[tuple[int, bool, int]] = []  # drafts_at's (rows, greedy, kmax)
    engine.controller.drafts_at = lambda rows, greedy, keys, kmax: asked.append((rows, greedy, kmax)) or False
    drafter = engine.model_drafter
    ahead: dict[str, bool] = {}
    add = drafter.add

    def add_spy(seq_id, prompt_ids, params=None, cache_salt="", prefill_ahead=True) -> None:
        ahead[seq_id] = prefill_ahead
        add(seq_id, prompt_ids, params, cache_salt, prefill_ahead)

    drafter.add = add_spy
    opens: list[int] = []  # sequences each message to the draft opened
    send = drafter.endpoints[0].stream.send
    drafter.endpoints[0].stream.send = lambda msg: (opens.append(len(msg.open)), send(msg))[-1]
    prompt = (3, 7, 5, 9, 1, 2)
    greedy = SamplingParams(0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(0.8, seed=5, max_tokens=8, ignore_eos=True)
    try:
        res = engine.generate(
            [
                Request("auto", prompt, greedy, SpecConfig("auto", 3)),
                Request("auto-seeded", prompt, seeded, SpecConfig("auto", 3)),
                Request("fixed", prompt, greedy, SpecConfig("draft", 3)),
            ]
        )
        alone = engine.generate([Request("alone", prompt, greedy, SpecConfig("none", 0))])
    finally:
        engine.close()
    assert asked == [(3, True, 3)], asked
    assert ahead == {"auto": False, "auto-seeded": True, "fixed": True}, ahead
    assert opens[0] == 2, opens  # the first message opened the two prefilled ahead
    assert res["auto"].token_ids == alone["alone"].token_ids == res["fixed"].token_ids


_PREFILLED_IN_ROUNDS = tuple(1 + i % 11 for i in range(40))  # 39 to prefill: 5 rounds at 8


def test_a_row_the_draft_still_prefills_is_no_failed_guess(micro_pair, monkeypatch) -> None:
    """A draft service that has not prefilled a row's context yet (a long prompt; with prefix
    caching the target may start decoding at once) answers it with a block marked prefilling.
    ``auto`` counts that round as one without a guess, not as a first guess that failed, so the
    draft model's acceptance for the request is what its real guesses make it (before, those
    rounds counted as failed first guesses and could turn speculation off for the request)."""
    grpc_thread = GrpcThread()
    try:
        draft = start_draft(grpc_thread, micro_pair[1], support=4, prefill_chunk=8)
        # The draft prefills only inside rounds, 8 tokens each: a 40-token prompt takes 5 rounds.
        monkeypatch.setattr(draft.servicer.worker, "prefill_idle", lambda: False)
        draft.spy()
        engine = _remote_engine(micro_pair, draft.address)
        events: list[tuple[str, object]] = []  # in order: each proposal's prefilling rows, each round's rows
        propose, observe = engine.model_drafter.propose, engine.controller.observe_rows

        def propose_spy(rows, sampling):
            prop = propose(rows, sampling)
            events.append(("proposed", prop.prefilling))
            return prop

        def observe_spy(rows) -> None:
            events.append(("observed", [(d, proposed) for _, _, d, proposed, _ in rows]))
            observe(rows)

        monkeypatch.setattr(engine.model_drafter, "propose", propose_spy)
        monkeypatch.setattr(engine.controller, "observe_rows", observe_spy)
        # The micro target soon repeats itself: keep auto on the draft model, the drafter under test.
        monkeypatch.setattr(engine.ngram, "lookup", lambda tokens, k, seq_id=None: [])
        prompt = _PREFILLED_IN_ROUNDS
        try:
            greedy = SamplingParams(0.0, max_tokens=16, ignore_eos=True)
            res = engine.generate([Request("g", prompt, greedy, SpecConfig("auto", 3))])
        finally:
            engine.close()
        blocks = [b for _, reply in draft.rounds for b in reply.blocks]
    finally:
        grpc_thread.close()
    assert res["g"].stats.proposed_tokens > 0
    assert blocks[0].prefilling and not blocks[0].token_ids and not blocks[0].error
    assert blocks[-1].token_ids and not blocks[-1].prefilling
    waits = [i for i, (kind, value) in enumerate(events) if kind == "proposed" and value]
    assert len(waits) >= 4, events  # 40 tokens at 8 a round: the first rounds found it prefilling
    for i in waits:
        kind, rows = events[i + 1]
        assert kind == "observed" and rows == [(-1, 0)], events  # a round without a guess
    assert any(kind == "observed" and rows[0][0] == MODEL for kind, rows in events), events


def test_the_draft_answers_a_seeded_row_it_still_prefills(micro_pair) -> None:
    """A seeded sampled row gets guesses in the round that finds it half prefilled, and they, and
    their q, are those of a draft that prefilled it whole (its tokens must not depend on how far
    the draft has got); an unseeded one is told prefilling. The parameters cross the wire as the
    target sends them (the seed is what says seeded)."""
    import torch

    from specd.services.common.constants import MAX_SPECULATIVE_TOKENS
    from specd.services.common.convert import sampling_from_pb, sampling_to_pb
    from specd.services.draft.worker import DraftWorker, OpenSeq, ProposeReq
    from specd.services.engine.drafters import ModelDrafter

    model = load_model(str(micro_pair[1]), torch.float32, "cpu")
    tokens = list(_PREFILLED_IN_ROUNDS)

    def first_block(chunk: int, params: SamplingParams):
        worker = DraftWorker(ModelDrafter(model, 2, 200, support=4), 180, 4, MAX_SPECULATIVE_TOKENS, chunk)
        worker.open("s", OpenSeq("x", tokens, sampling_from_pb(sampling_to_pb(params))))
        (block,) = worker.propose("s", [ProposeReq("x", 0, [], len(tokens), 3, round_seed=1234)])
        return block

    seeded = SamplingParams(0.8, seed=7)
    half, whole = first_block(8, seeded), first_block(1000, seeded)
    assert not half.prefilling and len(half.token_ids) == 3
    assert half.token_ids == whole.token_ids
    for a, b in zip(half.sparse_probs + half.sparse_ids, whole.sparse_probs + whole.sparse_ids):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unseeded = first_block(8, SamplingParams(0.8))
    assert unseeded.prefilling and not unseeded.token_ids


def test_the_draft_service_partitions_its_prefix_cache_by_the_requests_salt(micro_draft: InProcessDraft) -> None:
    """The target sends each sequence's cache_salt with its opening, and the draft service's own
    prefix cache serves a prompt only to sequences with the same salt: the prompt tokens the draft
    prefills for each opening, one opening at a time."""
    worker = micro_draft.servicer.worker
    drafter = _drafter(micro_draft.address, 12)
    prompt = [1 + i % 11 for i in range(100)]  # 99 to prefill: three whole blocks of 32 and 3 more

    def prefilled_for(seq_id: str, salt: str) -> int:
        before = worker.prefilled_tokens
        drafter.add(seq_id, prompt, cache_salt=salt)
        drafter.prefill(16)  # sends the opening; the draft prefills it between rounds
        deadline = time.monotonic() + 30
        while True:
            keys = [k for k in list(worker.drafter.seqs) if k.endswith("/" + seq_id)]
            if keys and worker.drafter.ready(keys[0]):
                return worker.prefilled_tokens - before
            assert time.monotonic() < deadline, "the draft never prefilled the opened sequence"
            time.sleep(0.01)

    try:
        order = [("a1", "tenant-a"), ("b1", "tenant-b"), ("n1", ""), ("a2", "tenant-a"), ("b2", "tenant-b"), ("n2", "")]
        got = {seq_id: prefilled_for(seq_id, salt) for seq_id, salt in order}
    finally:
        drafter.close()
    assert got["a1"] == got["b1"] == got["n1"] == 99, got  # each salt's first: the whole prompt
    assert got["a2"] == got["b2"] == got["n2"] == 99 - 96, got  # then its own cached blocks
