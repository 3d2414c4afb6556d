"""The SDK installs and imports without the server's packages (issue 37, docs/packaging.md).

Each case runs in a fresh interpreter whose import system refuses every package that only
the extras install (torch, transformers, numpy, redis, ...), as a `pip install splitserve`
environment would lack them: the SDK's whole import graph must stay inside grpcio and
protobuf, and the `splitserve` command must name the extra it needs instead of a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Top-level modules of what only the extras install.
EXTRA_ONLY = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "huggingface_hub", "redis", "fastapi",
              "starlette", "pydantic", "uvicorn", "uvloop", "scipy", "matplotlib", "typer", "rich", "httpx", "yaml",
              "opentelemetry", "prometheus_client", "xxhash", "gguf", "accelerate", "aiconfigurator_core",
              "grpc_health", "nixl", "grpc_tools")  # grpc_tools: dev only; grpc imports it when present
BASE_MODULES = {"grpc", "google", "typing_extensions"}  # grpcio, protobuf and what they pull in

BLOCK = f"""
import sys
BLOCKED = {EXTRA_ONLY!r}
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[name]
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_the_sdk_imports_and_builds_clients_without_the_server_packages():
    out = _run("""
import asyncio, json
import splitserve.client as sdk
from splitserve.client import AsyncClient, Client, GenerateOptions, build_generate_request

request = build_generate_request("hello", GenerateOptions(max_tokens=4))
with Client("127.0.0.1:1", timeout_s=1) as client:
    pass

async def open_async():
    async with AsyncClient("127.0.0.1:1", timeout_s=1):
        pass

asyncio.run(open_async())
# (leading "_" and cython_runtime: interpreter and extension internals, .pth hooks)
third_party = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names)
                     - {"splitserve", "__main__", "cython_runtime"})
third_party = [m for m in third_party if not m.startswith("_")]
print(json.dumps({"max_tokens": request.sampling.max_tokens, "third_party": third_party}))
""")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["max_tokens"] == 4
    assert set(got["third_party"]) <= BASE_MODULES, got["third_party"]


def test_the_blocker_does_block():
    """The check above means something: a server module cannot be imported under the same blocker."""
    out = _run("import workers.engine.model_runner")
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr


def test_the_command_names_the_extra_it_needs():
    for command, extra in (("up", "server"), ("bench", "bench")):
        out = _run("import sys; sys.argv = ['splitserve', sys.argv[1]]\nfrom splitserve.entry import main; main()",
                   command)
        assert out.returncode == 1, out.stderr[-3000:]
        assert f'pip install "splitserve[{extra}]"' in out.stderr and "Traceback" not in out.stderr, out.stderr
