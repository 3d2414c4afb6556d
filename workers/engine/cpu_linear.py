"""Linear layers on oneDNN with weights reordered once for it (CPU).

torch's `F.linear` on the CPU calls MKL's sgemm, which on some CPUs (AMD EPYC here) takes
a generic path: measured on this machine, one SmolLM2-135M pass over its 30 layers' and
LM head's weights, each read from memory (benchmarks/cpu_kernels.py), takes 51 ms at
1 row, 96 ms at 32 and 488 ms at 256 with `F.linear`, and 26 / 52 / 350 ms with oneDNN
over weights reordered to its blocked layout — what vLLM's CPU backend does with its own oneDNN
bindings. torch ships the same oneDNN: `torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`.

The reordered weight is an opaque oneDNN tensor, so `pack_linears` replaces each
`nn.Linear` of a model by a `OneDnnLinear` holding it (the dense weight is dropped unless
another module shares it: a tied LM head keeps the embedding's). The batch-size hint only
picks the layout oneDNN expects most often; any row count runs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

DECODE_BATCH_HINT = 32  # rows the reordered layout is tuned for (decode steps dominate)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs linears in `dtype`: bfloat16 needs AVX-512 (bw/vl/dq) or
    AVX-NE-CONVERT, which an AVX2-only CPU lacks (there the model keeps `F.linear`)."""
    if not (device.type == "cpu" and dtype in SUPPORTED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return True


class OneDnnLinear(nn.Module):
    """`nn.Linear`'s forward on a oneDNN-reordered copy of its weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int = DECODE_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, batch_hint: int = DECODE_BATCH_HINT) -> int:
    """Replace every `nn.Linear` in `model` by a `OneDnnLinear`; how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, OneDnnLinear(child, batch_hint))
                replaced += 1
    return replaced
