"""A Hugging Face hub cache laid out as huggingface_hub writes it, filled from local files.

models--Org--Name/blobs/<sha256> holds each file once, snapshots/<commit>/<path> links to
it relatively, refs/main names the commit: what `hf download`, transformers or vLLM leave
behind, so the code under test finds it the way it would find theirs.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo_id: str, source: Path, *, commit: str = COMMIT,
                     only: tuple[str, ...] | None = None) -> Path:
    """Put the files of directory `source` (or those named in `only`) into `cache` as repository
    `repo_id` at `commit`; the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if not path.is_file() or (only is not None and str(relative) not in only):
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


class SilentHub:
    """A TCP listener that never answers: the kernel completes each connection into the backlog
    and nothing reads it, a hub that hangs. `connections()` counts those made so far (a cache
    hit must make none)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self._accepted: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def connections(self) -> int:
        while True:
            try:
                self._accepted.append(self.sock.accept()[0])
            except BlockingIOError:
                return len(self._accepted)

    def close(self) -> None:
        for conn in self._accepted:
            conn.close()
        self.sock.close()


def closed_port_url() -> str:
    """An endpoint that refuses connections at once: a port bound and closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
