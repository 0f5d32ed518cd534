"""The contracts between the processes, on the real servicers, engine loop and gateway in-process
(tests/inprocess.py): errors typed end to end, a short-context draft stops being asked, per-token
provenance reaches HTTP clients, and the target's view of its drafts comes from the streams."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from specd.services.engine.engine import Request, SpecConfig
from specd.services.engine.errors import RequestError
from specd.services.engine.sampling import SamplingParams
from specd.services.target.draft_client import DraftEndpoint
from specd.v1 import draft_pb2
from tests.inprocess import GrpcThread, gateway_client, start_draft, start_target, target_engine


@pytest.fixture(scope="module")
def grpc_thread() -> Iterator[GrpcThread]:
    t = GrpcThread()
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def stack(tiny_pair, grpc_thread) -> Iterator:
    """Draft, target and gateway on the tiny pair, in this process."""
    target_model, draft_model = tiny_pair
    draft = start_draft(grpc_thread, draft_model)
    target = start_target(grpc_thread, target_model, (draft.address,))
    try:
        with gateway_client(target.address) as client:
            _wait(lambda: client.get("/health").status_code == 200)
            yield client, target, draft
    finally:
        target.stop(grpc_thread)


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


LONG = "def f(x): return x\n" * 120  # far past the tiny target's 512-token context
BAD_REQUESTS = [
    # (path, body): each refused by the target (its conversion or its engine), which alone knows why
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),  # the engine: prompt too long
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}),  # the conversion: prompt + max_tokens too long
    ("/v1/completions", {"prompt": [1, 2, 100000], "max_tokens": 4}),  # the engine: not in the vocabulary
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}),  # the conversion: max_tokens past the context
]


def test_rewording_every_message_changes_no_param_or_code(stack, monkeypatch) -> None:
    """Criterion 1: the gateway reads the target's typed error, never its sentence. Every
    RequestError the target raises is reworded; the HTTP status, param and code stay the same."""
    client = stack[0]

    def errors() -> list[tuple[int, str | None, str | None, str]]:
        out = []
        for path, body in BAD_REQUESTS:
            r = client.post(path, json=body)
            e = r.json()["error"]
            out.append((r.status_code, e["param"], e["code"], e["message"]))
        return out

    before = errors()
    _reword_every_request_error(monkeypatch)
    after = errors()
    assert [b[:3] for b in before] == [a[:3] for a in after]
    assert all(a[3] == "something else entirely" for a in after)  # the new wording did reach the client
    assert before[0][:3] == (400, "messages", "context_length_exceeded")
    assert before[1][:3] == (400, "prompt", "context_length_exceeded")
    assert before[2][:3] == (400, "prompt", "invalid_value")
    assert before[3][:3] == (400, "prompt", "context_length_exceeded")


def _reword_every_request_error(monkeypatch) -> None:
    original = RequestError.__init__

    def reworded(self, message, *args, **kwargs):
        original(self, "something else entirely", *args, **kwargs)

    monkeypatch.setattr(RequestError, "__init__", reworded)


def test_speculation_error_is_typed(tiny_pair, grpc_thread, monkeypatch) -> None:
    """A target without drafts refuses method "draft": param "speculation", whatever the words."""
    target = start_target(grpc_thread, tiny_pair[0])
    try:
        with gateway_client(target.address) as client:
            _wait(lambda: client.get("/health").status_code == 200)
            body = {"prompt": "x", "max_tokens": 2, "speculation": {"method": "draft"}}
            for reword in (False, True):
                if reword:
                    _reword_every_request_error(monkeypatch)
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 400, r.text
                assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("speculation", "invalid_value")
    finally:
        target.stop(grpc_thread)


def test_token_sources_whole_and_streamed(stack) -> None:
    """return_token_sources: each token says whether it was an accepted guess; the count of
    "draft" is the usage's accepted_tokens, and streaming gives the same list in pieces."""
    client = stack[0]
    body = {
        "prompt": "import os\nimport sys\n\n\ndef main(",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_token_sources": True,
        "speculation": {"method": "draft", "num_tokens": 4},
    }
    whole = client.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    assert len(choice["token_sources"]) == len(choice["token_ids"]) == 24
    assert set(choice["token_sources"]) <= {"draft", "target"}
    assert choice["token_sources"].count("draft") == whole["usage"]["speculation"]["accepted_tokens"] > 0
    plain = client.post("/v1/completions", json={**body, "return_token_sources": False}).json()
    assert "token_sources" not in plain["choices"][0]  # opt-in
    ids, sources = [], []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                ids += c.get("token_ids", [])
                sources += c.get("token_sources", [])
    assert ids == choice["token_ids"]  # greedy
    assert len(sources) == len(ids) and sources.count("draft") > 0


def test_target_health_counts_the_draft_streams(stack) -> None:
    """The target's draft health is its streams' state: up while the draft serves (no probe of
    its own to the draft)."""
    client, target, draft = stack
    health = client.get("/health").json()["targets"][0]
    assert (health["drafts_healthy"], health["drafts_total"]) == (1, 1)
    assert target.service.servicer.drafts.health() == (1, 1)


# --------------------------------------------------------------- a draft with a short context

DRAFT_CONTEXT = 24


@pytest.fixture(scope="module")
def short_draft(tiny_pair, grpc_thread):
    draft = start_draft(grpc_thread, tiny_pair[1], max_model_len=DRAFT_CONTEXT)
    draft.spy()
    yield draft
    grpc_thread.stop_server(draft.server)


def _generate_past_the_draft_context(tiny_pair, draft, rid: str) -> tuple[list[int], list[int]]:
    """(speculative ids, target-alone ids): 40 greedy tokens from a 10-token prompt, so the
    sequence outgrows the draft's 24-token context about halfway."""
    engine = target_engine(tiny_pair[0], (draft.address,), max_batch_size=2)
    try:
        _wait(lambda: engine.model_drafter.endpoints[0].up)
        params = SamplingParams(0.0, max_tokens=40, ignore_eos=True)
        prompt = tuple(range(30, 40))
        spec = engine.generate([Request(rid, prompt, params, SpecConfig("draft", 4))])[rid]
        # Its stream still open: the draft has freed the sequence all the same.
        _wait(lambda: draft.servicer.worker.active == 0)
        base = engine.generate([Request("base", prompt, params, SpecConfig("none", 0))])["base"]
        assert spec.stats.proposed_tokens > 0  # it did speculate while the sequence fit
        return spec.token_ids, base.token_ids
    finally:
        engine.close()


def _traffic(draft, rid: str) -> tuple[int, list[tuple[int, int]], int]:
    """(times the sequence was opened, (committed length, k) of every row asked for it, refusals)."""
    opens, rows, refusals = 0, [], 0
    for rnd, reply in draft.rounds:
        opens += sum(o.sequence_id == rid for o in rnd.open)
        rows += [(r.committed_length, r.num_tokens) for r in rnd.rows if r.sequence_id == rid]
        refusals += sum(b.sequence_id == rid and b.error == draft_pb2.DRAFT_ERROR_CONTEXT_FULL for b in reply.blocks)
    return opens, rows, refusals


def test_short_draft_context_is_never_overrun(tiny_pair, short_draft) -> None:
    """Knowing the draft's context (its Info), the client caps k by the room left and stops
    asking when there is none: one open, no refusal, every row fits."""
    spec, base = _generate_past_the_draft_context(tiny_pair, short_draft, "capped")
    assert spec == base
    opens, rows, refusals = _traffic(short_draft, "capped")
    assert opens == 1 and refusals == 0 and rows
    assert all(length + k <= DRAFT_CONTEXT for length, k in rows)
    assert max(length for length, _ in rows) == DRAFT_CONTEXT - 1  # it used the room to the end


def test_short_draft_context_refusal_stops_the_asking(tiny_pair, short_draft, monkeypatch) -> None:
    """Criterion 2: without the draft's Info, the first CONTEXT_FULL refusal is the last thing
    sent for that sequence: no re-open with the whole context, no more rows."""
    monkeypatch.setattr(DraftEndpoint, "max_context", property(lambda self: None))
    spec, base = _generate_past_the_draft_context(tiny_pair, short_draft, "refused")
    assert spec == base
    opens, rows, refusals = _traffic(short_draft, "refused")
    assert opens == 1 and refusals == 1
    last_length, last_k = rows[-1]
    assert last_length + last_k > DRAFT_CONTEXT  # the refused row was the last one sent
    assert all(length + k <= DRAFT_CONTEXT for length, k in rows[:-1])


def test_engine_loop_accepts_refuses_and_aborts_by_submission(tiny_pair) -> None:
    """The loop answers each submission first (ACCEPTED or the RequestError), and an abort stops
    only the submission it names: a refused duplicate id cannot abort the request that has it."""
    import queue
    import threading

    from specd.services.target.loop import ACCEPTED, EngineLoop
    from specd.services.target.metrics import SpecExporter

    loop = EngineLoop(target_engine(tiny_pair[0], max_batch_size=2), SpecExporter())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        params = SamplingParams(0.0, max_tokens=12, ignore_eos=True)
        first, dup, other = queue.Queue(), queue.Queue(), queue.Queue()
        loop.submit(Request("same", (5, 6, 7), params, SpecConfig("ngram", 2)), first.put)
        loop.submit(Request("same", (8, 9), params, SpecConfig("ngram", 2)), dup.put)
        loop.abort("same", dup.put)  # the refused one's abort: a no-op
        assert first.get(timeout=30) is ACCEPTED
        assert isinstance(dup.get(timeout=30), RequestError)
        loop.submit(
            Request("other", (5, 6), SamplingParams(0.0, max_tokens=400, ignore_eos=True), SpecConfig("none", 0)),
            other.put,
        )
        assert other.get(timeout=30) is ACCEPTED
        loop.abort("other", other.put)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(first.get(timeout=30))
        assert sum(len(o.token_ids) for o in outs) == 12 and outs[-1].finish_reason == "length"
        # Looked at on the engine thread (the loop's own way in): "other" is gone, its slot freed.
        state: queue.Queue = queue.Queue()
        loop.call(lambda: state.put((set(loop.engine.running), loop.engine.active_slots)))
        assert state.get(timeout=30) == (set(), 0)
    finally:
        loop.stop()
        thread.join(timeout=30)
