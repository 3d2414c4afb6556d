"""Certificates for the TLS tests: scripts/make_certs.py's local CA, made once per test session dir."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_test_certs(out: Path, key_owner: tuple[int, int] | None = None) -> dict[str, Path]:
    """Run scripts/make_certs.py's `make_certs` into `out`: ca, service, gateway, client (+ _key);
    `key_owner` as its --key-owner."""
    spec = importlib.util.spec_from_file_location("make_certs", REPO_ROOT / "scripts" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_certs(out, days=2, key_owner=key_owner)
