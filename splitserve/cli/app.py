"""The `splitserve` command: every subcommand mounted on one typer app.

`up`, `status` and the demo commands are mounted as they are defined (their modules import
their heavy dependencies inside the commands). The others load their modules only when
they are looked up — run, or listed by the top-level help: the load generator and the simulator
cost ~0.3 s of imports that `splitserve plan` (timed against a 5 s target at 256 GPUs) and a
service process do not need, and `splitserve simulate` runs without grpc.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import typer
from typer.core import TyperCommand, TyperGroup

from splitserve.cli import demo, status, up


@dataclass(frozen=True)
class LazyCommand:
    """A command by where it lives: `module.attribute`, a typer app (a group of commands, whose help
    `help` replaces) or a command function."""

    module: str
    attribute: str
    help: str | None = None

    def load(self, name: str) -> TyperCommand | TyperGroup:
        target = getattr(importlib.import_module(self.module), self.attribute)
        if isinstance(target, typer.Typer):
            group = typer.main.get_group(target)
            group.name, group.help = name, self.help or group.help
            return group
        single = typer.Typer(add_completion=False)
        single.command(name)(target)
        return typer.main.get_command(single)


LAZY_COMMANDS = {
    "profile": LazyCommand("splitserve.cli.profile", "profile_command"),
    "plan": LazyCommand("services.planner.plan_cli", "plan_command"),
    "hash-key": LazyCommand("splitserve.keys", "hash_key_command"),
    "chaos": LazyCommand("splitserve.cli.chaos", "chaos_command"),
    "serve": LazyCommand("splitserve.cli.serve", "serve_app"),
    "bench": LazyCommand("loadgen.cli", "bench_app",
                         "Load generator: measure a splitserve or any OpenAI-compatible endpoint."),
    "simulate": LazyCommand("services.planner.cli", "simulate_app",
                            "Discrete-event simulator: the real policies in virtual time."),
}


class LazyGroup(TyperGroup):
    """The top-level group: LAZY_COMMANDS join the mounted commands when first looked up."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in LAZY_COMMANDS if name not in self.commands)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> TyperCommand | TyperGroup | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            self.add_command(LAZY_COMMANDS[cmd_name].load(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(cls=LazyGroup, help="splitserve: distributed LLM serving.", no_args_is_help=True,
                  add_completion=False)
app.command("demo-model")(demo.demo_model)
app.command()(demo.generate)
app.command("run-demo")(demo.run_demo)
app.command()(up.up)
app.command()(status.status)


def main() -> None:
    logging.basicConfig(level=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING"))
    app()
