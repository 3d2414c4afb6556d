"""CPU kernels compiled on this machine at first use (torch's C++ extension builder).

`paged_decode_attention` reads decode keys and values in place from the paged KV cache
(see paged_decode_attention.cpp for why). It is built once per machine and source, with
torch's C++ extension builder, into one library file under torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, under splitserve/), named by a
digest of the sources, this CPU's instruction-set flags (it is compiled for the CPU it runs
on, -march=native), the compile flags and the torch and Python versions. Loading a built
library runs no compiler. `make setup` builds it ahead (`python -m workers.engine.kernels`),
so that no worker pays the compile (~30 s) when it starts.

Where it cannot be built (no C++ compiler, no ninja, a non-x86/ARM CPU, or
SPLITSERVE_CPU_KERNELS=0), `load()` returns None once, with one warning, and the engine
keeps the pure-torch path: same results, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# The module is defined in the first; the fused elementwise ops (RMSNorm with the residual
# add, rotary) come with it.
SOURCES = [Path(__file__).with_name(name) for name in ("paged_decode_attention.cpp", "fused_elementwise.cpp")]
ENV_SWITCH = "SPLITSERVE_CPU_KERNELS"  # "0": never build nor use the kernels
# -ffast-math lets the compiler vectorise the softmax's exp and reassociate the dot products
# (8% faster, benchmarks/cpu_kernels.py; still within 1e-5 of SDPA); infinities stay defined:
# the online softmax starts from -inf.
# -fopenmp: at::parallel_for uses threads only in code compiled with OpenMP (without it every
# lane ran on one thread: decode attention 36.6 -> 25.7 ms on 2 threads, benchmarks/cpu_kernels.py);
# the extension's libgomp.so.1 is torch's own, already loaded: one OpenMP runtime in the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
LDFLAGS = ["-fopenmp"]
BUILD_WAIT_S = 300.0  # how long to wait for another process's build before serving without

def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def build_name() -> str:
    """The build's name: a digest of the sources, this CPU's flags, the compile flags and the
    torch and Python it links against (a build for another torch is another file)."""
    import sys

    import torch

    sources = b"".join(source.read_bytes() for source in SOURCES)
    context = " ".join([_cpu_flags(), *CFLAGS, torch.__version__, sys.version.split()[0]]).encode()
    digest = hashlib.sha256(sources + context).hexdigest()[:12]
    return f"splitserve_paged_decode_{digest}"


@functools.cache  # one answer per process: an extension, once loaded, stays loaded
def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, building them if needed; None where they cannot be had."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU kernels off (%s=0): decode attention gathers KV in torch", ENV_SWITCH)
        return None
    try:
        return _build(verbose)
    except Exception as err:  # no compiler, no ninja, an unknown CPU: the torch path serves
        log.warning("CPU decode-attention kernel unavailable (%s); using the torch path",
                    str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return None


def build_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return Path(root) / "splitserve"


def built_library() -> Path:
    """Where the finished build lives: beside torch's build directories, never inside one."""
    return build_root() / f"{build_name()}.so"


def _build(verbose: bool) -> ModuleType:
    """Load the finished library; build it first when there is none.

    A finished build is one file, named by its digest, that appears by an atomic rename:
    loading it runs no compiler and no ninja. (Letting torch's `load` run ninja at every
    start was fragile: a worker killed mid-compile leaves its compiler running, which rewrites
    the objects after the dependency record, so every later start found them out of date and
    compiled again, each killed start adding another orphan.) A build happens in a directory
    of its own under an OS file lock with a bounded wait (an flock dies with its holder).
    """
    import fcntl
    import shutil
    import tempfile

    from torch.utils.cpp_extension import load as torch_load

    name = build_name()
    library = built_library()
    if library.exists():
        return _import_library(name, library)
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / f"{name}.flock", "w") as lock:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {name} for over {BUILD_WAIT_S:.0f} s")
                time.sleep(0.5)  # polling another process's build, with a deadline
        try:
            if library.exists():  # built by the process we waited for
                return _import_library(name, library)
            directory = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=library.parent))
            try:
                module = torch_load(name=name, sources=[str(source) for source in SOURCES],
                                    build_directory=str(directory), verbose=verbose,
                                    extra_cflags=CFLAGS, extra_ldflags=LDFLAGS)
                os.replace(directory / f"{name}.so", library)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            return module
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _import_library(name: str, library: Path) -> ModuleType:
    """Import the built extension module from its file (torch's libraries are loaded first:
    the extension links against them)."""
    import importlib.util

    import torch  # noqa: F401  (libc10 / libtorch for the extension's symbols)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
