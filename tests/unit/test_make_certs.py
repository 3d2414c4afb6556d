"""scripts/make_certs.py: the files it writes, their modes and owners, its option errors."""

from __future__ import annotations

import importlib.util
import os
import stat

import pytest

from tests.tls_support import REPO_ROOT


def _module():
    spec = importlib.util.spec_from_file_location("make_certs", REPO_ROOT / "scripts" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keys_are_private_and_only_the_services_keys_are_given_to_the_container_user(tmp_path, monkeypatch):
    make_certs = _module()
    given = []
    monkeypatch.setattr(make_certs.os, "geteuid", lambda: 0)  # as root, which may give files away
    monkeypatch.setattr(make_certs.os, "chown", lambda path, uid, gid: given.append((path.name, uid, gid)))
    paths = make_certs.make_certs(tmp_path, days=2, key_owner=(10001, 10001))
    assert sorted(given) == [("gateway.key", 10001, 10001), ("service.key", 10001, 10001)]  # not ca.key, client.key
    for name in ("service_key", "gateway_key", "client_key", "ca_key"):
        assert stat.S_IMODE(paths[name].stat().st_mode) == 0o600, name
    assert stat.S_IMODE(paths["ca"].stat().st_mode) == 0o644


def test_giving_keys_away_without_the_right_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    make_certs = _module()
    monkeypatch.setattr(make_certs.os, "geteuid", lambda: 1234)
    with pytest.raises(PermissionError, match="uid 10001"):
        make_certs.make_certs(tmp_path / "certs", days=2, key_owner=(10001, 10001))
    assert not (tmp_path / "certs").exists()


@pytest.mark.parametrize("text, owner", [("10001", (10001, 10001)), ("10001:0", (10001, 0))])
def test_key_owner_is_uid_or_uid_and_gid(text, owner):
    assert _module().parse_owner(text) == owner


@pytest.mark.parametrize("text", ["splitserve", "10001:", ":5", "1.5"])
def test_a_bad_key_owner_is_refused_naming_the_option(text, capsys):
    with pytest.raises(SystemExit) as exited:
        _module().main(["--out", "/nonexistent/never-written", "--key-owner", text])
    assert exited.value.code == 2 and "--key-owner" in capsys.readouterr().err
