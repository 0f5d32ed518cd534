"""``specd ray up | scale | status | down``: specd on a Ray cluster.

Each command connects to an existing cluster (``--address``, default ``auto``: the one started on
this machine with ``ray start --head``) and talks to the detached controller actor, so ``up``
returns once everything serves and the deployment outlives the command.
"""

from __future__ import annotations

import argparse
import json

from specd.services.paths import DEMO_DRAFT, DEMO_TARGET


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("ray", help="deploy on a Ray cluster: draft and target workers as Ray actors")
    rs = r.add_subparsers(dest="ray_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto", help="Ray cluster address (default: auto, the local head)")

    up = rs.add_parser("up", help="start drafts, targets and the gateway")
    common(up)
    up.add_argument("--draft-replicas", type=int, default=1)
    up.add_argument("--target-replicas", type=int, default=1)
    up.add_argument("--target-tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    up.add_argument("--target", default=str(DEMO_TARGET), help="target model dir or hub id")
    up.add_argument("--draft", default=str(DEMO_DRAFT), help="draft model dir or hub id")
    up.add_argument("--no-draft", action="store_true", help="no draft workers (n-gram or no speculation only)")
    up.add_argument("--host", default="0.0.0.0", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument("--api-key", default=None)
    up.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    up.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU per draft and per target rank")
    up.add_argument("--cpus-per-draft", type=float, default=1.0)
    up.add_argument("--cpus-per-target-rank", type=float, default=1.0)
    up.add_argument("--num-speculative-tokens", type=int, default=None, help="the targets' default k")
    up.add_argument("--log-dir", default="/tmp/specd-ray", help="service logs, on each node")
    up.set_defaults(func=cmd_up)

    sc = rs.add_parser("scale", help="change the number of draft and/or target replicas, live")
    common(sc)
    sc.add_argument("--draft-replicas", type=int, default=None)
    sc.add_argument("--target-replicas", type=int, default=None)
    sc.set_defaults(func=cmd_scale)

    st = rs.add_parser("status", help="print the deployment's replicas as JSON")
    common(st)
    st.set_defaults(func=cmd_status)

    dn = rs.add_parser("down", help="stop the deployment")
    common(dn)
    dn.set_defaults(func=cmd_down)


def _connect(address: str) -> None:
    import ray

    from specd.services.ray_cluster.controller import NAMESPACE

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")


def _controller():
    from specd.services.ray_cluster.controller import get_controller

    try:
        return get_controller()
    except ValueError:
        raise SystemExit("no specd deployment on this Ray cluster (run `specd ray up` first)") from None


def cmd_up(args: argparse.Namespace) -> int:
    import ray

    from specd.services.ray_cluster.controller import CONTROLLER_NAME, NAMESPACE, ControllerActor, RayDeployConfig

    _connect(args.address)
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        raise SystemExit("specd is already up on this cluster: use `specd ray scale` or `specd ray down`")
    except ValueError:
        pass
    cfg = RayDeployConfig(
        target_model=args.target,
        draft_model=None if args.no_draft else args.draft,
        draft_replicas=args.draft_replicas,
        target_replicas=args.target_replicas,
        target_tp=args.target_tp,
        gateway_host=args.host,
        gateway_port=args.port,
        gateway_node=ray.get_runtime_context().get_node_id(),  # the URL is on the node you ran `up` on
        api_key=args.api_key,
        dtype=args.dtype,
        device=args.device,
        cpus_per_draft=args.cpus_per_draft,
        cpus_per_target_rank=args.cpus_per_target_rank,
        num_speculative_tokens=args.num_speculative_tokens,
        log_dir=args.log_dir,
    )
    controller = ControllerActor.options(name=CONTROLLER_NAME, lifetime="detached", num_cpus=0).remote(cfg)
    try:
        status = ray.get(controller.up.remote())
    except BaseException:
        try:
            ray.get(controller.down.remote(), timeout=120)
        finally:
            ray.kill(controller)
        raise
    print(json.dumps(status, indent=2))
    print(f"specd is ready: {status['url']}/v1 (OpenAI API)", flush=True)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    import ray

    if args.draft_replicas is None and args.target_replicas is None:
        raise SystemExit("give --draft-replicas and/or --target-replicas")
    _connect(args.address)
    status = ray.get(_controller().scale.remote(args.draft_replicas, args.target_replicas))
    print(json.dumps(status, indent=2), flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    _connect(args.address)
    print(json.dumps(ray.get(_controller().status.remote()), indent=2), flush=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    import ray

    _connect(args.address)
    controller = _controller()
    try:
        ray.get(controller.down.remote())
    finally:
        ray.kill(controller)
    print("specd is down", flush=True)
    return 0
