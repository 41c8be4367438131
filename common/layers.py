"""Small layer pieces the kinds' own decoder layers share (Hydra++'s prefix layer, Kangaroo's adapter, EAGLE-3)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back to the input's dtype, then scaled."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of the last dimension's two halves."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)
