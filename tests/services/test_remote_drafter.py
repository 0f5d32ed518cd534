"""The engine with a *remote* draft service (a real ``specd draft`` process) is still lossless.

Same exact-law test as tests/engine/test_sampling_distribution.py, but every guess and its q now
cross gRPC, sparse, from a draft that samples from its q truncated to 4 of the 12 tokens: the
protocol, the per-round seeds, the rollback bookkeeping and the sparse q are all on the path.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from services.engine.builder import load_tokenizer
from services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from services.engine.model import load_model
from services.engine.sampling import SamplingParams
from services.target.draft_client import DraftClientConfig, RemoteDrafter
from tests.e2e.processes import free_port, spawn, stop_process, wait_grpc
from tests.engine.test_sampling_distribution import N_SAMPLES, PROMPT, _chi2_pvalue, _exact_joint


@pytest.fixture(scope="module")
def micro_draft_service(micro_pair, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    p = spawn(
        [
            "draft",
            "--model",
            str(micro_pair[1]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--proposal-support",
            "4",
            "--max-sequences",
            "64",
        ],
        log,
    )
    try:
        wait_grpc(port, p, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(p)


def _remote_engine(micro_pair, address: str) -> Engine:
    import torch

    target = load_model(str(micro_pair[0]), torch.float32, "cpu")
    drafter = RemoteDrafter(DraftClientConfig((address,), round_timeout=30.0), target.info.vocab_size)
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
        engine.drafters["draft"].close()
    proposed = sum(r.stats.proposed_tokens for r in res.values())
    accepted = sum(r.stats.accepted_tokens for r in res.values())
    assert proposed > 0 and 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejects"
    counts = np.zeros((V, V, V))
    for r in res.values():
        counts[tuple(r.token_ids)] += 1
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_remote_greedy_equals_target_alone(micro_pair, micro_draft_service) -> None:
    engine = _remote_engine(micro_pair, micro_draft_service)
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
    finally:
        engine.drafters["draft"].close()
    assert sum(r.stats.proposed_tokens for r in spec.values()) > 0
    for i in range(len(prompts)):
        assert spec[f"s{i}"].token_ids == base[f"b{i}"].token_ids


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
    engine = _remote_engine(micro_pair, f"127.0.0.1:{free_port()}")  # nothing listens there
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
        engine.drafters["draft"].close()
    assert sum(r.stats.proposed_tokens for r in spec.values()) == 0  # the draft really never answered
    for i in range(len(prompts)):
        assert len(spec[f"draft{i}"].token_ids) == 12
        assert spec[f"draft{i}"].token_ids == base[f"none{i}"].token_ids
