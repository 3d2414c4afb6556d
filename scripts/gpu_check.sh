#!/usr/bin/env bash
# GPU check (issue 34, item 6): the engine's CUDA paths measured once on a GPU machine.
#
# How to run it
#   On the GPU machine (the `device` tool runs this from the repository root of a copy of the
#   work tree, with $OUT naming an empty folder whose files come back):
#       bash scripts/gpu_check.sh
#   Anywhere, by hand:
#       OUT=/tmp/gpu_check bash scripts/gpu_check.sh            # the real run (needs CUDA)
#       bash scripts/gpu_check.sh --cpu-smoke                     # tiny shapes on the CPU, < 1 min
#       GPU_CHECK_CPU_SMOKE=1 bash scripts/gpu_check.sh           # the same
#       bash scripts/gpu_check.sh --only token_exact,kv_digest    # some sub-checks only
#   Then, on a machine with aiconfigurator_core (this project's .venv):
#       .venv/bin/python benchmarks/gpu_check_compare.py $OUT/grid.json
#
# What it needs: python3 with torch (CUDA build) and transformers (with what they bring:
# safetensors, tokenizers, numpy). Nothing is installed or downloaded; the project is not
# pip-installed: its source is imported from this checkout. No Redis, no flash-attn, no
# aiconfigurator. $PYTHON picks the interpreter; otherwise the first of python3, python,
# .venv/bin/python whose torch sees CUDA (--cpu-smoke: whose torch imports, .venv first).
#
# What it does (benchmarks/gpu_check.py has the details), each sub-check in its own process
# with its own time limit, one failing never stopping the rest, the whole run under 10 min
# (560 s of sub-checks, 585 s hard limit here):
#   env              torch/CUDA/GPU and which optional modules exist
#   token_exact      the engine on CUDA vs transformers greedy, token for token (tiny Llama, Qwen2;
#                    one by one, batched, chunked prefill)
#   kv_digest        KV digests computed on the device vs the same digest on the CPU
#   grid             mixed-step latencies of a Llama-3-8B-shaped bf16 model on the engine's
#                    model runner: chunk {0,128,512,2048} x history {0,2048} x decode batch
#                    {0,1,16,64} x decode context {512,4096}  -> $OUT/grid.json
#   captured_shapes  CUDA-graph replay of captured shapes vs eager: same tokens, step times
# Output: $OUT/gpu_check.json (everything), $OUT/<sub-check>.json, $OUT/logs/<sub-check>.log,
# and a short summary on stdout. Exit code 0 when no sub-check failed or errored.
set -u
cd "$(dirname "$0")/.."

OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
export OUT

smoke=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && smoke=1; done
[ "${GPU_CHECK_CPU_SMOKE:-0}" = "1" ] && smoke=1

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ "$smoke" = 1 ]; then
    candidates=".venv/bin/python python3 python"
    probe='import torch'
  else
    candidates="python3 python .venv/bin/python"
    probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
  fi
  for c in $candidates; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "$probe" >/dev/null 2>&1; then PY="$c"; break; fi
  done
  if [ -z "$PY" ]; then  # no CUDA anywhere: run anyway with the first torch, so the JSON says so
    for c in python3 python .venv/bin/python; do
      if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then PY="$c"; break; fi
    done
  fi
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no python with torch found (set PYTHON=...)" >&2
  printf '{"status": "error", "reason": "no python with torch found"}\n' > "$OUT/gpu_check.json"
  exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
# The CPU smoke keeps the engine's torch path: no compile of the CPU kernels (~30 s) in a quick check.
[ "$smoke" = 1 ] && export SPLITSERVE_CPU_KERNELS="${SPLITSERVE_CPU_KERNELS:-0}"

echo "gpu_check: python=$PY out=$OUT $([ "$smoke" = 1 ] && echo '(CPU smoke)')"
if command -v timeout >/dev/null 2>&1; then
  timeout -k 10 585 "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
else
  "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
fi
