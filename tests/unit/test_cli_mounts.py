"""`splitserve` imports a lazily mounted command's modules only when that command runs (or for
the top-level help): `plan` is timed against a 5 s target and a service process needs none."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
sys.argv = ["splitserve", *{argv!r}]
import splitserve.cli as cli
names = sorted(c.name for c in cli.app.registered_commands if c.name) + sorted(g.name for g in cli.app.registered_groups)
print(names)
print("loadgen.cli" in sys.modules, "services.planner.cli" in sys.modules, "services.planner.plan_cli" in sys.modules)
"""


def _probe(*argv: str) -> tuple[list[str], list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=list(argv))], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    return eval(out[0]), out[1].split()  # noqa: S307 (our own repr)


def test_plan_mounts_only_plan_and_imports_no_load_generator():
    names, imported = _probe("plan", "--gpus", "8")
    assert {"plan", "serve"} <= set(names) and not {"bench", "simulate", "chaos", "profile"} & set(names)
    assert imported == ["False", "False", "True"]


def test_serve_mounts_none_and_help_or_other_commands_mount_all():
    names, imported = _probe("serve", "worker")
    assert not {"plan", "bench", "simulate"} & set(names) and imported == ["False", "False", "False"]
    for argv in ((), ("--help",), ("up", "--workers", "2")):
        names, imported = _probe(*argv)
        assert {"plan", "bench", "simulate", "chaos", "profile", "hash-key"} <= set(names), argv
        assert imported == ["True", "True", "True"]
