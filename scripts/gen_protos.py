"""Regenerate the committed Python gRPC stubs from protos/ (or check they are fresh).

    python scripts/gen_protos.py           # write splitserve/proto/**
    python scripts/gen_protos.py --check   # exit 1 listing stale files, write nothing

Everything under splitserve/proto/ is produced by this script, `__init__.py` files
included, so `--check` compares the whole tree.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("splitserve") / "v1"  # relative to PROTO_ROOT and to the stub root
STUB_ROOT = REPO_ROOT / "splitserve" / "proto"
STUB_PACKAGE = "splitserve.proto"

# protoc emits imports relative to the proto root (`from splitserve.v1 import x_pb2`);
# the stubs live one package deeper, inside `splitserve.proto`.
_GENERATED_IMPORT = re.compile(r"^(\s*)from splitserve\.v1 import ", re.MULTILINE)
_FIXED_IMPORT = rf"\1from {STUB_PACKAGE}.splitserve.v1 import "

_V1_INIT = '"""Generated protobuf and gRPC stubs of package splitserve.v1 (gen_protos.py)."""\n'
_NAMESPACE_INIT = '"""Generated stub namespace mirroring protos/ (scripts/gen_protos.py)."""\n'


def proto_files() -> list[Path]:
    """The .proto files of the wire contract, in a stable order."""
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def _run_protoc(out_root: Path, protos: list[Path]) -> None:
    # Imported lazily so `--help` works without grpcio-tools.
    import grpc_tools
    from grpc_tools import protoc

    well_known_include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in protos),
    ]
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with exit status {status}")


def _convenience_init(module_names: list[str]) -> str:
    lines = [
        '"""Generated stubs of protos/splitserve/v1: `from splitserve.proto import worker_pb2`."""',
        "",
        f"from {STUB_PACKAGE}.splitserve.v1 import (",
        *(f"    {name}," for name in module_names),
        ")",
        "",
        "__all__ = [",
        *(f'    "{name}",' for name in module_names),
        "]",
        "",
    ]
    return "\n".join(lines)


def generate(out_root: Path) -> None:
    """Write the complete stub tree (what splitserve/proto/ should contain) into out_root."""
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    _run_protoc(out_root, protos)
    package_dir = out_root / PROTO_PACKAGE_DIR
    for stub in sorted(package_dir.glob("*.py*")):
        text = stub.read_text()
        stub.write_text(_GENERATED_IMPORT.sub(_FIXED_IMPORT, text))
    (package_dir / "__init__.py").write_text(_V1_INIT)
    (out_root / PROTO_PACKAGE_DIR.parent / "__init__.py").write_text(_NAMESPACE_INIT)
    module_names = sorted(
        p.stem for p in package_dir.glob("*.py") if p.stem.endswith(("_pb2", "_pb2_grpc"))
    )
    (out_root / "__init__.py").write_text(_convenience_init(module_names))


def _tree(root: Path) -> set[Path]:
    """Relative paths of the stub files under root (caches ignored)."""
    if not root.exists():
        return set()
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".pyi"}
    }


def stale_files(fresh_root: Path, committed_root: Path) -> list[str]:
    """Files that differ between the two trees, are missing, or should not exist."""
    fresh, committed = _tree(fresh_root), _tree(committed_root)
    shown = committed_root
    if committed_root.is_relative_to(REPO_ROOT):
        shown = committed_root.relative_to(REPO_ROOT)
    stale = []
    for rel in sorted(fresh | committed):
        if rel not in committed:
            stale.append(f"{shown / rel} (missing)")
        elif rel not in fresh:
            stale.append(f"{shown / rel} (no longer generated)")
        elif not filecmp.cmp(fresh_root / rel, committed_root / rel, shallow=False):
            stale.append(f"{shown / rel} (differs)")
    return stale


def sync(fresh_root: Path, committed_root: Path) -> list[str]:
    """Make committed_root match fresh_root; return what was written or removed."""
    actions = []
    for rel in sorted(_tree(committed_root) - _tree(fresh_root)):
        (committed_root / rel).unlink()
        actions.append(f"removed {rel}")
    for rel in sorted(_tree(fresh_root)):
        target = committed_root / rel
        if target.exists() and filecmp.cmp(fresh_root / rel, target, shallow=False):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fresh_root / rel, target)
        actions.append(f"wrote {rel}")
    return actions


def main(argv: list[str] | None = None) -> int:
    """Regenerate the stubs, or with --check report stale ones and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temp dir and exit 1 if the committed stubs differ",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitserve-protos-") as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        if args.check:
            stale = stale_files(fresh_root, STUB_ROOT)
            if stale:
                print("stale generated stubs under splitserve/proto/ (run `make protos`):")
                for entry in stale:
                    print(f"  {entry}")
                return 1
            print("generated stubs are up to date")
            return 0
        actions = sync(fresh_root, STUB_ROOT)
    for action in actions:
        print(action)
    print(f"stubs in {STUB_ROOT.relative_to(REPO_ROOT)} are up to date ({len(actions)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
