#!/usr/bin/env bash
# `make wheels`: fill docker/wheelhouse with the exact wheels of this checkout's runtime
# dependencies (the versions installed in .venv, torch's CPU build included), the build
# requirements of the project (setuptools, wheel) and the NIXL wheels, plus
# docker/wheelhouse/constraints.txt pinning them. `docker build` installs from it with
# --no-index when it is not empty: an air-gapped site builds the image with no package index.
#
# Usage: docker/make_wheelhouse.sh [VENV] [OUT]   (defaults: .venv, docker/wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
OUT=${2:-docker/wheelhouse}
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"
[[ -x $PIP ]] || { echo "no virtualenv at $VENV: run make setup first" >&2; exit 2; }
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. What is installed here, exactly (the project itself is editable: left out).
"$PIP" freeze --exclude-editable | grep -v -E '^(-e |splitserve(==| @))' > "$tmp/freeze.txt"
# 2. The runtime closure of the project under those pins (no dev extras): pip's resolver in
#    dry-run mode, constrained to the installed versions.
"$PIP" install -q --dry-run --ignore-installed --report "$tmp/report.json" -c "$tmp/freeze.txt" ".[server,gguf,tracing]" >/dev/null \
  2> >(grep -v 'is ignored: it is neither' >&2)
"$PY" - "$tmp/report.json" "$tmp/freeze.txt" > "$tmp/runtime.txt" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
pins = {}
for line in open(sys.argv[2]):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
    if m:
        pins[m.group(1).lower().replace("_", "-")] = line.strip()
wanted = set()
for item in report["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name == "splitserve":
        continue
    wanted.add(pins.get(name, f"{meta['name']}=={meta['version']}"))
# NIXL (KV transfer over UCX) is installed beside the project, not as its dependency: the
# image installs it when built with WITH_NIXL=1.
for extra in ("nixl", "nixl-cu13"):
    if extra in pins:
        wanted.add(pins[extra])
# Dependencies whose markers hold for another 3.11 patch release than this one (Debian
# bookworm's python3 is 3.11.2: redis needs async-timeout below 3.11.3): by their range.
from packaging.markers import default_environment
from packaging.requirements import Requirement
here = default_environment()
for item in report["install"]:
    for spec in item["metadata"].get("requires_dist") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({**here, "extra": ""}):
            continue
        if any(req.marker.evaluate({**here, "python_full_version": v, "python_version": "3.11", "extra": ""})
               for v in ("3.11.0", "3.11.2", "3.11.4")):
            name = req.name.lower().replace("_", "-")
            wanted.add(pins.get(name, f"{req.name}{req.specifier}"))
print("\n".join(sorted(wanted, key=str.lower)))
PY
# Build requirements of the project itself (pip builds its wheel in an isolated env).
"$PY" - >> "$tmp/runtime.txt" <<'PY'
import importlib.metadata as md
for name, floor in (("setuptools", "68"), ("wheel", "0")):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}>={floor}")
PY
sort -u -o "$tmp/runtime.txt" "$tmp/runtime.txt"
grep '==' "$tmp/runtime.txt" > "$OUT/constraints.txt" || true
# 3. The wheels (pip's configured indexes and find-links: torch's CPU build from local disk).
"$PIP" download -q --no-deps --only-binary=:all: -d "$OUT" -r "$tmp/runtime.txt" 2> >(grep -v 'is ignored: it is neither' >&2)
# Ranges (dependencies this interpreter does not install) pinned to the wheel downloaded.
"$PY" - "$OUT" "$tmp/runtime.txt" <<'PY'
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
lines = [l for l in (out / "constraints.txt").read_text().split() if l]
for spec in pathlib.Path(sys.argv[2]).read_text().split("\n"):
    if not spec or "==" in spec:
        continue
    name = re.split(r"[<>=!~;\s]", spec)[0]
    key = re.sub(r"[-_.]+", "_", name).lower()
    versions = sorted((w.name.split("-")[1] for w in out.glob("*.whl")
                       if re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() == key), key=lambda v: [int(x) if x.isdigit() else 0 for x in re.split(r"[.+]", v)])
    if versions and key not in ("setuptools", "wheel"):
        lines.append(f"{name}=={versions[-1]}")
(out / "constraints.txt").write_text("\n".join(sorted(set(lines), key=str.lower)) + "\n")
PY
# Wheels of versions no longer pinned (an older checkout's) are removed.
"$PY" - "$OUT" <<'PY'
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
pins = {}
for line in (out / "constraints.txt").read_text().split():
    name, _, version = line.partition("==")
    pins[re.sub(r"[-_.]+", "_", name).lower()] = version
for whl in out.glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "_", name).lower()
    if key in pins and pins[key] != version:
        whl.unlink()
PY
count=$(ls "$OUT"/*.whl | wc -l)
echo "wheelhouse $OUT: $count wheels, $(du -sh "$OUT" | cut -f1)"
