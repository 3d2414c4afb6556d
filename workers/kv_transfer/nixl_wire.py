"""What NIXL peers exchange: the published memory header and agent metadata, WRITE notifications.

Pure encoding, no NIXL import: a worker publishes, through `StateStore.put_nixl_metadata`,
one value holding a header (base address, block size, block count, memory type, lanes)
and the metadata of each of its agents (one per lane); a WRITE carries a JSON
notification naming the token range, blocks and sender digest of what it wrote.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np

from workers.kv_transfer.base import BlockTransfer, KvTransferError

_HEADER_MAGIC = b"SSNX2"
_NOTIF_VERSION = 1


@dataclass(frozen=True)
class NixlMemoryHeader:
    """What a peer must know about a worker's registered KV cache to address its blocks."""

    agent: str  # lane 0's agent name (the worker id); lane k > 0 is "<agent>#<k>"
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" | "VRAM"
    dev_id: int
    incarnation: str  # changes on every start, so a restarted peer is recognisable
    lanes: int = 1
    num_layers: int = 1  # a block is num_layers equal contiguous slices (per-layer pushes)


def lane_agent_name(worker_id: str, lane: int) -> str:
    """The NIXL agent name of a worker's lane."""
    return worker_id if lane == 0 else f"{worker_id}#{lane}"


def pack_published_metadata(header: NixlMemoryHeader, agent_metadata: list[bytes]) -> bytes:
    """Header and every lane's agent metadata as one Redis value: magic, lengths, JSON, blobs."""
    if len(agent_metadata) != header.lanes:
        raise ValueError(f"{len(agent_metadata)} agent metadata blobs for {header.lanes} lanes")
    encoded = json.dumps(header.__dict__).encode()
    parts = [_HEADER_MAGIC, struct.pack("!I", len(encoded)), encoded]
    for blob in agent_metadata:
        parts += [struct.pack("!I", len(blob)), blob]
    return b"".join(parts)


def unpack_published_metadata(value: bytes) -> tuple[NixlMemoryHeader, list[bytes]]:
    """Inverse of pack_published_metadata; KvTransferError on anything else."""
    if not value.startswith(_HEADER_MAGIC):
        raise KvTransferError("published NIXL metadata has an unknown format")
    try:
        offset = len(_HEADER_MAGIC)
        (length,) = struct.unpack_from("!I", value, offset)
        offset += 4
        header = NixlMemoryHeader(**json.loads(value[offset : offset + length]))
        offset += length
        blobs = []
        for _ in range(header.lanes):
            (length,) = struct.unpack_from("!I", value, offset)
            offset += 4
            if offset + length > len(value):
                raise ValueError("truncated agent metadata")
            blobs.append(value[offset : offset + length])
            offset += length
    except (ValueError, TypeError, struct.error) as exc:
        raise KvTransferError(f"published NIXL metadata is malformed: {exc}") from None
    return header, blobs


def encode_write_notification(transfer: BlockTransfer, checksum: int) -> bytes:
    """The message a WRITE delivers to the destination agent once its bytes are in place."""
    return json.dumps({
        "v": _NOTIF_VERSION, "kind": "write", "transfer_id": transfer.transfer_id,
        "request_id": transfer.request_id, "src_worker": transfer.src_worker,
        "token_start": transfer.token_start, "token_end": transfer.token_end,
        "src_blocks": list(transfer.src_blocks), "dst_blocks": list(transfer.dst_blocks),
        "checksum": checksum, **({} if transfer.layer is None else {"layer": transfer.layer}),
    }, separators=(",", ":")).encode()


def decode_write_notification(message: bytes, dst_worker: str) -> tuple[BlockTransfer, int]:
    """The transfer and sender checksum in a WRITE notification; ValueError if malformed."""
    try:
        fields = json.loads(message)
        if fields.get("v") != _NOTIF_VERSION or fields.get("kind") != "write":
            raise ValueError(f"unexpected notification {message[:80]!r}")
        transfer = BlockTransfer(
            transfer_id=fields["transfer_id"], src_worker=fields["src_worker"], dst_worker=dst_worker,
            src_blocks=tuple(fields["src_blocks"]), dst_blocks=tuple(fields["dst_blocks"]),
            token_start=fields["token_start"], token_end=fields["token_end"], request_id=fields["request_id"],
            layer=None if fields.get("layer") is None else int(fields["layer"]),
        )
        return transfer, int(fields["checksum"])
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed notification: {exc}") from None


def block_descs(base_addr: int, block_bytes: int, num_blocks: int, dev_id: int) -> np.ndarray:
    """One (address, length, device) row per block: the layout is block-major."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = dev_id
    return rows


def layer_block_descs(base_addr: int, block_bytes: int, num_blocks: int, num_layers: int, dev_id: int) -> np.ndarray:
    """One row per block per layer (row `layer_desc_index(block, layer)`): each layer's slice of a block."""
    if num_layers < 1 or block_bytes % num_layers:
        raise ValueError(f"{block_bytes}-byte blocks do not split into {num_layers} layers")
    return block_descs(base_addr, block_bytes // num_layers, num_blocks * num_layers, dev_id)
