"""`splitserve simulate` runs where torch, gRPC and Redis cannot be imported: the planner's user needs none of them.

The simulation runs in a fresh interpreter whose import system refuses those packages (as
if they were not installed), through the real `splitserve` command, so every import on
the way counts: `splitserve.cli`, the bench/simulate option module, the simulator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "grpc", "redis")

# Run by `python -c`; argv[1] is the output directory. Prints the command's exit code and output as JSON.
SIMULATE_WITHOUT_THEM = """
import importlib.abc
import json
import sys

BLOCKED = {blocked!r}


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
out_dir = sys.argv[1]

from typer.testing import CliRunner

from splitserve.cli.app import app

result = CliRunner().invoke(app, ["simulate", "--workers", "2", "--shape", "P256/D16", "-n", "20",
                                  "--arrival", "poisson:rate=20", "--out-dir", out_dir])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not loaded, f"imported although blocked: {{loaded}}"
print(json.dumps({{"exit_code": result.exit_code, "output": result.output, "exception": repr(result.exception)}}))
"""


def test_simulate_runs_without_torch_grpc_or_redis(tmp_path):
    script = SIMULATE_WITHOUT_THEM.format(blocked=BLOCKED)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["exit_code"] == 0, f"{result['output']}\n{result['exception']}"
    summary = json.loads((tmp_path / "simulate.json").read_text())["summary"]
    assert (summary["n_requests"], summary["n_ok"], summary["n_failed"]) == (20, 20, 0)
