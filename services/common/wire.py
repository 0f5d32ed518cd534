"""The speculation method between its name (SPECULATION_METHODS) and the wire's SpeculationMethod.

The gateway converts out with it and the target in; no torch here (the gateway never loads it).
"""

from __future__ import annotations

from specd.services.common.constants import SPECULATION_METHODS
from specd.v1 import common_pb2

_TO_PB = {m: common_pb2.SpeculationMethod.Value(f"SPECULATION_METHOD_{m.upper()}") for m in SPECULATION_METHODS}
_FROM_PB = {v: m for m, v in _TO_PB.items()}


def method_to_pb(method: str | None) -> int:
    """A SpeculationMethod from one of SPECULATION_METHODS (None: UNSPECIFIED, the server's default)."""
    return common_pb2.SPECULATION_METHOD_UNSPECIFIED if method is None else _TO_PB[method]


def method_from_pb(value: int) -> str | None:
    """One of SPECULATION_METHODS, or None for UNSPECIFIED; ValueError for a number this version
    does not know."""
    if value == common_pb2.SPECULATION_METHOD_UNSPECIFIED:
        return None
    try:
        return _FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown speculation method {value}") from None


def methods_to_pb(methods: tuple[str, ...]) -> list[int]:
    return [_TO_PB[m] for m in methods]


# Generate's INVALID_ARGUMENT carries a serialized target_pb2.RequestError under this key.
REQUEST_ERROR_METADATA_KEY = "specd-request-error-bin"
