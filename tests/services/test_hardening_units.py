"""Pure pieces of the hardening: TLS flag parsing, the drain state, the raw-JSON check."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from specd.gateway.schemas import MAX_JSON_DEPTH, check_raw_json
from specd.services.common.drain import Drain
from specd.services.common.tls import TLSConfig

REPO = Path(__file__).resolve().parents[2]


def test_tls_flags_go_together_and_must_be_pem(tmp_path) -> None:
    assert TLSConfig.from_files(None, None, None) is None
    with pytest.raises(ValueError, match="missing --tls-key, --tls-ca"):
        TLSConfig.from_files("a.crt", None, None)
    with pytest.raises(ValueError, match="--tls-server-name needs"):
        TLSConfig.from_files(None, None, None, "draft")
    with pytest.raises(ValueError, match="--tls-cert .*missing.crt"):
        TLSConfig.from_files(str(tmp_path / "missing.crt"), str(tmp_path / "k"), str(tmp_path / "ca"))
    junk = tmp_path / "junk"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        TLSConfig.from_files(str(junk), str(junk), str(junk))
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(REPO / "scripts" / "dev-certs.sh"), str(certs), "one"], check=True, capture_output=True)
    tls = TLSConfig.from_files(str(certs / "one.crt"), str(certs / "one.key"), str(certs / "ca.crt"), "draft")
    assert tls.cert.startswith(b"-----BEGIN CERTIFICATE") and tls.channel_options() == [
        ("grpc.ssl_target_name_override", "draft")
    ]
    tls.server_credentials(), tls.channel_credentials()  # grpc accepts them


def test_drain_starts_once_and_expires() -> None:
    d = Drain(timeout=0.0)
    assert not d.draining and not d.expired()
    assert d.begin() and d.draining and d.expired()
    assert not d.begin()  # the second signal: the caller stops at once instead
    with pytest.raises(ValueError):
        Drain(-1)


def _nest(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"messages": [{"role": "user", "content": "fine\ttabs\nand newlines\r"}]}, None),
        ({"a": _nest(MAX_JSON_DEPTH)}, None),
        ({"a": _nest(MAX_JSON_DEPTH + 1)}, "nests deeper"),
        ({"a": _nest(100_000)}, "nests deeper"),  # iterative: no RecursionError
        ({"messages": [{"content": "x\ud800"}]}, "messages.content: text holds a lone UTF-16 surrogate"),
        ({"k\udfff": 1}, "surrogate"),
        ({"prompt": "a\x00b"}, "prompt: control character U+0000"),
        ({"stop": ["\x1b"]}, "control character U+001B"),
    ],
)
def test_raw_json_check(value, error) -> None:
    if error is None:
        check_raw_json(value)
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            check_raw_json(value)
