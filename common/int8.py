"""Weight-only int8 linear layers for drafting on CPU: half the bytes of a bf16 weight to read per product.

Drafting only: the drafter's numbers shape q and nothing else, and verification is exact for any q, so a
quantised drafter changes which tokens are drafted, never the output's distribution. Hydra++'s and EAGLE-3's
compiled drafting use these (heads/hydra/fast.py, drafters/eagle3/fast.py).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn


@torch.library.custom_op("draftsmith::int8_mm", mutates_args=())
def int8_mm(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (wq [N, K] int8 * scale [N]).T: ATen's weight-only int8 kernel, as an opaque op (inductor's own
    lowering of it rejects some inputs, e.g. a concatenation computed in the same graph)."""
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), wq, scale)


@int8_mm.register_fake
def _(x, wq, scale):
    return x.new_empty((x.shape[0], wq.shape[0]))


class Int8Linear(nn.Module):
    """A linear layer with its weight in int8, one scale per output row (weight-only quantisation): the product
    is ``torch.ops.aten._weight_int8pack_mm`` on CPU, half the bytes of a bf16 weight to read. For drafting
    only, where the numbers shape q and nothing else (verification is exact for any q)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127.0
        self.register_buffer("wq", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(lin.weight.dtype))
        b = getattr(lin, "bias", None)
        self.register_buffer("bias", None if b is None else b.detach().clone())
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_mm(x.reshape(-1, self.in_features), self.wq, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


#: the dtypes whose drafting defaults to int8 weights on a CPU. Not float32: ATen's weight-only int8 product in
#: float32 takes 3.56 ms for the 8192 x 576 draft head at one row against 0.52 ms for the dense float32 product
#: (bf16: 0.30 against 0.69), 2 threads, the AMX Xeon of docs/results-log.md section 38
INT8_DTYPES = (torch.bfloat16, torch.float16)


def int8_by_default(weight: torch.Tensor) -> bool:
    """Whether a drafter with this weight drafts through int8 weights unless told otherwise: on a CPU, in a dtype
    where the int8 product is the faster one (`INT8_DTYPES`)."""
    return weight.device.type == "cpu" and weight.dtype in INT8_DTYPES


def quantised(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every ``nn.Linear`` inside it (itself included) an `Int8Linear`."""
    if isinstance(module, nn.Linear):
        return Int8Linear(module)
    m = copy.deepcopy(module)
    for name, child in list(m.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, Int8Linear(sub))
    return m


def native_bf16() -> bool:
    """Whether this CPU computes bf16 products natively (AVX512_BF16, as torch reports it)."""
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def drafting_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a drafter with this weight drafts in on its compiled path: its own, except float32 on a CPU that
    computes bf16 natively, where the compiled drafting runs a bf16 copy of the drafter (inputs cast in, logits
    cast back out). There a float32 target decoding from its packed weights (`draftsmith.engine.fastpath.
    decode_dtype`) would otherwise draft through dense float32 products: a Hydra head over the 8192 kept ids took
    4.08 ms for 4 rows in float32 against 0.70 ms in bf16 on a 2-core Zen 5 EPYC (docs/results-log.md §45). The
    draft's numbers shape q and nothing else, and verification is exact for any q: lossless either way.
    ``DRAFTSMITH_DRAFT_BF16=0`` keeps float32 (for a side-by-side measurement)."""
    if (weight.device.type == "cpu" and weight.dtype == torch.float32
            and os.environ.get("DRAFTSMITH_DRAFT_BF16", "1") != "0" and native_bf16()):
        return torch.bfloat16
    return weight.dtype


def cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` itself when its weights are in ``dtype`` already, else a copy in ``dtype``."""
    p = next(module.parameters(), None)
    if p is None or p.dtype == dtype:
        return module
    return copy.deepcopy(module).to(dtype)


def compute_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` itself when its own weights are in ``dtype``, else a shallow copy whose own submodules, parameters
    and floating-point buffers are copies in ``dtype`` and whose ``shared_with_target`` submodules (the target's
    embedding and LM head, read and never stored) are the same objects, not copied."""
    p = next((q for n, q in module.named_parameters() if n.split(".")[0] not in
              set(getattr(module, "shared_with_target", ()))), None)
    if p is None or p.dtype == dtype:
        return module
    shared = set(getattr(module, "shared_with_target", ()))
    c = copy.copy(module)
    c._modules = {n: m if m is None or n in shared else cast_copy(m, dtype) for n, m in module._modules.items()}
    c._parameters = {n: None if q is None else nn.Parameter(q.detach().to(dtype), requires_grad=False)
                     for n, q in module._parameters.items()}
    c._buffers = {n: b.to(dtype) if b is not None and b.is_floating_point() else b for n, b in module._buffers.items()}
    return c


def logits_in(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Draft logits computed in another dtype, in ``dtype``: the computing dtype's minimum (a pruned id, q = 0)
    becomes ``dtype``'s minimum, as a head in ``dtype`` would have put there."""
    if logits.dtype == dtype:
        return logits
    return logits.to(dtype).masked_fill(logits == torch.finfo(logits.dtype).min, torch.finfo(dtype).min)
