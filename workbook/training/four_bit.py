"""A 4-bit base as QLoRA stores it, for sizing on fake tensors where bitsandbytes' kernels cannot
run: each frozen linear layer holds its weight as NF4 (two weights a byte, one absolute maximum
per block of 64 weights, double-quantised to one byte with one fp32 constant per 256 blocks) and
dequantises it to the compute dtype for each matmul, forward and backward, as bitsandbytes'
`Linear4bit` does. Only memory is modelled: the dequantised weight is an allocation of the
right size and dtype, not its values, so such a model is sized (predicted), never trained."""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 64  # weights per absolute maximum (bitsandbytes' blocksize for 4-bit)
SECOND_BLOCK = 256  # absmax blocks per fp32 constant when double-quantised


def storage_bytes(weights: int, double_quant: bool = True) -> float:
    """Bytes a 4-bit layer of `weights` holds: the packed weights and their quantisation
    constants (about 0.516 bytes a weight double-quantised, 0.5625 without)."""
    blocks = -(-weights // BLOCK)
    constants = blocks + 4 * -(-blocks // SECOND_BLOCK) if double_quant else 4 * blocks
    return weights / 2 + constants


class _Dequantised(torch.autograd.Function):
    """x @ W^T with W dequantised on the fly, and again in backward (only the packed weight is
    kept for it, as bitsandbytes keeps it)."""

    @staticmethod
    def forward(ctx, x, packed, shape, dtype):
        ctx.packed, ctx.shape, ctx.dtype = packed, shape, dtype
        return x @ _dequantised(packed, shape, dtype).t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ _dequantised(ctx.packed, ctx.shape, ctx.dtype), None, None, None


def _dequantised(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The workspace of one dequantisation: the whole weight in the compute dtype."""
    return packed.new_empty(shape, dtype=dtype)


class FourBitLinear(nn.Module):
    """A frozen linear layer stored in 4 bits (a stand-in of bitsandbytes' `Linear4bit` for
    sizing): `packed` (uint8, two weights a byte) and `absmax` (the quantisation constants),
    the bias as it was; the output in the input's dtype."""

    def __init__(self, linear: nn.Linear, double_quant: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weights = linear.weight.numel()
        device = linear.weight.device
        self.packed = nn.Parameter(torch.empty(-(-weights // 2), dtype=torch.uint8,
                                               device=device), requires_grad=False)
        constants = int(storage_bytes(weights, double_quant) - self.packed.numel())
        self.register_buffer("absmax", torch.empty(constants, dtype=torch.uint8,
                                                   device=device))
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = torch.Size((self.out_features, self.in_features))
        out = _Dequantised.apply(x, self.packed, shape, x.dtype)
        return out + self.bias.to(x.dtype) if self.bias is not None else out


def quantised(model: nn.Module, skip: tuple[str, ...] = ("lm_head",),
              double_quant: bool = True) -> nn.Module:
    """`model` with every frozen `nn.Linear` stored in 4 bits (QLoRA's base), in place: the
    adapters, the layers trained whole (`modules_to_save`) and the `skip` ones (the head, as
    transformers keeps it) stay as they are."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (type(child) is nn.Linear and not child.weight.requires_grad
                    and not any(s in full.split(".") for s in skip)
                    and "original_module" not in full.split(".")):
                setattr(module, child_name, FourBitLinear(child, double_quant))
    return model
