"""Tensor parallelism for the target: the own Llama forward sharded over N ranks (Megatron-style).

Per layer, q/k/v and gate/up are column-parallel (each rank owns H/N query heads, Hkv/N key/value
heads and 1/N of the MLP, and needs no communication) and o_proj and down_proj are row-parallel
(each rank multiplies its slice of their inputs; the partial sums are all-reduced): two all-reduces
per layer, as in vLLM and TGI. Each rank's KV cache holds only its own key/value heads.

Processes. Rank 0 serves gRPC and runs the engine on a :class:`TensorParallelLM`, which announces
every ``forward`` and ``new_cache`` to the other ranks before running its own shard. Ranks
1..N-1 run :func:`run_worker`, a loop that mirrors those calls, so verification stays one batched
forward pass on every rank. Announcements go over a gloo group (CPU memory: an idle worker waits on
a socket rather than in a GPU kernel, and that group's timeout is long enough never to fire while
idle); token ids and all-reduces go over the data group: NCCL on CUDA, gloo on CPU.

Launch. :func:`start_tensor_parallel` spawns ranks 1..N-1 as children of rank 0
(``python -m specd.services.engine.tensor_parallel``), which the kernel stops if rank 0 dies. External
launchers (Kubernetes, Ray, torchrun: one process per GPU) set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` instead and start every rank with the same ``specd target``
command; rank r uses ``cuda:LOCAL_RANK`` (default ``cuda:r``) of the GPUs it can see.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specd.services.common.constants import DEFAULT_DTYPE, DTYPE_NAMES
from specd.services.common.process import die_with_parent, module_command
from specd.services.engine.checkpoint import SafetensorsState
from specd.services.engine.kv_cache import BlockTable, KVCache, PagedKVCache
from specd.services.engine.llama import SUPPORTED_MODEL_TYPES, LlamaLM, LlamaShape, open_llama_checkpoint, read_llama
from specd.services.engine.model import BatchLayout, PagedLayout

log = logging.getLogger(__name__)

# Ops rank 0 announces; a header is [op, a, b, c]. NEW_PAGED_CACHE is followed by
# [num_slots, num_blocks, block_size, max_len]; a FORWARD on a paged cache by the rows' block tables.
FORWARD, NEW_CACHE, FREE_CACHE, SHUTDOWN, NEW_PAGED_CACHE = 1, 2, 3, 4, 5
# Rendezvous and the collectives inside a forward (ranks meet there within milliseconds of each other).
DATA_TIMEOUT = timedelta(minutes=10)
# Idle workers wait for the next announcement; a server may sit idle for days.
IDLE_TIMEOUT = timedelta(days=3650)

# Weights split by output rows (column-parallel): whole heads of q/k/v, a slice of gate/up. Biases too.
_COLUMN_PARALLEL = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
# Weights split by input columns (row-parallel). Their biases stay whole: added once, after the all-reduce.
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


# ------------------------------------------------------------------------------------ sharding


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int, world: int) -> None:
    """Raise ValueError unless ``world`` ranks can each take an equal share of heads and MLP."""
    for what, n in (
        ("attention heads", num_heads),
        ("key/value heads", num_kv_heads),
        ("MLP intermediate size", intermediate_size),
    ):
        if n % world:
            raise ValueError(f"tensor parallel size {world} does not divide the model's {what} ({n})")


def split_dim(name: str) -> int | None:
    """The dim along which tensor ``name`` is split over the ranks; None if every rank keeps it whole."""
    if any(part in name for part in _COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def shard_llama_state(
    state: Mapping[str, torch.Tensor], shape: LlamaShape, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], LlamaShape]:
    """Rank ``rank``'s share of a full Llama state dict, and the shape its forward runs with.

    Heads are contiguous blocks of ``head_dim`` rows, so an equal split by rows hands each rank whole
    heads, and rank r's query heads use exactly the key/value heads rank r holds (grouped-query
    attention maps consecutive query heads to one kv head). The embedding, the norms and lm_head are
    replicated: a vocab-parallel lm_head would save memory but needs an all-gather of the logits at
    every step, and rank 0 needs the full logits to verify anyway.
    """
    intermediate = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    check_shardable(shape.num_heads, shape.num_kv_heads, intermediate, world)
    out = {}
    for name, t in state.items():
        dim = split_dim(name)
        # clone: a slice would keep the whole unsharded tensor alive.
        out[name] = t if dim is None else t.chunk(world, dim=dim)[rank].clone()
    return out, local_shape(shape, world)


def local_shape(shape: LlamaShape, world: int) -> LlamaShape:
    """The shape one rank's forward runs with: its share of the query and key/value heads."""
    return dataclasses.replace(shape, num_heads=shape.num_heads // world, num_kv_heads=shape.num_kv_heads // world)


# ------------------------------------------------------------------------------ process group


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group, and the collectives the model uses."""

    rank: int
    world: int
    backend: str  # of the data group: "nccl" on CUDA, "gloo" on CPU
    device: torch.device
    control: dist.ProcessGroup | None = None  # gloo group for rank 0's announcements

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over all ranks, in place; returns it (the row-parallel hook of LlamaLM)."""
        dist.all_reduce(t)
        return t

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor ``t`` into every rank's ``t``."""
        dist.broadcast(t, 0, group=self.control)
        return t

    def broadcast_data(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's device tensor ``t`` into every rank's ``t``."""
        dist.broadcast(t, 0)
        return t


def init_tp(
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    device: str = "cpu",
    check: Callable[[], None] | None = None,
) -> TPGroup:
    """Join the group (rank 0 hosts the rendezvous store). ``check`` runs while rank 0 waits for the
    others and should raise if one of them has died, so a failed start-up is not a 10-minute hang."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    store = dist.TCPStore(
        master_addr, master_port, world, is_master=rank == 0, timeout=DATA_TIMEOUT, wait_for_workers=False
    )
    if rank == 0:
        keys = [f"specd-tp/ready/{r}" for r in range(1, world)]
        deadline = time.monotonic() + DATA_TIMEOUT.total_seconds()
        while not store.check(keys):
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not join within {DATA_TIMEOUT}")
            time.sleep(0.05)
    else:
        store.set(f"specd-tp/ready/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=DATA_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world, backend, dev, control)


def load_llama_shard(model: str, dtype: torch.dtype, group: TPGroup) -> LlamaLM:
    """Load ``model`` (local dir or hub id) and keep this rank's shard on its device.

    From safetensors files each rank reads only its own slices, one tensor at a time
    (:mod:`specd.services.engine.checkpoint`). Without them (``.bin`` checkpoints) every rank loads the
    whole model through ``transformers`` and then keeps its share.
    """
    full = open_llama_checkpoint(model)
    if full is not None:
        intermediate = full.state.shape_of("model.layers.0.mlp.gate_proj.weight")[0]
        check_shardable(full.shape.num_heads, full.shape.num_kv_heads, intermediate, group.world)
        state: Mapping[str, torch.Tensor] = SafetensorsState(full.state.files, split_dim, group.rank, group.world)
        shape = local_shape(full.shape, group.world)
    else:
        from specd.services.engine.model import _load_hf

        hf = _load_hf(model)
        if hf.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"tensor parallel needs the own Llama forward; {hf.config.model_type!r} has none")
        full = read_llama(hf)
        del hf
        state, shape = shard_llama_state(full.state, full.shape, group.rank, group.world)
    info = dataclasses.replace(full.info, backend=f"specd-llama-tp{group.world}")
    return LlamaLM(
        shape, state, full.inv_freq, full.attention_scaling, info, dtype, group.device, reduce=group.all_reduce
    )


# ------------------------------------------------------------------------------------ rank 0


class TensorParallelLM:
    """Rank 0's model: the ``CausalLM`` interface, with every call mirrored on the other ranks."""

    def __init__(
        self,
        local: LlamaLM,
        group: TPGroup,
        workers: list[subprocess.Popen] | None = None,
        exit_on_rank_failure: bool = False,
    ) -> None:
        """``workers``: rank processes this one started (watched, and waited for on close). With
        ``exit_on_rank_failure`` the process exits at once if one of them dies: the model cannot run
        without it, and a supervisor restarting the service is the only way back."""
        self.local = local
        self.group = group
        self.info = local.info
        self.device = local.device
        self.workers = workers or []
        self._exit_on_failure = exit_on_rank_failure
        self._cache_ids: weakref.WeakKeyDictionary[KVCache | PagedKVCache, int] = weakref.WeakKeyDictionary()
        self._next_cache_id = 0
        self._freed: list[int] = []  # caches gone on rank 0, to free on the others with the next message
        self._failure: str | None = None
        self._closing = threading.Event()
        if self.workers:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _fail(self, reason: str) -> None:
        self._failure = reason
        if self._exit_on_failure:
            log.critical("%s; the sharded target cannot go on: exiting", reason)
            os._exit(1)

    def _watch(self) -> None:
        while not self._closing.wait(0.5):
            for r, p in enumerate(self.workers, start=1):
                # _closing is set before SHUTDOWN is sent, so a rank that exited on SHUTDOWN is never seen here.
                if p.poll() is not None and not self._closing.is_set():
                    self._fail(f"tensor-parallel rank {r} (pid {p.pid}) exited with status {p.returncode}")
                    return

    def _send(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        while self._freed:
            cache_id = self._freed.pop()
            self.group.broadcast_control(torch.tensor([FREE_CACHE, cache_id, 0, 0]))
        self.group.broadcast_control(torch.tensor([op, a, b, c]))

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A cache for this rank's heads; every other rank allocates the same for its own."""
        cache = self.local.new_cache(num_slots, max_len)
        cache_id = self._next_cache_id
        self._next_cache_id += 1
        self._send(NEW_CACHE, cache_id, num_slots, max_len)
        self._cache_ids[cache] = cache_id
        weakref.finalize(cache, self._freed.append, cache_id)
        return cache

    def new_paged_cache(self, num_slots: int, num_blocks: int, block_size: int, max_len: int) -> PagedKVCache:
        """A block pool for this rank's heads; every other rank allocates the same geometry for its own."""
        cache = self.local.new_paged_cache(num_slots, num_blocks, block_size, max_len)
        cache.mirrored = True
        cache_id = self._next_cache_id
        self._next_cache_id += 1
        self._send(NEW_PAGED_CACHE, cache_id)
        self.group.broadcast_control(torch.tensor([num_slots, num_blocks, block_size, max_len]))
        self._cache_ids[cache] = cache_id
        weakref.finalize(cache, self._freed.append, cache_id)
        return cache

    @property
    def kv_bytes_per_token(self) -> int:
        """The whole model's bytes per position: each rank holds 1/N of them, so a budget stated for
        the service buys the same number of blocks on every rank."""
        return self.local.kv_bytes_per_token * self.group.world

    @property
    def skips_padding(self) -> bool:
        return False  # the ranks run the per-op forward, padding and all (see CausalLM.skips_padding)

    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | PagedKVCache, layout: BatchLayout, logits_for: str = "all"
    ) -> torch.Tensor | None:
        """Announce the batch (shape, slots, starts, block tables, token ids), then run this rank's shard.

        Only rank 0 allocates slots and blocks; the others write the same positions of their own caches.
        """
        B, T = input_ids.shape
        self._send(FORWARD, self._cache_ids[cache], B, T)
        self.group.broadcast_control(torch.tensor(layout.slots + layout.starts, dtype=torch.long))
        if isinstance(layout, PagedLayout):
            self.group.broadcast_control(layout.table.contiguous())
        self.group.broadcast_data(input_ids.to(torch.long).contiguous())
        try:
            return self.local.forward(input_ids, cache, layout, logits_for)
        except Exception:
            # The other ranks may now wait in an all-reduce this rank will never join.
            log.exception("sharded forward failed on rank 0")
            self._fail("a sharded forward failed on rank 0, so the ranks are out of step")
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks and leave the group. Idempotent; also registered with atexit."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._failure is None:
            try:
                self._send(SHUTDOWN)
            except Exception:  # a rank already gone: the others still get stopped below
                log.warning("could not announce shutdown to the tensor-parallel ranks", exc_info=True)
        for p in self.workers:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank (pid %d) did not stop; killing it", p.pid)
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------- workers


def run_worker(model: LlamaLM, group: TPGroup) -> None:
    """Mirror rank 0's calls on this rank's shard until it announces shutdown."""
    caches: dict[int, KVCache | PagedKVCache] = {}
    while True:
        op, a, b, c = group.broadcast_control(torch.empty(4, dtype=torch.long)).tolist()
        if op == SHUTDOWN:
            return
        if op == NEW_CACHE:
            caches[a] = model.new_cache(b, c)
        elif op == NEW_PAGED_CACHE:
            geometry = group.broadcast_control(torch.empty(4, dtype=torch.long)).tolist()
            caches[a] = model.new_paged_cache(*geometry)
        elif op == FREE_CACHE:
            caches.pop(a, None)
        elif op == FORWARD:
            meta = group.broadcast_control(torch.empty(2 * b, dtype=torch.long)).tolist()
            cache = caches[a]
            if isinstance(cache, BlockTable):
                table = group.broadcast_control(torch.empty((b, cache.table.shape[1]), dtype=torch.long))
                cache.mirror_table(meta[:b], table)
                layout = PagedLayout(meta[:b], meta[b:], c, table, cache.block_size, group.device)
            else:
                layout = BatchLayout(meta[:b], meta[b:], c, group.device)
            ids = group.broadcast_data(torch.empty((b, c), dtype=torch.long, device=group.device))
            # Logits stay on rank 0: lm_head is replicated, so no other rank needs to compute them.
            model.forward(ids, cache, layout, "none")
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


def worker_main(model: str, dtype: str, device: str, rank: int, world: int, master_addr: str, port: int) -> None:
    """One non-zero rank, from joining the group to rank 0's shutdown."""
    group = init_tp(rank, world, master_addr, port, device)
    try:
        run_worker(load_llama_shard(model, getattr(torch, dtype), group), group)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ launch


def check_tensor_parallel(model: str, world: int, device: str = "cpu", backend: str = "auto") -> None:
    """Refuse, before any process starts, what cannot be sharded ``world`` ways."""
    from transformers import AutoConfig

    if world < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {world}")
    if backend == "transformers":
        raise ValueError("tensor parallel needs the own Llama forward (--backend auto or own), not transformers")
    cfg = AutoConfig.from_pretrained(model)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallel supports model types {sorted(SUPPORTED_MODEL_TYPES)}, not {cfg.model_type!r}"
        )
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    check_shardable(cfg.num_attention_heads, kv_heads, cfg.intermediate_size, world)
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallel runs on cpu or cuda, not {device!r}")
    if dev.type == "cuda" and dev.index is not None:
        raise ValueError("with tensor parallel use --device cuda and pick GPUs with CUDA_VISIBLE_DEVICES")


def _spawn_worker(
    rank: int, world: int, port: int, model: str, dtype: str, device: str, threads: int | None
) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = module_command(__name__, "--model", model, "--dtype", dtype)
    cmd += ["--device", device] + (["--threads", str(threads)] if threads else [])
    # Own process group: a terminal's Ctrl-C reaches rank 0 only, which then stops the others in order.
    return subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=die_with_parent)


def _stop_workers(workers: list[subprocess.Popen]) -> None:
    for p in workers:
        if p.poll() is None:
            p.kill()
        p.wait()


def start_tensor_parallel(
    model: str,
    dtype: str,
    world: int,
    device: str = "cpu",
    backend: str = "auto",
    exit_on_rank_failure: bool = True,
) -> TensorParallelLM:
    """Rank 0's sharded target; ranks 1..world-1 are spawned here unless an external launcher set
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``. In that case a process with ``RANK`` > 0
    serves as a worker and exits (SystemExit) when rank 0 shuts down: it never reaches the gRPC server.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group; one sharded target per process")
    check_tensor_parallel(model, world, device, backend)
    external = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    workers: list[subprocess.Popen] = []
    if external:
        rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if env_world != world:
            raise ValueError(f"WORLD_SIZE={env_world} differs from the tensor parallel size {world}")
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank != 0:
            worker_main(model, dtype, device, rank, world, addr, port)
            raise SystemExit(0)
    else:
        from specd.services.common.ports import free_ports

        if torch.device(device).type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor parallel size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
        addr, port = "127.0.0.1", free_ports(1)[0]
        threads = None
        if device == "cpu":
            # The ranks share this machine's cores: split them, or each rank's threads fight the others'.
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
        workers = [_spawn_worker(r, world, port, model, dtype, device, threads) for r in range(1, world)]

    def check() -> None:
        for r, p in enumerate(workers, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {r} exited with status {p.returncode} during start-up")

    try:
        group = init_tp(0, world, addr, port, device, check)
        local = load_llama_shard(model, getattr(torch, dtype), group)
    except BaseException:
        _stop_workers(workers)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    tp = TensorParallelLM(local, group, workers, exit_on_rank_failure)
    atexit.register(tp.close)
    return tp


def main(argv: list[str] | None = None) -> int:
    """Entry point of ranks 1..N-1: ``python -m specd.services.engine.tensor_parallel`` with the
    torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    p = argparse.ArgumentParser(prog="python -m specd.services.engine.tensor_parallel", description=main.__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=DEFAULT_DTYPE)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    env = os.environ
    worker_main(
        args.model,
        args.dtype,
        args.device,
        int(env["RANK"]),
        int(env["WORLD_SIZE"]),
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
