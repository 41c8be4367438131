"""Building blocks shared by head-style drafters (Medusa, Hydra)."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + Dropout(SiLU(W x + b)) with W zero-initialised: starts as the identity."""

    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.linear(x)))


def copy_of_linear(src: nn.Module) -> nn.Linear:
    """A new trainable Linear initialised from ``src`` (e.g. the target's LM head)."""
    w = src.weight.detach()
    out = nn.Linear(w.shape[1], w.shape[0], bias=getattr(src, "bias", None) is not None)
    with torch.no_grad():
        out.weight.copy_(w)
        if out.bias is not None:
            out.bias.copy_(src.bias.detach())
    return out
