"""The deployment's controller: a detached, named Ray actor that starts, scales and stops specd.

It is the registry too: every replica's address lives here, and ``specd ray scale`` / ``status`` /
``down`` find it by name (``controller`` in namespace ``specd``). Ray does the cluster work:
scheduling by ``num_cpus``/``num_gpus``, a placement group per target replica (its tensor-parallel
ranks reserved together on one node), actor lifetimes. The controller only keeps lists and tells
the running services about changes:

- drafts scaled: every target gets the new draft list (TargetService.SetDrafts); sequences on a
  removed draft move to the others before that draft is stopped;
- targets scaled: the gateway gets the new target list; a removed target takes no new requests and
  is stopped only once its running requests have finished.

So scaling never drops an in-flight request. The actors the controller creates are owned by it and
die with it; the service processes die with their actors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from specd.services.ray_cluster.actors import GatewayActor, ServiceActor
from specd.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

NAMESPACE = "specd"
CONTROLLER_NAME = "controller"


@dataclass(frozen=True)
class RayDeployConfig:
    """What ``specd ray up`` deploys; parsed once by the CLI."""

    target_model: str
    draft_model: str | None
    draft_replicas: int = 1
    target_replicas: int = 1
    target_tp: int = 1
    gateway_host: str = "0.0.0.0"
    gateway_port: int = 8000
    gateway_node: str | None = None  # Ray node id; default: wherever Ray places it
    api_key: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"  # "cuda": one GPU per draft and per target rank
    cpus_per_draft: float = 1.0
    cpus_per_target_rank: float = 1.0
    num_speculative_tokens: int | None = None  # None: the target's default
    start_timeout: float = 600.0
    drain_timeout: float = 600.0  # longest wait for a removed target's requests to finish
    log_dir: str = "/tmp/specd-ray"

    @property
    def gpus(self) -> int:
        return 1 if self.device.startswith("cuda") else 0


@dataclass
class Replica:
    name: str
    actor: ray.actor.ActorHandle
    address: str = ""
    metrics: str = ""
    pid: int = 0  # of the service process, on its node
    pg: PlacementGroup | None = None


@dataclass
class _Counter:
    drafts: int = 0
    targets: int = 0


class Controller:
    """Body of the controller actor (see the module docstring)."""

    def __init__(self, cfg: RayDeployConfig) -> None:
        self.cfg = cfg
        self.drafts: list[Replica] = []
        self.targets: list[Replica] = []
        self.gateway: ray.actor.ActorHandle | None = None
        self.url = ""
        self._names = _Counter()

    # ------------------------------------------------------------------------ public

    def up(self) -> dict:
        """Start drafts, then targets, then the gateway; returns :meth:`status`."""
        cfg = self.cfg
        if cfg.draft_model:
            self._add_drafts(cfg.draft_replicas)
        self._add_targets(cfg.target_replicas)
        from specd.gateway.settings import GatewaySettings

        settings = GatewaySettings(
            target_addresses=tuple(t.address for t in self.targets),
            host=cfg.gateway_host,
            port=cfg.gateway_port,
            api_key=cfg.api_key,
        )
        options: dict = {"num_cpus": 0}
        if cfg.gateway_node:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(cfg.gateway_node, soft=False)
        self.gateway = GatewayActor.options(**options).remote()
        self.url = ray.get(self.gateway.start.remote(settings), timeout=cfg.start_timeout)
        return self.status()

    def scale(self, draft_replicas: int | None = None, target_replicas: int | None = None) -> dict:
        """Change either count live; returns :meth:`status`."""
        if draft_replicas is not None:
            if not self.cfg.draft_model:
                raise ValueError("this deployment has no draft model")
            if draft_replicas < 1:
                raise ValueError("at least one draft replica is needed (use speculation 'none' per request instead)")
            if draft_replicas > len(self.drafts):
                self._add_drafts(draft_replicas - len(self.drafts))
                self._push_drafts()
            elif draft_replicas < len(self.drafts):
                removed, self.drafts = self.drafts[draft_replicas:], self.drafts[:draft_replicas]
                self._push_drafts()
                # Targets switch at their next round (milliseconds); a round still in flight to a
                # removed draft would only cost that round its guesses, never a request.
                time.sleep(0.5)
                self._stop(removed)
        if target_replicas is not None:
            if target_replicas < 1:
                raise ValueError("at least one target replica is needed")
            if target_replicas > len(self.targets):
                self._add_targets(target_replicas - len(self.targets))
                self._push_targets()
            elif target_replicas < len(self.targets):
                removed, self.targets = self.targets[target_replicas:], self.targets[:target_replicas]
                self._push_targets()
                self._drain()
                self._stop(removed)
        return self.status()

    def down(self) -> None:
        """Stop everything: the gateway first (no new requests), then targets, then drafts."""
        if self.gateway is not None:
            try:
                ray.get(self.gateway.stop.remote(), timeout=30)
            finally:
                ray.kill(self.gateway)
                self.gateway = None
        self._stop(self.targets)
        self._stop(self.drafts)
        self.targets, self.drafts = [], []

    def status(self) -> dict:
        return {
            "url": self.url,
            "drafts": [self._describe(r) for r in self.drafts],
            "targets": [self._describe(r) for r in self.targets],
            "target_tp": self.cfg.target_tp,
        }

    # ------------------------------------------------------------------------ internals

    @staticmethod
    def _describe(r: Replica) -> dict:
        return {"name": r.name, "address": r.address, "metrics": r.metrics, "pid": r.pid}

    def _add_drafts(self, n: int) -> None:
        cfg = self.cfg
        argv = ["draft", "--model", cfg.draft_model, "--dtype", cfg.dtype, "--device", cfg.device]
        if not cfg.gpus:
            argv += ["--threads", str(max(1, int(cfg.cpus_per_draft)))]
        new = []
        for _ in range(n):
            self._names.drafts += 1
            name = f"draft-{self._names.drafts}"
            actor = ServiceActor.options(num_cpus=cfg.cpus_per_draft, num_gpus=cfg.gpus).remote(name, cfg.log_dir)
            new.append(Replica(name, actor))
        self._start(new, argv)
        self.drafts += new

    def _add_targets(self, n: int) -> None:
        cfg = self.cfg
        argv = ["target", "--model", cfg.target_model, "--dtype", cfg.dtype, "--device", cfg.device]
        if cfg.num_speculative_tokens is not None:
            argv += ["--num-speculative-tokens", str(cfg.num_speculative_tokens)]
        argv += ["--tensor-parallel-size", str(cfg.target_tp)]
        if self.drafts:
            argv += ["--draft-address", ",".join(d.address for d in self.drafts)]
        new = []
        for _ in range(n):
            self._names.targets += 1
            name = f"target-{self._names.targets}"
            # One bundle holding all of a replica's ranks: the target starts its ranks itself, one
            # per visible GPU, so they must be granted to the one actor, on one node.
            bundle = {"CPU": cfg.cpus_per_target_rank * cfg.target_tp}
            if cfg.gpus:
                bundle["GPU"] = cfg.target_tp
            pg = placement_group([bundle], strategy="STRICT_PACK", name=f"specd-{name}")
            ray.get(pg.ready(), timeout=cfg.start_timeout)
            actor = ServiceActor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(name, cfg.log_dir)
            new.append(Replica(name, actor, pg=pg))
        self._start(new, argv)
        self.targets += new

    def _start(self, replicas: list[Replica], argv: list[str]) -> None:
        """Start all of them at once and wait; on any failure stop the lot and raise."""
        refs = [r.actor.start.remote(argv, self.cfg.start_timeout) for r in replicas]
        try:
            for r, info in zip(replicas, ray.get(refs, timeout=self.cfg.start_timeout + 30)):
                r.address, r.metrics, r.pid = info["address"], info["metrics"], int(info["pid"])
        except BaseException:
            self._stop(replicas)
            raise

    def _push_drafts(self) -> None:
        addresses = [d.address for d in self.drafts]
        for t in self.targets:
            with grpc.insecure_channel(t.address) as ch:
                target_pb2_grpc.TargetServiceStub(ch).SetDrafts(
                    target_pb2.DraftAddresses(addresses=addresses), timeout=10
                )

    def _push_targets(self) -> None:
        ray.get(self.gateway.set_targets.remote([t.address for t in self.targets]), timeout=30)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        while ray.get(self.gateway.draining_requests.remote(), timeout=30) > 0:
            if time.monotonic() > deadline:
                log.warning("removed targets still have requests after %.0f s; stopping them", self.cfg.drain_timeout)
                return
            time.sleep(0.2)

    def _stop(self, replicas: list[Replica]) -> None:
        for r in replicas:
            try:
                ray.get(r.actor.stop.remote(), timeout=30)
            except Exception:  # a dead actor: its process is gone with it
                log.warning("could not stop %s cleanly", r.name)
            ray.kill(r.actor)
            if r.pg is not None:
                remove_placement_group(r.pg)


ControllerActor = ray.remote(Controller)


def get_controller() -> ray.actor.ActorHandle:
    """The running deployment's controller (``ray.init`` must have been called with the namespace)."""
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
