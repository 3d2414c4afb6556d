"""The `splitserve` console script.

`pip install splitserve` is the SDK alone (grpcio, protobuf: docs/packaging.md); the command
needs an extra. Without it a missing module would end in a traceback from deep inside an
import; here it ends in one line naming the extra that brings it.
"""

from __future__ import annotations

import sys

# Top-level modules of the extras' packages -> the extra that installs them (pyproject.toml).
EXTRA_OF_MODULE = {
    **dict.fromkeys(("typer", "rich", "httpx", "numpy"), "bench"),  # also in server: bench is the smaller
    **dict.fromkeys(("torch", "transformers", "huggingface_hub", "safetensors", "tokenizers", "grpc_health", "redis",
                     "uvloop", "fastapi", "uvicorn", "prometheus_client", "scipy", "yaml", "xxhash",
                     "aiconfigurator_core"), "server"),
    **dict.fromkeys(("gguf", "accelerate"), "gguf"),
    "matplotlib": "plots",
    "nixl": "nixl",
}


def missing_extra_message(module: str, command: list[str]) -> str | None:
    """The line to print when `module` is not installed, or None for a module no extra brings."""
    top = module.split(".")[0]
    if module.startswith("opentelemetry.exporter"):
        extra = "tracing"
    elif top == "opentelemetry":
        extra = "server"
    else:
        extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    if extra == "bench" and command[:1] not in (["bench"], ["--help"], []):
        extra = "server"  # only `splitserve bench` runs on the bench extra alone
    return (f"splitserve: {module} is not installed; this command needs the {extra} extra: "
            f"pip install \"splitserve[{extra}]\" (or \"splitserve[all]\")")


def main() -> None:
    try:
        from splitserve.cli import main as cli_main

        cli_main()
    except ModuleNotFoundError as err:
        message = missing_extra_message(err.name or "", sys.argv[1:2])
        if message is None:
            raise
        sys.exit(message)


if __name__ == "__main__":
    main()
