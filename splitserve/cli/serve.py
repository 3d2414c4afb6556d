"""`splitserve serve SERVICE`: one service, its options the service config's fields (what
compose and Kubernetes run, and what `splitserve up` starts)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer

from splitserve.cli.models import config_model_by_name, quiet_hf


def _config_command(service: str):
    """A typer command whose options are the service config's fields (flag + env var)."""
    import inspect

    from splitserve import config as cfg

    cls = cfg.SERVICE_CONFIGS[service]
    params = []
    for f in dataclasses.fields(cls):
        typ = cfg.field_type(cls, f)
        dashed = f.name.replace("_", "-")
        decls = [f"--{dashed}/--no-{dashed}"] if typ is bool else [f"--{dashed}"]
        annotation = Optional[typ if typ in (bool, int, float) else str]
        option = typer.Option(None, *decls, help=f.metadata.get("help", ""), envvar=cfg.env_var(cls, f),
                              show_envvar=True, show_default=False)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))

    def command(**values):
        overrides = {k: v for k, v in values.items() if v is not None}
        try:
            for f in dataclasses.fields(cls):
                if isinstance(overrides.get(f.name), str):
                    overrides[f.name] = cfg.parse_value(overrides[f.name], cfg.field_type(cls, f), "--" + f.name)
            config = cfg.load_config(cls, overrides, environ={})
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        config = config_model_by_name(config)  # before quiet_hf(): a download follows the user's HF_HUB_OFFLINE
        quiet_hf()
        _SERVICE_MAINS[service]()(config)

    command.__signature__ = inspect.Signature(params)
    command.__doc__ = f"Run the {service} service (every option is also an env var)."
    return command


def _service_main(module: str):
    def load():
        import importlib

        return importlib.import_module(module).main

    return load


_SERVICE_MAINS = {
    "worker": _service_main("workers.server"),
    "scheduler": _service_main("services.global_scheduler.server"),
    "coordinator": _service_main("services.coordinator.server"),
    "gateway": _service_main("gateway.server"),
}


serve_app = typer.Typer(help="Run one service (what compose and Kubernetes run).", no_args_is_help=True)
for _service in _SERVICE_MAINS:
    serve_app.command(_service)(_config_command(_service))
