"""Host (CPU) tensors on transparent huge pages, for the KV cache.

Why: between two workers on one host, NIXL moves KV with UCX's CMA transport
(process_vm_writev), which walks and pins the destination's pages one by one. With 2 MiB
pages instead of 4 KiB the same 16–256 MiB pushes ran at ~10 GB/s instead of ~6.5 GB/s
here (docs/benchmarks.md, KV transfer). Attention reading the cache also takes fewer TLB
misses. Where the kernel has no THP (or not Linux), the tensor is ordinary memory.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor whose memory is 2 MiB aligned and advised MADV_HUGEPAGE."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Anonymous mappings come back zero-filled; one spare huge page lets the tensor start
    # on a 2 MiB boundary, which the kernel needs to back it with huge pages from byte 0.
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled ("never"): plain pages still work
        pass
    flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as the tensor
    offset = -flat.data_ptr() % HUGE_PAGE_BYTES
    tensor = flat[offset : offset + num_bytes].view(dtype).view(shape)
    tensor.zero_()  # fault every page in now, as torch.zeros would, not during the first step
    return tensor
