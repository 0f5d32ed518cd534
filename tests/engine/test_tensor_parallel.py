"""Tensor-parallel target (gloo, fp32): N=2 logits within 1e-4 of N=1, greedy output token-identical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from specd.services.engine.builder import load_tokenizer
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.llama import LlamaLM, load_llama, read_llama
from specd.services.engine.model import BatchLayout, load_model
from specd.services.engine.sampling import SamplingParams
from specd.services.engine.tensor_parallel import (
    TensorParallelLM,
    check_tensor_parallel,
    shard_llama_state,
    start_tensor_parallel,
)
from tests.e2e.processes import alive, children, free_port, spawn, stop_process, wait_grpc
from tests.tiny_models import random_hf_model

TOL = 1e-4


# ------------------------------------------------------------------------------ shard math


def test_shards_reassemble_the_full_weights() -> None:
    full = read_llama(random_hf_model(attention_bias=True, mlp_bias=True))
    shards = [shard_llama_state(full.state, full.shape, r, 2) for r in range(2)]
    assert all(shape.num_heads == 2 and shape.num_kv_heads == 1 for _, shape in shards)
    assert shards[0][1].hidden_size == full.shape.hidden_size
    a = "model.layers.1.self_attn."
    m = "model.layers.1.mlp."
    for name in (
        a + "q_proj.weight",
        a + "k_proj.bias",
        a + "v_proj.weight",
        m + "gate_proj.weight",
        m + "up_proj.bias",
    ):
        assert torch.equal(torch.cat([s[name] for s, _ in shards], dim=0), full.state[name]), name
    for name in (a + "o_proj.weight", m + "down_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s, _ in shards], dim=1), full.state[name]), name
    for name in (a + "o_proj.bias", m + "down_proj.bias", "model.embed_tokens.weight", "lm_head.weight"):
        assert all(torch.equal(s[name], full.state[name]) for s, _ in shards), name  # replicated
    # Row-parallel: the partial products sum to the full one.
    x = torch.randn(3, 64)
    w = full.state[a + "o_proj.weight"]
    parts = [x[:, 32 * r : 32 * (r + 1)] @ s[a + "o_proj.weight"].T for r, (s, _) in enumerate(shards)]
    assert torch.allclose(parts[0] + parts[1], x @ w.T, atol=1e-5)


def test_indivisible_sizes_are_refused(tiny_pair) -> None:
    full = read_llama(random_hf_model())  # 4 heads, 2 kv heads, MLP 96
    with pytest.raises(ValueError, match=r"does not divide the model's key/value heads \(2\)"):
        shard_llama_state(full.state, full.shape, 0, 4)
    with pytest.raises(ValueError, match=r"does not divide the model's attention heads \(4\)"):
        shard_llama_state(full.state, full.shape, 0, 3)
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="does not divide"):  # refused before any process starts
        check_tensor_parallel(str(target), 4)
    with pytest.raises(ValueError, match="not transformers"):
        check_tensor_parallel(str(target), 2, backend="transformers")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        check_tensor_parallel(str(target), 2, device="cuda:1")


def test_rank_failing_at_start_up_is_reported(tiny_pair, monkeypatch) -> None:
    import specd.services.engine.tensor_parallel as tp

    def failing_rank(*args, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(tp, "_spawn_worker", failing_rank)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="rank 1 exited with status 3 during start-up"):
            start_tensor_parallel(str(tiny_pair[0]), "float32", 2)
    finally:
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()


class _ThreadGroup:
    """An all-reduce between threads, so the sharded forward can be checked without processes."""

    def __init__(self, world: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def reducer(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())  # same order on every rank
            self.barrier.wait()  # everyone has read the parts before any is overwritten
            return t.copy_(total)

        return reduce


CASES = [
    ("llama", {"attention_bias": True, "mlp_bias": True}, 2),  # row-parallel biases
    ("qwen2", {}, 2),  # q/k/v biases
    ("llama", {"num_key_value_heads": 4}, 4),  # one head per rank
]


@pytest.mark.parametrize(("model_type", "overrides", "world"), CASES, ids=["llama-bias", "qwen2", "llama-mha-4"])
def test_sharded_forward_matches_in_threads(model_type: str, overrides: dict, world: int) -> None:
    hf = random_hf_model(model_type, **overrides)
    ref = load_llama(hf, torch.float32, "cpu", prepack=False)
    full = read_llama(hf)
    shards = [shard_llama_state(full.state, full.shape, r, world) for r in range(world)]
    assert_sharded_forward_matches(ref, full, shards)


def assert_sharded_forward_matches(ref: LlamaLM, full, shards: list[tuple[Mapping, object]]) -> None:
    """Ranks as threads, each building a ``LlamaLM`` from its (state, shape): logits within TOL of ``ref``."""
    group = _ThreadGroup(len(shards))
    models = [
        LlamaLM(
            shape,
            state,
            full.inv_freq,
            full.attention_scaling,
            full.info,
            torch.float32,
            prepack=False,
            reduce=group.reducer(r),
        )
        for r, (state, shape) in enumerate(shards)
    ]
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    layout = BatchLayout([1, 0], [0, 0], 12)
    expected = ref.forward(ids, ref.new_cache(2, 32), layout)
    with ThreadPoolExecutor(len(models)) as pool:
        outs = list(pool.map(lambda m: m.forward(ids, m.new_cache(2, 32), layout), models))
    for out in outs:
        assert (out - expected).abs().max() < TOL


# ------------------------------------------------------------------- two real ranks (gloo)


def test_external_launcher_same_command_on_every_rank(tiny_pair, monkeypatch, tmp_path) -> None:
    """torchrun-style environment: rank 1 runs the very same ``specd target`` command, works as a
    rank, never serves, and exits 0 when rank 0 closes. (Runs before the module's own group exists.)"""
    target, _ = tiny_pair
    for name, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "1")
    log = tmp_path / "rank1.log"
    rank1 = spawn(["target", "--model", str(target), "--dtype", "float32", "--tensor-parallel-size", "2"], log)
    monkeypatch.setenv("RANK", "0")
    model = None
    try:
        model = start_tensor_parallel(str(target), "float32", 2, exit_on_rank_failure=False)
        assert model.workers == []  # the launcher owns the other ranks
        ref = load_model(str(target), torch.float32)
        ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(3))
        got = model.forward(ids, model.new_cache(1, 32), BatchLayout([0], [0], 9))
        want = ref.forward(ids, ref.new_cache(1, 32), BatchLayout([0], [0], 9))
        assert (got - want).abs().max() < TOL
        model.close()
        assert rank1.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert "listening" not in log.read_text()
    finally:
        if model is not None:
            model.close()
        stop_process(rank1)


@pytest.fixture(scope="module")
def tp_target(tiny_pair) -> Iterator[TensorParallelLM]:
    threads = torch.get_num_threads()
    target, _ = tiny_pair
    model = start_tensor_parallel(str(target), "float32", 2, exit_on_rank_failure=False)
    try:
        yield model
    finally:
        model.close()
        torch.set_num_threads(threads)  # start_tensor_parallel split the cores between the ranks
    assert all(p.returncode == 0 for p in model.workers)


@pytest.fixture(scope="module")
def ref_target(tiny_pair):
    return load_model(str(tiny_pair[0]), torch.float32)


def test_logits_match_single_process(tp_target, ref_target) -> None:
    assert tp_target.info.vocab_size == ref_target.info.vocab_size
    assert tp_target.local.shape.num_heads == 2 and tp_target.local.shape.num_kv_heads == 1
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, 500, (1, 30), generator=g)
    b = torch.randint(3, 500, (1, 22), generator=g)
    junk = torch.randint(3, 500, (2, 4), generator=g)

    def run(model) -> list[torch.Tensor]:
        cache = model.new_cache(4, 64)
        out = [model.forward(a[:, :20], cache, BatchLayout([1], [0], 20))]  # prefill with logits
        model.forward(b[:, :16], cache, BatchLayout([3], [0], 16), "none")
        # A rejected block, then a verify-style batch over it: rows in reversed, non-contiguous slots.
        model.forward(junk, cache, BatchLayout([3, 1], [16, 20], 4), "none")
        out.append(model.forward(torch.cat([b[:, 16:21], a[:, 20:25]]), cache, BatchLayout([3, 1], [16, 20], 5)))
        out.append(model.forward(torch.cat([a[:, 25:26], b[:, 21:22]]), cache, BatchLayout([1, 3], [25, 21], 1)))
        out.append(model.forward(a[:, 26:30], cache, BatchLayout([1], [26], 4), "last"))
        return out

    for got, want in zip(run(tp_target), run(ref_target), strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("method", ["none", "draft"])
def test_greedy_generation_is_token_identical(tp_target, ref_target, tiny_pair, method: str) -> None:
    target_dir, draft_dir = tiny_pair
    tok = load_tokenizer(str(target_dir))
    draft = load_model(str(draft_dir), torch.float32) if method == "draft" else None
    prompts = ["def wrap(text, width):", "import bisect\n", "class TextWrapper:", "    return"]
    reqs = [
        Request(f"r{i}", tuple(tok.encode(p)), SamplingParams(temperature=0.0, max_tokens=24), SpecConfig(method, 3))
        for i, p in enumerate(prompts)
    ]
    results = []
    for model in (tp_target, ref_target):
        engine = Engine(model, tok, draft, EngineConfig(max_batch_size=4, max_model_len=128))
        results.append(engine.generate(reqs))
    tp, ref = results
    for r in reqs:
        assert tp[r.request_id].token_ids == ref[r.request_id].token_ids
        assert len(ref[r.request_id].token_ids) > 0
    if method == "draft":  # the sharded target really verified multi-token blocks
        assert sum(res.stats.accepted_tokens for res in tp.values()) > 0


# ------------------------------------------------------------------ specd target, end to end


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_left(pids: list[int]) -> None:
    """After a failed check: a rank started by the target is in its own process group, so
    stop_process would not reach it."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _grpc_generate(port: int, prompt: list[int], max_tokens: int) -> list[int]:
    from specd.v1 import common_pb2, target_pb2, target_pb2_grpc

    req = target_pb2.GenerateRequest(
        tokens=target_pb2.TokenPrompt(token_ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        speculation=target_pb2.Speculation(
            method=common_pb2.SPECULATION_METHOD_NGRAM, num_tokens=3
        ),  # multi-token verify passes
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [t for r in target_pb2_grpc.TargetServiceStub(ch).Generate(req, timeout=60) for t in r.token_ids]


def test_specd_target_tensor_parallel_serves_and_stops(tiny_pair, ref_target, tmp_path) -> None:
    target_dir, _ = tiny_pair
    port = free_port()
    log = tmp_path / "target.log"
    args = ["target", "--model", str(target_dir), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--max-batch-size", "2", "--max-model-len", "128", "--tensor-parallel-size", "2"]
    proc = spawn(args, log)
    ranks: list[int] = []
    try:
        wait_grpc(port, proc, log)
        ranks = children(proc.pid)
        assert len(ranks) == 1, log.read_text()[-3000:]
        tok = load_tokenizer(str(target_dir))
        engine = Engine(ref_target, tok, None, EngineConfig(max_batch_size=1, max_model_len=128))
        for i, text in enumerate(["def fill(text, width):", "if __name__ =="]):
            prompt = tok.encode(text)
            req = Request(str(i), tuple(prompt), SamplingParams(temperature=0.0, max_tokens=20), SpecConfig("none", 0))
            want = engine.generate([req])[str(i)].token_ids
            assert _grpc_generate(port, prompt, 20) == want
        stop_process(proc)  # SIGTERM to rank 0 only: it stops the other rank itself
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert _wait_gone(ranks) == [], "a tensor-parallel rank outlived the target"
    finally:
        stop_process(proc)
        _kill_left(ranks)


def test_ranks_die_with_a_killed_target(tiny_pair, tmp_path) -> None:
    """SIGKILL on rank 0 (no atexit, no shutdown message): the kernel stops the rank it started."""
    target_dir, _ = tiny_pair
    log = tmp_path / "target.log"
    args = ["target", "--model", str(target_dir), "--host", "127.0.0.1", "--port", str(free_port())]
    args += ["--dtype", "float32", "--max-batch-size", "1", "--max-model-len", "64", "--tensor-parallel-size", "2"]
    proc = spawn(args, log)
    ranks: list[int] = []
    try:
        # Once the rank runs its own program, its parent-death signal is set (it is set before exec).
        deadline = time.monotonic() + 60
        while not (ranks := [pid for pid in children(proc.pid) if "tensor_parallel" in _cmdline(pid)]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        assert _wait_gone(ranks) == [], "a tensor-parallel rank outlived a killed target"
    finally:
        stop_process(proc)
        _kill_left(ranks)


def test_a_rank_that_mirrors_block_tables_zeroes_the_blocks_it_is_handed() -> None:
    """A non-zero rank never allocates blocks; it follows rank 0's tables. Blocks new to a slot's row
    are zeroed as rank 0 zeroes them on hand-out, so uninitialised NaN never reaches attention."""
    from specd.services.engine.kv_cache import PagedKVCache

    cache = PagedKVCache(2, 2, 6, 4, 16, 1, 8, torch.float32)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    scratch, width = cache.scratch, cache.table.shape[1]

    def row(*blocks: int) -> torch.Tensor:
        return torch.tensor([[*blocks] + [scratch] * (width - len(blocks))])

    cache.mirror_table([1], row(3, 0))
    for block in (3, 0):
        assert cache.k[:, block * 4 : (block + 1) * 4].eq(0).all()
        assert cache.v[:, block * 4 : (block + 1) * 4].eq(0).all()
    assert cache.k[:, 4:8].isnan().all()  # block 1: not named, left alone
    cache.k[:, 12:16] = 7.0  # block 3 now holds this slot's K
    cache.mirror_table([1], row(3, 0, 5))
    assert cache.k[:, 12:16].eq(7.0).all()  # kept: not new to the row
    assert cache.k[:, 20:24].eq(0).all()  # block 5: new, zeroed
    assert cache.table[1].tolist() == row(3, 0, 5)[0].tolist()
