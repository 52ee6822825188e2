"""Dropout fused with the residual add: out = residual + dropout(x), keeping no mask.

Eager ``residual + F.dropout(x)`` keeps the dropout mask for backward. Here the keep
decision of element i is ``tl.rand(seed, i) >= p`` (see ``philox.py``), so backward
regenerates it from the seed:

    d_residual = d_out,   dx = d_out · keep / (1 - p)

Only the int64 seed is saved.
"""

import torch
import triton
import triton.language as tl

from slimformer.kernels.dispatch import FLOAT_DTYPES, reference_row_blocks, use_triton
from slimformer.kernels.philox import dropout_keep_mask, new_dropout_seed

_BLOCK = 1024


@triton.jit
def _dropout_scale_kernel(
    X,  # (numel,) input
    RESIDUAL,  # (numel,) residual to add, or None
    OUT,  # (numel,) residual + x · keep / (1 - p)
    SEED,  # () int64 dropout seed
    numel,
    dropout_p,
    dropout_scale,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(tl.load(SEED), offsets) >= dropout_p
    out = x * tl.where(keep, dropout_scale, 0.0)
    if RESIDUAL is not None:
        out += tl.load(RESIDUAL + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


def _dropout_scale(x, residual, seed, dropout_p, out_dtype):
    """residual + x · keep / (1 - p) (residual optional) with the Triton kernel."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel():
        _dropout_scale_kernel[(triton.cdiv(x.numel(), _BLOCK),)](
            x, residual, out, seed, x.numel(), dropout_p, 1.0 / (1.0 - dropout_p), BLOCK=_BLOCK
        )
    return out


def _dropout_scale_reference(x, residual, seed, dropout_p, out_dtype):
    """PyTorch statement of ``_dropout_scale``, in blocks of elements."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    flat_x, flat_out = x.view(-1), out.view(-1)
    for start, stop in reference_row_blocks(x.numel(), 1):
        offsets = torch.arange(start, stop, dtype=torch.int64, device=x.device)
        scale = dropout_keep_mask(seed, offsets, dropout_p).float().mul_(1.0 / (1.0 - dropout_p))
        block = scale.mul_(flat_x[start:stop])
        if residual is not None:
            block += residual.view(-1)[start:stop]
        flat_out[start:stop] = block
    return out


def _apply_dropout(x, residual, seed, dropout_p, out_dtype):
    fn = _dropout_scale if use_triton(x) else _dropout_scale_reference
    return fn(x, residual, seed, dropout_p, out_dtype)


class _DropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, seed, dropout_p):
        ctx.save_for_backward(seed)
        ctx.dropout_p = dropout_p
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        return _apply_dropout(x, residual, seed, dropout_p, torch.promote_types(x.dtype, residual.dtype))

    @staticmethod
    def backward(ctx, dout):
        (seed,) = ctx.saved_tensors
        dout = dout.contiguous()
        dx = _apply_dropout(dout, None, seed, ctx.dropout_p, ctx.x_dtype)
        return dx, dout.to(ctx.residual_dtype), None, None


def dropout_add(x: torch.Tensor, residual: torch.Tensor, dropout_p: float, training: bool = True) -> torch.Tensor:
    """``residual + F.dropout(x, dropout_p, training)`` without keeping the mask.

    x, residual: same shape and device, float32/float16/bfloat16; the result has their
    promoted dtype, as ``residual + x`` has (a bf16 branch under autocast added to an fp32
    residual stream gives fp32). dropout_p in [0, 1). The mask is drawn from torch's
    generator (``torch.manual_seed`` reproduces it). Raises ValueError/TypeError naming
    the argument on mismatches.
    """
    for name, tensor in (("x", x), ("residual", residual)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_DTYPES:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"{name} must be a float32, float16 or bfloat16 torch.Tensor, got {got}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not training or dropout_p == 0.0:
        return residual + x
    seed = new_dropout_seed(x.device)
    return _DropoutAddFunction.apply(x.contiguous(), residual.contiguous(), seed, float(dropout_p))
