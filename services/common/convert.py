"""Shared messages between their dataclasses and the wire: specd.v1.SamplingParams, specd.v1.Placement."""

from __future__ import annotations

from typing import Any

from specd.services.common.affinity import Placement
from specd.services.engine.sampling import SamplingParams
from specd.v1 import common_pb2


def sampling_from_pb(s: common_pb2.SamplingParams, **request_fields: Any) -> SamplingParams:
    """The engine's SamplingParams; ``request_fields`` adds what the wire message does not carry
    (max_tokens, stop, ignore_eos). An unset top_p (0) means top-p off."""
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.top_p > 0 else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        **request_fields,
    )


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    """What a draft needs: the fields that shape a distribution (to build the same q as the
    target's p), and the seed, which tells it that the request is seeded (draft.proto's
    Block.prefilling says why)."""
    return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


def placement_to_pb(p: Placement) -> common_pb2.Placement:
    return common_pb2.Placement(host_id=p.host_id, cores=sorted(p.cores), threads=p.threads, device=p.device)


def placement_from_pb(p: common_pb2.Placement) -> Placement:
    return Placement(p.host_id, frozenset(p.cores), p.threads, p.device)
