"""Packaging (issue 37): `pip install splitserve` is the SDK without torch; the server and the
optional parts are extras; constraints.txt pins every runtime dependency (docs/packaging.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from splitserve.entry import missing_extra_message

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
RUNTIME_EXTRAS = ("server", "bench", "gguf", "plots", "tracing", "structured")
SERVER_ONLY = {"torch", "transformers", "numpy", "safetensors", "tokenizers", "huggingface-hub", "redis", "fastapi",
               "uvicorn", "scipy", "matplotlib", "typer", "rich", "httpx", "pyyaml", "gguf", "accelerate",
               "opentelemetry-sdk", "prometheus-client", "xxhash", "aiconfigurator-core"}
PACKAGES = ("splitserve", "workers", "services", "gateway", "loadgen")
# Imported directly, installed as part of a declared dependency's own API (fastapi's models and
# responses are pydantic's and starlette's).
PROVIDED_BY = {"starlette": "fastapi", "pydantic": "fastapi"}
# Not installed here (so not in packages_distributions()): the distribution that provides them.
NOT_INSTALLED_HERE = {"flash_attn": "flash-attn", "triton": "triton"}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _expanded(extra: str) -> set[str]:
    """The distributions an extra brings, its "splitserve[...]" self-references followed."""
    names: set[str] = set()
    for line in EXTRAS[extra]:
        req = Requirement(line)
        if canonicalize_name(req.name) == "splitserve":
            for inner in req.extras:
                names |= _expanded(inner)
        else:
            names.add(canonicalize_name(req.name))
    return names


def test_the_base_install_is_the_sdk_without_torch():
    base = _names(PROJECT["dependencies"])
    assert base == {"grpcio", "protobuf"}
    assert not base & SERVER_ONLY


def test_the_server_and_the_optional_parts_are_extras():
    assert {"torch", "transformers", "redis", "fastapi"} <= _names(EXTRAS["server"])
    assert _names(EXTRAS["gguf"]) == {"gguf", "accelerate"} and not _names(EXTRAS["gguf"]) & _names(EXTRAS["server"])
    assert _names(EXTRAS["plots"]) == {"matplotlib"}
    assert _names(EXTRAS["tracing"]) == {"opentelemetry-exporter-otlp-proto-grpc"}
    assert "torch" not in _names(EXTRAS["bench"])
    assert "nixl" in _names(EXTRAS["nixl"])
    # Structured output's grammar engine: imported by a worker only for a request asking for it.
    assert _names(EXTRAS["structured"]) == {"xgrammar"} and "xgrammar" not in _names(EXTRAS["server"])


def test_dev_pulls_the_server_and_every_optional_part():
    """`make setup` installs .[dev]: the tests need every part."""
    runtime = set().union(*(_expanded(extra) for extra in RUNTIME_EXTRAS))
    # xgrammar apart: `make setup` installs it with --no-deps (its triton serves CUDA kernels only).
    assert runtime - _expanded("structured") <= _expanded("dev")
    assert runtime <= _expanded("all")
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps xgrammar apache-tvm-ffi" in makefile


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the shipped packages -> the files importing them."""
    local = set(PACKAGES)
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    declared = _names(PROJECT["dependencies"]) | set().union(*(_names(v) for k, v in EXTRAS.items() if k != "dev"))
    providers = metadata.packages_distributions()
    undeclared = {}
    for module, files in _third_party_imports().items():
        dists = {canonicalize_name(d) for d in providers.get(module, [])} | (
            {NOT_INSTALLED_HERE[module]} if module in NOT_INSTALLED_HERE else set())
        if module in PROVIDED_BY:
            dists.add(PROVIDED_BY[module])
        if not dists & declared:
            undeclared[module] = sorted(files)[:3]
    assert not undeclared, f"imported but not declared in pyproject.toml (base or an extra): {undeclared}"


def _constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_runtime_dependency_within_its_range():
    pins = _constraint_pins()
    env = default_environment()
    runtime = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in RUNTIME_EXTRAS:
        runtime += [Requirement(r) for r in EXTRAS[extra] if canonicalize_name(Requirement(r).name) != "splitserve"]
    for req in runtime:
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt has no pin for {name}: run `make constraints`"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), \
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}"


def test_constraints_are_what_is_installed():
    """`make setup` installs with constraints.txt, so a difference means one of them moved without
    the other: `make constraints` after an upgrade."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "freeze_constraints.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize("module, command, extra", [
    ("torch", ["up"], "server"),
    ("typer", ["up"], "server"),
    ("typer", ["bench"], "bench"),
    ("gguf", ["up"], "gguf"),
    ("matplotlib", ["bench"], "plots"),
    ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", ["serve"], "tracing"),
])
def test_a_missing_extra_is_named(module, command, extra):
    message = missing_extra_message(module, command)
    assert f'pip install "splitserve[{extra}]"' in message and module in message


def test_a_module_no_extra_brings_is_left_to_its_traceback():
    assert missing_extra_message("no_such_module", ["up"]) is None
