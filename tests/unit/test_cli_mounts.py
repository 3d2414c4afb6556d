"""`splitserve` imports a lazily mounted command's modules only when that command is looked up
(run, or listed by the top-level help), never by reading sys.argv at import: `plan` is timed
against a 5 s target and a service process needs none of them."""

from __future__ import annotations

import subprocess
import sys

LAZY = ["bench", "chaos", "hash-key", "plan", "profile", "serve", "simulate"]
HEAVY = ("loadgen.cli", "services.planner.cli", "services.planner.plan_cli")

PROBE = """
import sys
sys.argv = ["splitserve", *{argv!r}]  # what a command line would say: the app must not read it
import typer
from splitserve.cli.app import app
group = typer.main.get_command(app)
ctx = typer.Context(group)
names = group.list_commands(ctx)
for name in {look_up!r}:
    assert group.get_command(ctx, name) is not None, name
print(sorted(names))
print(*[module in sys.modules for module in {heavy!r}])
"""


def _probe(argv: list[str], look_up: list[str]) -> tuple[list[str], list[str]]:
    code = PROBE.format(argv=argv, look_up=look_up, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    return eval(out[0]), out[1].split()  # noqa: S307 (our own repr)


def test_every_command_is_listed_whatever_argv_says_and_none_is_imported_until_looked_up():
    for argv in ([], ["plan", "--gpus", "8"], ["serve", "worker"], ["--help"]):
        names, imported = _probe(argv, [])
        assert set(LAZY) | {"up", "status", "demo-model", "generate", "run-demo"} <= set(names), argv
        assert imported == ["False", "False", "False"], argv


def test_looking_up_plan_imports_no_load_generator_and_serve_imports_none():
    assert _probe([], ["plan"])[1] == ["False", "False", "True"]
    assert _probe([], ["serve"])[1] == ["False", "False", "False"]
    assert _probe([], LAZY)[1] == ["True", "True", "True"]


def test_top_level_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "--help"], capture_output=True, text=True,
                         timeout=60, check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    for name in LAZY + ["up", "status", "demo-model"]:
        assert f" {name} " in out, name
