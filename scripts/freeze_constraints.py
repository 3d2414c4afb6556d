"""Write constraints.txt: the exact installed version of every runtime dependency of splitserve.

Runtime: the base dependencies and the extras a deployment installs (server, bench, gguf,
plots, tracing), with every package they pull in, as installed in the virtualenv that runs
this script; not the dev extra's test tools, nor nixl and flash-attn (installed apart, per
machine: docs/packaging.md). A local version label is dropped (torch 2.13.0+cpu pins
torch==2.13.0), so the same file constrains the CPU and the CUDA builds of one release.

    .venv/bin/python scripts/freeze_constraints.py            # rewrite constraints.txt
    .venv/bin/python scripts/freeze_constraints.py --check    # exit 1 when it is stale
    pip install -c constraints.txt "splitserve[server]"       # an install with exactly these
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_EXTRAS = ("server", "bench", "gguf", "plots", "tracing", "structured")
PROJECT = "splitserve"
HEADER = """\
# Exact versions of splitserve's runtime dependencies (base + the extras {extras}) and of every
# package they pull in, as installed where this was generated. Written by
# scripts/freeze_constraints.py (`--check` says whether it is current); used as
#   pip install -c constraints.txt "splitserve[server]"
# `make setup` installs with it. Local version labels are dropped: torch==X matches X+cpu and X+cu128.
"""


def project_requirements(pyproject: Path, extras: tuple[str, ...]) -> list[Requirement]:
    """The base dependencies and those of `extras`, self-references ("splitserve[a,b]") expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted, seen, requirements = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has {', '.join(sorted(optional))})")
        seen.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == PROJECT:
                wanted.extend(req.extras)
            else:
                requirements.append(req)
    return requirements


def installed_closure(requirements: list[Requirement]) -> tuple[dict[str, str], list[str]]:
    """name -> installed version of every package `requirements` need here (markers evaluated for
    this interpreter), and the requirements that are not installed."""
    env = default_environment()
    pins: dict[str, str] = {}
    missing: list[str] = []
    done: set[tuple[str, frozenset[str]]] = set()
    queue = [(req, "") for req in requirements]
    while queue:
        req, extra = queue.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        pins[name] = Version(dist.version).public
        for line in dist.requires or []:
            sub = Requirement(line)
            for wanted_extra in ("", *req.extras):
                if sub.marker is None or sub.marker.evaluate({**env, "extra": wanted_extra}):
                    queue.append((sub, wanted_extra))
                    break
    return pins, missing


def render(pins: dict[str, str]) -> str:
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    return HEADER.format(extras=", ".join(RUNTIME_EXTRAS)) + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    pins, missing = installed_closure(project_requirements(ROOT / "pyproject.toml", RUNTIME_EXTRAS))
    pins.pop(PROJECT, None)
    if missing:
        print(f"not installed here, so not pinned: {', '.join(sorted(missing))}", file=sys.stderr)
    text = render(pins)
    if not args.check:
        args.out.write_text(text)
        print(f"wrote {len(pins)} pins to {args.out}")
        return 0
    current = args.out.read_text() if args.out.exists() else ""
    if current == text:
        print(f"{args.out} is current ({len(pins)} pins)")
        return 0
    sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                               str(args.out), "installed now"))
    print(f"{args.out} is stale: rerun scripts/freeze_constraints.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
