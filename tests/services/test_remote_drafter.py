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


def _requests(prefix: str, prompts, temperature: float) -> list[Request]:
    return [
        Request(
            f"{prefix}{i}",
            p,
            SamplingParams(temperature, seed=100 + i, max_tokens=24, ignore_eos=True),
            SpecConfig("draft", 3),
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded-T0.8"])
def test_prefetch_changes_no_output(micro_pair, micro_draft_service, temperature) -> None:
    """Rounds sent ahead give exactly the tokens that rounds sent on demand give, seeds included."""
    import torch

    prompts = [(3, 7, 5, 9), (1, 2, 3), (4, 4, 4, 4, 4), (11, 0, 6)]
    results, used = {}, {}
    for prefetch in (True, False):
        target = load_model(str(micro_pair[0]), torch.float32, "cpu")
        drafter = RemoteDrafter(
            DraftClientConfig((micro_draft_service,), round_timeout=30.0, prefetch=prefetch), target.info.vocab_size
        )
        engine = Engine(target, load_tokenizer(str(micro_pair[0])), None, EngineConfig(8, 64), drafter=drafter)
        try:
            res = engine.generate(_requests("r", prompts, temperature))
        finally:
            drafter.close()
        results[prefetch] = {rid: r.token_ids for rid, r in res.items()}
        used[prefetch] = drafter.prefetched_rows
        assert sum(r.stats.proposed_tokens for r in res.values()) > 0
    assert used[True] > 0 and used[False] == 0
    assert results[True] == results[False]


def test_prefetch_with_joins_and_aborts(micro_pair, micro_draft_service) -> None:
    """Requests joining (sent on demand next to a prefetched round) and aborted with a round in
    flight leave every other request's output equal to the target alone's."""
    import torch

    target = load_model(str(micro_pair[0]), torch.float32, "cpu")
    drafter = RemoteDrafter(DraftClientConfig((micro_draft_service,), round_timeout=30.0), target.info.vocab_size)
    engine = Engine(target, load_tokenizer(str(micro_pair[0])), None, EngineConfig(8, 64), drafter=drafter)
    greedy = SamplingParams(0.0, max_tokens=30, ignore_eos=True)
    prompts = {"a": (3, 7, 5, 9), "b": (1, 2, 3), "c": (4, 4, 4, 4, 4)}
    out: dict[str, list[int]] = {k: [] for k in prompts}
    try:
        engine.add_request(Request("a", prompts["a"], greedy, SpecConfig("draft", 3)))
        engine.add_request(Request("doomed", (6, 6, 1), greedy, SpecConfig("draft", 3)))
        for step in range(40):
            if step == 2:
                engine.add_request(Request("b", prompts["b"], greedy, SpecConfig("draft", 2)))
            if step == 3:
                engine.abort("doomed")  # its next round is already at the draft
            if step == 5:
                engine.add_request(Request("c", prompts["c"], greedy, SpecConfig("draft", 3)))
            for o in engine.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.token_ids)
            if not engine.has_work():
                break
        base = engine.generate(
            [Request(f"base-{k}", p, greedy, SpecConfig("none", 0)) for k, p in prompts.items()]
        )
    finally:
        drafter.close()
    assert not engine.has_work() and engine.active_slots == 0
    assert drafter.prefetched_rows > 0 and not drafter.seqs
    for k in prompts:
        assert out[k] == base[f"base-{k}"].token_ids, k


def test_prefetched_round_with_a_changed_block_size_is_asked_again(micro_pair, micro_draft_service) -> None:
    """If a row differs from what was sent ahead (here its k), the drafter asks again instead of
    using the stale block, and the guesses equal those of the same draft model in-process."""
    import torch

    from services.engine.drafters import DraftRow, ModelDrafter
    from services.engine.sampling import BatchSampling

    tokens = [3, 7, 5, 9, 2]
    local = ModelDrafter(load_model(str(micro_pair[1]), torch.float32, "cpu"), 2, 64, support=4)
    local.add("s", tokens)
    want = local.propose([DraftRow("s", tokens, 2, True)], BatchSampling.from_params([SamplingParams(0.0)], "cpu"))
    drafter = RemoteDrafter(DraftClientConfig((micro_draft_service,), round_timeout=30.0), 12)
    try:
        drafter.add("s", tokens, SamplingParams(0.0))
        drafter.prefetch([DraftRow("s", tokens, 4, True)])
        got = drafter.propose([DraftRow("s", tokens, 2, True)], None)
    finally:
        drafter.close()
    assert drafter.prefetched_rows == 0
    assert got.token_ids.tolist() == want.token_ids.tolist()
