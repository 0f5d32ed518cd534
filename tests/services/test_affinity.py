"""Core plans for ``--pin-cores`` and the test of whether a draft competes with its target."""

from __future__ import annotations

import pytest

from specd.services.common.affinity import CorePlan, Placement, competes
from specd.services.common.convert import placement_from_pb, placement_to_pb


def _cpu(cores: set[int], threads: int, host: str = "boot-1") -> Placement:
    return Placement(host, frozenset(cores), threads, "cpu")


def test_processes_compete_when_they_share_cores_and_their_threads_outnumber_them() -> None:
    # specd serve unpinned on 2 cores: a 2-thread target and a 1-thread draft on both cores.
    assert competes(_cpu({0, 1}, 2), _cpu({0, 1}, 1))
    # --pin-cores: disjoint cores, one thread each.
    assert not competes(_cpu({1}, 1), _cpu({0}, 1))
    # Shared cores with room to spare (a 16-thread target and a 1-thread draft on 64 cores).
    assert not competes(_cpu(set(range(64)), 16), _cpu(set(range(64)), 1))
    # Overlapping sets, three cores between them: three threads fit, four do not.
    assert not competes(_cpu({0, 1}, 2), _cpu({1, 2}, 1))
    assert competes(_cpu({0, 1}, 2), _cpu({1, 2}, 2))


def test_other_machines_and_unknown_ones_never_compete_accelerators_only_on_the_same_device() -> None:
    assert not competes(_cpu({0, 1}, 2, "boot-1"), _cpu({0, 1}, 2, "boot-2"))
    assert not competes(_cpu({0, 1}, 2, ""), _cpu({0, 1}, 2, ""))  # host unknown: not taken as one
    gpu0 = Placement("boot-1", frozenset({0, 1}), 1, "cuda:0")
    gpu1 = Placement("boot-1", frozenset({0, 1}), 1, "cuda:1")
    assert competes(gpu0, gpu0)
    assert not competes(gpu0, gpu1)
    assert not competes(gpu0, _cpu({0, 1}, 1))  # the target on a GPU, the draft on spare CPU


def test_placement_round_trips_through_the_wire() -> None:
    p = Placement.of_this_process(3, "cpu")
    assert p.cores and p.threads == 3
    assert placement_from_pb(placement_to_pb(p)) == p


def test_core_plans_parse_and_refuse_overlaps_and_missing_cores() -> None:
    plan = CorePlan.parse("0:1-3", frozenset(range(4)))
    assert plan.draft == {0} and plan.target == {1, 2, 3} and plan.threads_of("target") == 3
    assert CorePlan.parse("auto", frozenset({2, 5})) == CorePlan(frozenset({2}), frozenset({5}))
    for bad in ("0-1:1", "0:7", "0", "auto:"):
        with pytest.raises(ValueError):
            CorePlan.parse(bad, frozenset(range(4)))
