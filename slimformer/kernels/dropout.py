"""Dropout fused with the residual add: out = residual + dropout(x), keeping no mask.

Eager ``residual + F.dropout(x)`` keeps the dropout mask for backward. Here x is a
dropout matrix of rows × its last dimension (see ``philox.py``): the mask comes from the
seed, one Philox call per 16 elements of a row, so backward regenerates it:

    d_residual = d_out,   dx = d_out · keep · scale,   scale = 1 / (1 - p_eff)

Only the int64 seed is saved. float64 tensors (``torch.autograd.gradcheck``, float64
models) always take the PyTorch reference, on every device, in float64.
"""

import torch
import triton
import triton.language as tl

from slimformer.kernels.dispatch import (
    FLOAT_DTYPES,
    cdiv,
    direct,
    eager_autograd,
    next_power_of_2,
    reference_row_blocks,
    use_triton,
)
from slimformer.kernels.philox import (
    DECISIONS_PER_CALL,
    dropout_keep_block,
    dropout_keep_tile,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

_TILE_ELEMENTS = 4096


@triton.jit
def tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows [BLOCK_M], first column) of this program's tile of an (M, N) matrix, on one grid
    axis (2**31 - 1 programs; the y and z axes stop at 65,535): tile (i, j) is program
    i · column tiles + j."""
    col_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    return (pid // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M), (pid % col_tiles) * BLOCK_N


@triton.jit
def _dropout_scale_kernel(
    X,  # (M, N) input, contiguous
    RESIDUAL,  # (M, N) residual to add, or None
    OUT,  # (M, N) residual + x · keep · scale
    SEED,  # () int64 dropout seed
    M,
    N,
    dropout_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, col_start = tile_origin(M, N, BLOCK_M, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    threshold, scale = dropout_threshold_and_scale(dropout_p)
    out = x * tl.where(dropout_keep_tile(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N), scale, 0.0)
    if RESIDUAL is not None:
        out += tl.load(RESIDUAL + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


def _matrix_shape(x: torch.Tensor) -> tuple[int, int]:
    """(rows, columns) of x's dropout matrix: the last dimension is the columns."""
    n_cols = x.shape[-1] if x.dim() else 1
    return (x.numel() // n_cols if n_cols else 0), n_cols


def _tiles(M: int, N: int) -> tuple[tuple[int], int, int]:
    """Grid and (BLOCK_M, BLOCK_N): tiles of 4096 elements, as wide as the rows allow."""
    block_n = min(1024, max(DECISIONS_PER_CALL, next_power_of_2(N)))
    block_m = _TILE_ELEMENTS // block_n
    return (cdiv(M, block_m) * cdiv(N, block_n),), block_m, block_n


def _dropout_scale(x, residual, seed, dropout_p, out_dtype):
    """residual + x · keep · scale (residual optional) with the Triton kernel."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    M, N = _matrix_shape(x)
    if x.numel():
        grid, block_m, block_n = _tiles(M, N)
        _dropout_scale_kernel[grid](
            x, residual, out, seed, M, N, dropout_p, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4
        )
    return out


def _dropout_scale_reference(x, residual, seed, dropout_p, out_dtype):
    """PyTorch statement of ``_dropout_scale``, in blocks of rows of the (M, N) dropout matrix,
    in fp32, or fp64 where a tensor is fp64."""
    M, N = _matrix_shape(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows_x, rows_out = x.view(M, N), out.view(M, N)
    rows_residual = None if residual is None else residual.view(M, N)
    scale = dropout_threshold(dropout_p)[1]
    acc = torch.promote_types(torch.promote_types(x.dtype, out_dtype), torch.float32)
    for start, stop in reference_row_blocks(M, N):
        keep = dropout_keep_block(seed, torch.arange(start, stop, device=x.device), 0, N, N, dropout_p)
        block = keep.to(acc).mul_(scale).mul_(rows_x[start:stop])
        if rows_residual is not None:
            block += rows_residual[start:stop]
        rows_out[start:stop] = block
    return out


def _apply_dropout(x, residual, seed, dropout_p, out_dtype):
    runs_kernel = use_triton(x) and torch.float64 not in (x.dtype, out_dtype)
    fn = _dropout_scale if runs_kernel else _dropout_scale_reference
    return fn(x, residual, seed, dropout_p, out_dtype)


@torch.library.custom_op("slimformer::dropout_add", mutates_args=())
def _dropout_add_op(x: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """residual + dropout(x), in their promoted dtype; saves only the seed."""
    return _apply_dropout(x, residual, seed, dropout_p, torch.promote_types(x.dtype, residual.dtype))


@_dropout_add_op.register_fake
def _(x, residual, seed, dropout_p):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)


@torch.library.custom_op("slimformer::dropout_add_backward", mutates_args=())
def _dropout_add_backward_op(
    dout: torch.Tensor, seed: torch.Tensor, dropout_p: float, x_dtype: torch.dtype
) -> torch.Tensor:
    """dx = dout · keep · scale in ``x_dtype``, the mask regenerated from the seed."""
    return _apply_dropout(dout.contiguous(), None, seed, dropout_p, x_dtype)


@_dropout_add_backward_op.register_fake
def _(dout, seed, dropout_p, x_dtype):
    return torch.empty(dout.shape, dtype=x_dtype, device=dout.device)


def _dropout_add_setup_context(ctx, inputs, output):
    x, residual, seed, dropout_p = inputs
    ctx.save_for_backward(seed)
    ctx.dropout_p = dropout_p
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _dropout_add_backward(ctx, dout):
    (seed,) = ctx.saved_tensors
    dx = direct(_dropout_add_backward_op)(dout, seed, ctx.dropout_p, ctx.x_dtype)
    return dx, dout.to(ctx.residual_dtype), None, None


_dropout_add = eager_autograd(_dropout_add_op, _dropout_add_backward, _dropout_add_setup_context)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, dropout_p: float, training: bool = True) -> torch.Tensor:
    """``residual + F.dropout(x, dropout_p, training)`` without keeping the mask.

    x, residual: same shape and device, float32/float16/bfloat16 or float64 (the PyTorch
    reference, on any device); the result has their promoted dtype, as ``residual + x`` has
    (a bf16 branch under autocast added to an fp32 residual stream gives fp32).
    dropout_p in [0, 1). The mask is drawn from torch's generator (``torch.manual_seed``
    reproduces it). Raises ValueError/TypeError naming the argument on mismatches.
    """
    for name, tensor in (("x", x), ("residual", residual)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (*FLOAT_DTYPES, torch.float64):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"{name} must be a float32, float16, bfloat16 or float64 torch.Tensor, got {got}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not training or dropout_p == 0.0:
        return residual + x
    seed = new_dropout_seed(x.device, x.detach(), "dropout_add")
    return _dropout_add(x.contiguous(), residual.contiguous(), seed, float(dropout_p))
