"""Pinning ``specd serve``'s processes to disjoint CPU cores: separate hardware in miniature.

With ``--pin-cores`` the draft service and the gateway run on one set of cores and the target on
another, each model process with as many torch (and OpenMP) threads as it has cores. Drafting ahead
(services/draft/ahead.py) then uses time the draft would otherwise spend idle, instead of taking
cycles the target needs, as it does when both float over the same cores: :func:`competes` tells a
target whether that is so for one of its drafts (from the draft's :class:`Placement`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def parse_cores(text: str) -> frozenset[int]:
    """A core list as taskset writes it: ``0``, ``0,2``, ``0-3``, ``0-1,4``."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a core list: {text!r} (e.g. 0, 0-1, 0,2)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a core list: {text!r} ({part} runs backwards)")
        cores.update(range(first, last + 1))
    return frozenset(cores)


@dataclass(frozen=True)
class CorePlan:
    """Which cores the draft (with the gateway) and the target may run on."""

    draft: frozenset[int]
    target: frozenset[int]

    def __post_init__(self) -> None:
        if not self.draft or not self.target:
            raise ValueError("--pin-cores: both sides need at least one core")
        if self.draft & self.target:
            raise ValueError(
                f"--pin-cores: the draft's and the target's cores overlap ({sorted(self.draft & self.target)})"
            )

    @classmethod
    def parse(cls, spec: str, available: frozenset[int] | None = None) -> CorePlan:
        """``auto``: the first two cores this process may use, the draft and gateway on the first,
        the target on the second (one core each). Else ``DRAFT:TARGET`` core lists, e.g. ``0:1`` or
        ``0:1-3``, which must be cores this process may use."""
        available = frozenset(os.sched_getaffinity(0)) if available is None else available
        if spec == "auto":
            cores = sorted(available)
            if len(cores) < 2:
                raise ValueError(f"--pin-cores needs at least 2 usable cores; this process has {len(cores)}")
            return cls(frozenset({cores[0]}), frozenset({cores[1]}))
        draft, sep, target = spec.partition(":")
        if not sep:
            raise ValueError(f"--pin-cores: 'auto' or DRAFT_CORES:TARGET_CORES (e.g. 0:1), got {spec!r}")
        plan = cls(parse_cores(draft), parse_cores(target))
        unusable = (plan.draft | plan.target) - available
        if unusable:
            raise ValueError(f"--pin-cores: cores {sorted(unusable)} are not available (usable: {sorted(available)})")
        return plan

    def cores_of(self, role: str) -> frozenset[int]:
        """The cores of a ``specd serve`` child: "target", or "draft" / "gateway" (which share)."""
        return self.target if role == "target" else self.draft

    def threads_of(self, role: str) -> int:
        return len(self.cores_of(role))


def pin_then(cores: frozenset[int], then: Callable[[], None]) -> Callable[[], None]:
    """A ``preexec_fn`` that restricts the child to ``cores`` and then runs ``then`` (the child's
    own threads, OpenMP's included, inherit the mask)."""

    def preexec() -> None:
        os.sched_setaffinity(0, cores)
        then()

    return preexec


@dataclass(frozen=True)
class Placement:
    """Where a process computes: its machine (this boot of it), the cores it may use, its compute
    threads and its torch device."""

    host_id: str  # "" when unknown: then never taken for the same machine as another
    cores: frozenset[int]
    threads: int
    device: str

    @classmethod
    def of_this_process(cls, threads: int, device: str) -> Placement:
        try:
            host_id = BOOT_ID.read_text().strip()
        except OSError:
            host_id = ""
        return cls(host_id, frozenset(os.sched_getaffinity(0)), threads, device)


def competes(a: Placement, b: Placement) -> bool:
    """Whether two processes would take each other's compute: on one machine, on one accelerator,
    or on CPUs where they may share cores and their threads outnumber the cores they may use."""
    if not a.host_id or a.host_id != b.host_id:
        return False
    if a.device != "cpu" or b.device != "cpu":
        return a.device == b.device
    return bool(a.cores & b.cores) and a.threads + b.threads > len(a.cores | b.cores)
