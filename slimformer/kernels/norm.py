"""LayerNorm and RMSNorm, with fused dropout + residual add, forward and backward.

Each row h of N features (h = dropout(x) + residual, or just x) is normalised in fp32:

    LayerNorm: y = (h - mean(h)) * rstd * w + b,   rstd = 1 / sqrt(var(h) + eps)
    RMSNorm:   y = h * rstd * w,                   rstd = 1 / sqrt(mean(h^2) + eps)

With x̂ the normalised row and g = dy * w, backward is
    dh = rstd * (g - mean(g) - x̂ * mean(g * x̂))     (RMSNorm: no mean(g) term)
    dw = sum over rows of dy * x̂,   db = sum over rows of dy.

Saved for backward: h (or x itself when nothing is fused), the fp32 row statistics
and the dropout seed. In memory-efficient mode the output y is saved instead of h and
x̂ = (y - b) / w is rebuilt in backward: the next Linear keeps y anyway, so the norm
adds only rstd (4 bytes per row). That division is only trustworthy when no |w| is
tiny and |b| / |w| is bounded, which ``output_rebuilds_input`` decides once, when a
layer gets its weights, never per step. The dropout mask is regenerated from the
seed (see ``philox.py``), never stored.

The dropout may instead follow the norm, out = dropout(y) (``dropout_after``, what
BERT-family embeddings compute last); backward then masks dy before the norm's own
backward. The output then has zeros where y does not, so x itself is saved (the next
layer keeps out, not y: saving y would cost as much and round).

dw and db are reduced in two stages, deterministically: each program (at most one per SM) sums
its rows into an fp32 partial row, then the partial rows are summed over a fixed binary tree
of the programs, in the same launch (counters say which of two sibling programs finishes
later and adds the other's row; no float atomics), or by PyTorch after the wide kernel.
Rows wider than 16384 (forward) or 8192 (backward) are processed in 4096-column blocks
(``_norm_*_wide_*kernel``), so no row has to fit in registers; the forward then splits each
row into segments over the SMs when there are fewer rows than SMs.

float64 inputs (``torch.autograd.gradcheck``, float64 models) always take the PyTorch
reference, on every device, with float64 statistics and accumulators.
"""

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slimformer.kernels.dispatch import (
    absent_output,
    cdiv,
    direct,
    eager_autograd,
    multiprocessor_count,
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

MAX_HIDDEN_SIZE = 65536
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Rebuilding x̂ = (y - b) / w amplifies y's rounding error by 1 + |b| / |w|.
_MAX_BIAS_OVER_WEIGHT = 7.0
_MIN_ABS_WEIGHT = 1e-3

# Whole rows up to 8192 columns stay in registers in backward (16 per thread, up to 16 warps),
# up to 16384 in forward (32 per thread); wider ones are processed in column blocks.
_MAX_WHOLE_ROW = 8192
_MAX_WHOLE_ROW_FORWARD = 16384
_WIDE_BLOCK_N = 4096
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Read at import, as Triton's JIT decides at decoration time whether it interprets.
_COMPILED: tl.constexpr = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _aligned(N, N_ALIGN: tl.constexpr):
    """N, written so that the compiler knows it is a multiple of N_ALIGN (``_row_alignment``):
    Triton's specialisation only tells it whether N is a multiple of 16, so rows of, say,
    1000 bf16 values would otherwise load two bytes at a time."""
    return N // N_ALIGN * N_ALIGN


@triton.jit
def _fused_input(
    X,
    RESIDUAL,
    SEED,
    rows,
    col_start,
    offsets,
    mask,
    N,
    dropout_p,
    ROUND_H: tl.constexpr,
    H_DTYPE: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h = dropout(x) + residual in fp32 for the tile of ``rows`` x (col_start + arange(BLOCK_N));
    no dropout here when it follows the norm."""
    h = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if SEED is not None and not DROPOUT_AFTER:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        h *= tl.where(dropout_keep_tile(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N), scale, 0.0)
    if RESIDUAL is not None:
        h += tl.load(RESIDUAL + offsets, mask=mask, other=0.0).to(tl.float32)
    if ROUND_H:
        # Statistics of h as stored, so that backward (which reloads h) and eager
        # PyTorch (which materialises x + residual) see the same numbers.
        h = h.to(H_DTYPE).to(tl.float32)
    return h


@triton.jit
def _dropout_scale_tile(SEED, rows, col_start, N, dropout_p, BLOCK_N: tl.constexpr):
    """keep · scale in fp32 for the tile of ``rows`` x (col_start + arange(BLOCK_N))."""
    threshold, scale = dropout_threshold_and_scale(dropout_p)
    return tl.where(dropout_keep_tile(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N), scale, 0.0)


@triton.jit
def _row_part(
    X,
    RESIDUAL,
    H,
    SEED,
    rows,
    row_ok,
    col_start,
    N,
    dropout_p,
    ROUND_H: tl.constexpr,
    H_DTYPE: tl.constexpr,
    STORE_H: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(h, its row sums, column mask, offsets) of columns col_start + arange(BLOCK_N) of ``rows``; h stored when STORE_H."""
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    h = _fused_input(
        X, RESIDUAL, SEED, rows, col_start, offsets, mask, N, dropout_p, ROUND_H, H_DTYPE, DROPOUT_AFTER, BLOCK_N
    )
    if STORE_H:
        tl.store(H + offsets, h.to(H_DTYPE), mask=mask)
    return h, tl.sum(h, axis=1), mask, offsets


@triton.jit
def _store_row_part(
    y, W, B, Y, SEED, rows, col_start, mask, offsets, N, dropout_p, DROPOUT_AFTER: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Store y · w + b (then dropout when it follows the norm) for columns col_start + arange(BLOCK_N)."""
    cols = col_start + tl.arange(0, BLOCK_N)
    if W is not None:
        y *= tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if B is not None:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if DROPOUT_AFTER:
        y *= _dropout_scale_tile(SEED, rows, col_start, N, dropout_p, BLOCK_N)
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_kernel(
    X,  # (M, N) branch input, before dropout
    RESIDUAL,  # (M, N) residual to add, or None
    W,  # (N,) weight, or None
    B,  # (N,) bias, or None
    Y,  # (M, N) output
    H,  # (M, N) dropout(x) + residual, written when STORE_H
    MEAN,  # (M,) fp32 row means, or None (RMSNorm, or not needed by backward)
    RSTD,  # (M,) fp32 reciprocal standard deviations
    SEED,  # () int64 dropout seed, or None
    M,
    N,
    eps,
    dropout_p,
    IS_RMS: tl.constexpr,
    ROUND_H: tl.constexpr,
    H_DTYPE: tl.constexpr,
    STORE_H: tl.constexpr,
    N_ALIGN: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_N: tl.constexpr,
):
    """BLOCK_M whole rows per program, held as their first BLOCK_N columns and, when TAIL_N > 0,
    the TAIL_N after them (``_row_split``: 768 = 512 + 256 rather than 1024 lanes, a quarter idle)."""
    N = _aligned(N, N_ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    h, row_sum, mask, offsets = _row_part(
        X, RESIDUAL, H, SEED, rows, row_ok, 0, N, dropout_p, ROUND_H, H_DTYPE, STORE_H, DROPOUT_AFTER, BLOCK_N
    )
    if TAIL_N > 0:
        h_tail, tail_sum, tail_mask, tail_offsets = _row_part(
            X, RESIDUAL, H, SEED, rows, row_ok, BLOCK_N, N, dropout_p, ROUND_H, H_DTYPE, STORE_H, DROPOUT_AFTER, TAIL_N
        )
        row_sum += tail_sum

    if IS_RMS:
        centered = h
    else:
        mean = row_sum / N
        # a row's first BLOCK_N columns are all real when a tail follows (and rows past M are zeros)
        centered = h - mean[:, None] if TAIL_N > 0 else tl.where(mask, h - mean[:, None], 0.0)
        if MEAN is not None:
            tl.store(MEAN + rows, mean, mask=row_ok)
    sum_sq = tl.sum(centered * centered, axis=1)
    if TAIL_N > 0:
        centered_tail = h_tail if IS_RMS else tl.where(tail_mask, h_tail - mean[:, None], 0.0)
        sum_sq += tl.sum(centered_tail * centered_tail, axis=1)
    rstd = 1.0 / tl.sqrt(sum_sq / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)

    _store_row_part(
        centered * rstd[:, None], W, B, Y, SEED, rows, 0, mask, offsets, N, dropout_p, DROPOUT_AFTER, BLOCK_N
    )
    if TAIL_N > 0:
        _store_row_part(
            centered_tail * rstd[:, None],
            W,
            B,
            Y,
            SEED,
            rows,
            BLOCK_N,
            tail_mask,
            tail_offsets,
            N,
            dropout_p,
            DROPOUT_AFTER,
            TAIL_N,
        )


@triton.jit
def _sum_partial_rows(dw_row, db_row, DW_PARTIAL, DB_PARTIAL, DW, DB, ARRIVALS, cols, N, LEVELS: tl.constexpr):
    """Store dw and db (DW, DB: (N,)), the sums over programs of their rows dw_row and db_row
    ([BLOCK_N] fp32 for ``cols``, BLOCK_N >= N), in this launch and the same way on every run:
    over a fixed binary tree of the programs (LEVELS >= log2(programs) levels, unrolled).
    A node's sum is stored at the row of DW_PARTIAL / DB_PARTIAL ((programs, N) fp32) of its
    first program; whichever of two sibling nodes finishes later (ARRIVALS, zero-filled
    (LEVELS, programs) int32, counts them) adds the other's row, read from L2, and goes up,
    the earlier one stops; the program that completes the root stores the result."""
    programs = tl.num_programs(0)
    node = tl.program_id(0)
    span = 1  # programs under node
    finishing = node >= 0  # true, as a tensor (so is the false below): both branches give it one type
    for level in tl.static_range(LEVELS):
        if finishing and (node ^ 1) * span < programs:  # node has a sibling
            if DW_PARTIAL is not None:
                tl.store(DW_PARTIAL + node * span * N + cols, dw_row, mask=cols < N)
            if DB_PARTIAL is not None:
                tl.store(DB_PARTIAL + node * span * N + cols, db_row, mask=cols < N)
            # every thread's stores come before the counter's release (and its acquire before the loads)
            tl.debug_barrier()
            if tl.atomic_add(ARRIVALS + level * programs + node // 2, 1, sem="acq_rel") == 0:
                finishing = node < 0
            else:
                sibling = (node ^ 1) * span * N + cols
                if DW_PARTIAL is not None:
                    dw_row += tl.load(DW_PARTIAL + sibling, mask=cols < N, other=0.0, cache_modifier=".cg")
                if DB_PARTIAL is not None:
                    db_row += tl.load(DB_PARTIAL + sibling, mask=cols < N, other=0.0, cache_modifier=".cg")
        node = node // 2
        span = span * 2
    if finishing:
        if DW is not None:
            tl.store(DW + cols, dw_row.to(DW.dtype.element_ty), mask=cols < N)
        if DB is not None:
            tl.store(DB + cols, db_row.to(DB.dtype.element_ty), mask=cols < N)


@triton.jit
def _norm_bwd_kernel(
    DY,  # (M, N) gradient of the output
    SAVED,  # (M, N) h, or the output y when REBUILD_FROM_OUTPUT
    W,  # (N,) weight, or None
    W_RECIPROCAL,  # (N,) fp32 1 / w when rebuilding x̂ from the output with a weight, or None
    B,  # (N,) bias, or None
    MEAN,  # (M,) fp32 row means, or None
    RSTD,  # (M,) fp32 reciprocal standard deviations
    DH_OUT,  # (M, N) gradient of the returned h, or None
    DX,  # (M, N) gradient of x
    DRESIDUAL,  # (M, N) gradient of the residual when it differs from DX, or None
    DW_PARTIAL,  # (G, N) fp32 per-program sums of dy * x̂, or None
    DB_PARTIAL,  # (G, N) fp32 per-program sums of dy, or None
    DW,  # (N,) dw, the sum of DW_PARTIAL's rows, or None
    DB,  # (N,) db, or None
    ARRIVALS,  # (levels, G) int32 zeros for _sum_partial_rows, or None
    SEED,  # () int64 dropout seed, or None
    M,
    N,
    dropout_p,
    rows_per_program,
    IS_RMS: tl.constexpr,
    REBUILD_FROM_OUTPUT: tl.constexpr,
    N_ALIGN: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    LEVELS: tl.constexpr,  # of _sum_partial_rows' tree
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    N = _aligned(N, N_ALIGN)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if B is not None:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SEED is not None:
        seed = tl.load(SEED)
        threshold, scale = dropout_threshold_and_scale(dropout_p)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row0 in range(row_start, row_end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]

        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT_AFTER:
            dy *= tl.where(dropout_keep_tile(seed, rows, 0, N, threshold, BLOCK_N), scale, 0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        saved = tl.load(SAVED + offsets, mask=mask, other=0.0).to(tl.float32)
        if REBUILD_FROM_OUTPUT:
            if B is not None:
                saved -= b
            if W_RECIPROCAL is not None:
                # reloaded per row (an L1 hit) rather than held, to keep whole wide rows in registers
                # (spills per width: docs/compile-report.md)
                saved *= tl.load(W_RECIPROCAL + cols, mask=col_ok, other=0.0)[None, :]
            x_hat = saved
        elif IS_RMS:
            x_hat = saved * rstd
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
            x_hat = (saved - mean) * rstd
        x_hat = tl.where(mask, x_hat, 0.0)

        g = dy
        if W is not None:
            # w reloaded per row (from L1), as 1 / w above: g is held beside dy
            g = _rounded_product(dy, tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :])
        mean_g_xhat = tl.sum(g * x_hat, axis=1)[:, None] / N
        mean_g = 0.0 if IS_RMS else tl.sum(g, axis=1)[:, None] / N
        dh = _input_grad(g, x_hat, mean_g, mean_g_xhat, rstd, IS_RMS)
        if DH_OUT is not None:
            dh += tl.load(DH_OUT + offsets, mask=mask, other=0.0).to(tl.float32)
        if DRESIDUAL is not None:
            tl.store(DRESIDUAL + offsets, dh.to(DRESIDUAL.dtype.element_ty), mask=mask)
        if SEED is not None and not DROPOUT_AFTER:
            dh *= tl.where(dropout_keep_tile(seed, rows, 0, N, threshold, BLOCK_N), scale, 0.0)
        tl.store(DX + offsets, dh.to(DX.dtype.element_ty), mask=mask)

        if DW_PARTIAL is not None:
            dw_acc += dy * x_hat
        if DB_PARTIAL is not None:
            db_acc += dy

    if ARRIVALS is not None:
        _sum_partial_rows(
            tl.sum(dw_acc, axis=0), tl.sum(db_acc, axis=0), DW_PARTIAL, DB_PARTIAL, DW, DB, ARRIVALS, cols, N, LEVELS
        )


@triton.jit
def _norm_fwd_wide_stats_kernel(
    X,
    RESIDUAL,
    H,
    SEED,  # as in _norm_fwd_kernel
    STATS,  # (M, S, 2) fp32 per row segment: mean of h (RMSNorm: 0), sum of squared deviations from it
    N,
    dropout_p,
    segment_cols,
    IS_RMS: tl.constexpr,
    ROUND_H: tl.constexpr,
    H_DTYPE: tl.constexpr,
    STORE_H: tl.constexpr,
    N_ALIGN: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """First pass of ``_norm_fwd_kernel`` for rows too wide for registers: program (r, s) takes
    segment s (``segment_cols`` columns, a multiple of BLOCK_N) of row r in column blocks,
    stores h when STORE_H and its segment's statistics (Chan's pairwise mean/variance merge
    over the blocks). Rows are split into segments when there are fewer rows than SMs."""
    N = _aligned(N, N_ALIGN)
    row = tl.program_id(0)
    segment = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    start = segment * segment_cols
    mean = tl.zeros([1], tl.float32)
    sum_sq = tl.zeros([1], tl.float32)  # sum of squared deviations from mean (RMSNorm: from 0)
    for col_start in range(start, tl.minimum(start + segment_cols, N), BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (cols < N)[None, :]  # segments end on a block boundary or at N
        offsets = row.to(tl.int64) * N + cols[None, :]
        h = _fused_input(
            X, RESIDUAL, SEED, rows, col_start, offsets, mask, N, dropout_p, ROUND_H, H_DTYPE, DROPOUT_AFTER, BLOCK_N
        )
        if STORE_H:
            tl.store(H + offsets, h.to(H_DTYPE), mask=mask)
        if IS_RMS:
            sum_sq += tl.sum(h * h, axis=1)
        else:
            before = (col_start - start).to(tl.float32)
            seen = (tl.minimum(col_start + BLOCK_N, N) - start).to(tl.float32)
            count = seen - before
            block_mean = tl.sum(h, axis=1) / count
            deviation = tl.where(mask, h - block_mean[:, None], 0.0)
            delta = block_mean - mean
            mean += delta * (count / seen)
            sum_sq += tl.sum(deviation * deviation, axis=1) + delta * delta * (before * count / seen)
    entry = (row * tl.num_programs(1) + segment) * 2 + tl.arange(0, 1)
    tl.store(STATS + entry, mean)
    tl.store(STATS + entry + 1, sum_sq)


@triton.jit
def _norm_fwd_wide_apply_kernel(
    X,
    RESIDUAL,
    W,
    B,
    Y,
    H,
    MEAN,
    RSTD,
    SEED,  # as in _norm_fwd_kernel; X, RESIDUAL None when H is read
    STATS,  # (M, S, 2) fp32 from _norm_fwd_wide_stats_kernel
    N,
    eps,
    dropout_p,
    segment_cols,
    IS_RMS: tl.constexpr,
    ROUND_H: tl.constexpr,
    H_DTYPE: tl.constexpr,
    N_ALIGN: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    SEGMENTS: tl.constexpr,  # a power of two >= S
    BLOCK_N: tl.constexpr,
):
    """Second pass: program (r, s) merges row r's segment statistics (every program of the
    row the same way, in the same order), then writes y for its segment from h reloaded
    (H given) or recomputed from x and the residual (not stored: memory-efficient mode)."""
    N = _aligned(N, N_ALIGN)
    row = tl.program_id(0)
    segment = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    segments = tl.num_programs(1)
    index = tl.arange(0, SEGMENTS)
    valid = index < segments
    entries = (row * segments + index) * 2
    segment_sum_sq = tl.load(STATS + entries + 1, mask=valid, other=0.0)
    if IS_RMS:
        sum_sq = tl.sum(segment_sum_sq, axis=0)
    else:
        segment_mean = tl.load(STATS + entries, mask=valid, other=0.0)
        counts = tl.minimum(tl.maximum(N - index * segment_cols, 0), segment_cols).to(tl.float32)
        mean = tl.sum(counts * segment_mean, axis=0) / N
        spread = segment_mean - mean
        sum_sq = tl.sum(segment_sum_sq + counts * spread * spread, axis=0)
    rstd = 1.0 / tl.sqrt(sum_sq / N + eps)
    if segment == 0:
        tl.store(RSTD + row, rstd)
        if not IS_RMS and MEAN is not None:
            tl.store(MEAN + row, mean)
    start = segment * segment_cols
    for col_start in range(start, tl.minimum(start + segment_cols, N), BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (cols < N)[None, :]
        offsets = row.to(tl.int64) * N + cols[None, :]
        if H is not None:
            h = tl.load(H + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            h = _fused_input(
                X,
                RESIDUAL,
                SEED,
                rows,
                col_start,
                offsets,
                mask,
                N,
                dropout_p,
                ROUND_H,
                H_DTYPE,
                DROPOUT_AFTER,
                BLOCK_N,
            )
        y = h * rstd if IS_RMS else (h - mean) * rstd
        _store_row_part(y, W, B, Y, SEED, rows, col_start, mask, offsets, N, dropout_p, DROPOUT_AFTER, BLOCK_N)


@triton.jit
def _x_hat_and_g(
    DY,
    SAVED,
    W,
    W_RECIPROCAL,
    B,
    MEAN,
    SEED,
    rows,
    col_start,
    cols,
    offsets,
    mask,
    rstd,
    N,
    dropout_p,
    IS_RMS: tl.constexpr,
    REBUILD_FROM_OUTPUT: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(dy, x̂, g = dy · w) in fp32 for one tile of rows x cols, dy masked by a dropout that
    follows the norm; x̂ is 0 outside ``mask``."""
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT_AFTER:
        dy *= _dropout_scale_tile(SEED, rows, col_start, N, dropout_p, BLOCK_N)
    saved = tl.load(SAVED + offsets, mask=mask, other=0.0).to(tl.float32)
    g = dy
    if W is not None:
        g = _rounded_product(dy, tl.load(W + cols[None, :], mask=mask, other=0.0).to(tl.float32))
    if REBUILD_FROM_OUTPUT:
        if B is not None:
            saved -= tl.load(B + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if W_RECIPROCAL is not None:
            saved *= tl.load(W_RECIPROCAL + cols[None, :], mask=mask, other=0.0)
        x_hat = saved
    elif IS_RMS:
        x_hat = saved * rstd
    else:
        x_hat = (saved - tl.load(MEAN + rows)[:, None]) * rstd
    return dy, tl.where(mask, x_hat, 0.0), g


@triton.jit
def _rounded_product(a, b):
    """a · b, rounded before any use. g = dy · w enters mean(g) rounded; contracted into
    g − mean(g) as a fused multiply-add it would enter there unrounded, and rstd · (g −
    mean(g)) amplifies the difference (rstd = 1 / sqrt(eps) on a constant row: dx ~1e-5
    where it is 0). Compiled, PTX's mul.rn (no ftz: denormals stay) is never contracted;
    the interpreter does not contract."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _input_grad(g, x_hat, mean_g, mean_g_xhat, rstd, IS_RMS: tl.constexpr):
    """dh = rstd · (g - mean(g) - x̂ · mean(g · x̂)) (RMSNorm: no mean(g) term)."""
    if IS_RMS:
        return (g - x_hat * mean_g_xhat) * rstd
    return (g - mean_g - x_hat * mean_g_xhat) * rstd


@triton.jit
def _norm_bwd_wide_kernel(
    DY,
    SAVED,
    W,
    W_RECIPROCAL,
    B,
    MEAN,
    RSTD,
    DH_OUT,
    DX,
    DRESIDUAL,
    DW_PARTIAL,
    DB_PARTIAL,
    SEED,  # as in _norm_bwd_kernel
    M,
    N,
    dropout_p,
    rows_per_program,
    IS_RMS: tl.constexpr,
    REBUILD_FROM_OUTPUT: tl.constexpr,
    N_ALIGN: tl.constexpr,
    DROPOUT_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``_norm_bwd_kernel`` for rows too wide for registers: each program walks its rows one at
    a time, in column blocks: the two row sums first, then dh. Its partial dw/db row is
    accumulated in place (written at its first row, then read-added-written by the same
    threads), so no memset is needed."""
    N = _aligned(N, N_ALIGN)
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        rows = row + tl.arange(0, 1)
        rstd = tl.load(RSTD + rows)[:, None]
        sum_g_xhat = tl.zeros([1], tl.float32)
        sum_g = tl.zeros([1], tl.float32)
        for col_start in range(0, N, BLOCK_N):
            cols = col_start + tl.arange(0, BLOCK_N)
            mask = (cols < N)[None, :]
            offsets = tl.cast(row, tl.int64) * N + cols[None, :]
            dy, x_hat, g = _x_hat_and_g(
                DY,
                SAVED,
                W,
                W_RECIPROCAL,
                B,
                MEAN,
                SEED,
                rows,
                col_start,
                cols,
                offsets,
                mask,
                rstd,
                N,
                dropout_p,
                IS_RMS,
                REBUILD_FROM_OUTPUT,
                DROPOUT_AFTER,
                BLOCK_N,
            )
            sum_g_xhat += tl.sum(g * x_hat, axis=1)
            sum_g += tl.sum(g, axis=1)
        mean_g_xhat = (sum_g_xhat / N)[:, None]
        mean_g = (sum_g / N)[:, None]
        for col_start in range(0, N, BLOCK_N):
            cols = col_start + tl.arange(0, BLOCK_N)
            mask = (cols < N)[None, :]
            offsets = tl.cast(row, tl.int64) * N + cols[None, :]
            dy, x_hat, g = _x_hat_and_g(
                DY,
                SAVED,
                W,
                W_RECIPROCAL,
                B,
                MEAN,
                SEED,
                rows,
                col_start,
                cols,
                offsets,
                mask,
                rstd,
                N,
                dropout_p,
                IS_RMS,
                REBUILD_FROM_OUTPUT,
                DROPOUT_AFTER,
                BLOCK_N,
            )
            dh = _input_grad(g, x_hat, mean_g, mean_g_xhat, rstd, IS_RMS)
            if DH_OUT is not None:
                dh += tl.load(DH_OUT + offsets, mask=mask, other=0.0).to(tl.float32)
            if DRESIDUAL is not None:
                tl.store(DRESIDUAL + offsets, dh.to(DRESIDUAL.dtype.element_ty), mask=mask)
            if SEED is not None and not DROPOUT_AFTER:
                dh *= _dropout_scale_tile(SEED, rows, col_start, N, dropout_p, BLOCK_N)
            tl.store(DX + offsets, dh.to(DX.dtype.element_ty), mask=mask)
            accumulated = (cols < N) & (row > row_start)
            if DW_PARTIAL is not None:
                partial = DW_PARTIAL + pid * N + cols
                previous = tl.load(partial, mask=accumulated, other=0.0)
                tl.store(partial, previous + tl.sum(dy * x_hat, axis=0), mask=cols < N)
            if DB_PARTIAL is not None:
                partial = DB_PARTIAL + pid * N + cols
                previous = tl.load(partial, mask=accumulated, other=0.0)
                tl.store(partial, previous + tl.sum(dy, axis=0), mask=cols < N)


@dataclass(frozen=True)
class _NormSpec:
    """The static description of one norm call (everything but the tensors)."""

    is_rms: bool
    normalized_ndim: int
    eps: float
    dropout_p: float
    rebuild_from_output: bool
    return_residual: bool
    out_dtype: torch.dtype
    dropout_after: bool = False

    def fields(self) -> tuple:
        """The fields in order, as the ops take them (``dataclasses.astuple`` deep-copies each)."""
        return (
            self.is_rms,
            self.normalized_ndim,
            self.eps,
            self.dropout_p,
            self.rebuild_from_output,
            self.return_residual,
            self.out_dtype,
            self.dropout_after,
        )

    @property
    def dropout_scale(self) -> float:
        return dropout_threshold(self.dropout_p)[1]


def _block_config(n_cols: int, forward: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_M rows, BLOCK_N columns, num_warps, wide): whole rows in registers, several when
    rows are short, 16 fp32 values per thread in backward, which holds six values per element;
    forward holds two and takes 32 per thread, so its row sums (shuffles, and shared memory
    across warps) are shared by twice the elements, and whole rows up to 16384 columns.
    Wider rows go in 4096-column blocks (``wide``)."""
    if n_cols > (_MAX_WHOLE_ROW_FORWARD if forward else _MAX_WHOLE_ROW):
        return 1, _WIDE_BLOCK_N, _WIDE_BLOCK_N // 512, True
    block_n = max(DECISIONS_PER_CALL, next_power_of_2(n_cols))
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = max(4, block_m * block_n // 512)
    return block_m, block_n, max(1, num_warps // 2) if forward else num_warps, False


def _row_split(n_cols: int, block_m: int, block_n: int, num_warps: int) -> tuple[int, int, int]:
    """(head, tail, num_warps) of the whole-row forward: a row of n_cols <= block_n columns is
    held as head + tail lanes, both powers of two (tail 0: one block of block_n), the pair with
    the fewest idle lanes: 768 -> 512 + 256 rather than 1024, a quarter of them idle. A split
    row keeps at most 48 values per thread (the rule's 32 to 64 for whole blocks) by halving
    the warps, whose row sums then cost fewer shuffles and shared-memory round trips."""
    head = block_n // 2
    tail = max(DECISIONS_PER_CALL, next_power_of_2(max(n_cols - head, 1)))
    if n_cols <= head or tail >= head:
        return block_n, 0, num_warps
    return head, tail, next_power_of_2(cdiv(block_m * (head + tail), 32 * 48))


def _row_alignment(n_cols: int) -> int:
    """The largest power of two <= 8 dividing n_cols: 8 makes every row of a 16-bit (M, N)
    tensor 16-byte aligned, so the kernels load and store whole vectors."""
    return math.gcd(n_cols, 8)


def _input_is_fused(seed, residual, spec: _NormSpec) -> bool:
    """Whether the norm's input h is something other than x itself."""
    return (seed is not None and not spec.dropout_after) or residual is not None


def _h_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _norm_fwd(x, residual, weight, bias, seed, spec: _NormSpec, shape: torch.Size):
    """Launch the forward kernel on (M, N) rows. Returns (y, h or None, mean or None, rstd), with
    y and h allocated in the caller's ``shape`` (the kernel only sees their flat storage)."""
    M, N = x.shape
    fused = _input_is_fused(seed, residual, spec)
    store_h = fused and (spec.return_residual or not spec.rebuild_from_output)
    y = torch.empty(shape, dtype=spec.out_dtype, device=x.device)
    h = torch.empty(shape, dtype=_h_dtype(x, residual), device=x.device) if store_h else None
    keep_mean = not spec.is_rms and not spec.rebuild_from_output
    mean = torch.empty(M, dtype=torch.float32, device=x.device) if keep_mean else None
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y, h, mean, rstd
    block_m, block_n, num_warps, wide = _block_config(N, forward=True)
    flags = dict(
        IS_RMS=spec.is_rms,
        ROUND_H=fused,
        H_DTYPE=_TL_DTYPES[_h_dtype(x, residual)],
        STORE_H=store_h,
        N_ALIGN=_row_alignment(N),
        DROPOUT_AFTER=spec.dropout_after and seed is not None,
    )
    args = (x, residual, weight, bias, y, h, mean, rstd, seed, M, N, spec.eps, spec.dropout_p)
    if wide:
        _norm_fwd_wide(x, residual, weight, bias, y, h, mean, rstd, seed, spec, flags, block_n, num_warps)
    else:
        head, tail, num_warps = _row_split(N, block_m, block_n, num_warps)
        _norm_fwd_kernel[(cdiv(M, block_m),)](
            *args, **flags, BLOCK_M=block_m, BLOCK_N=head, TAIL_N=tail, num_warps=num_warps
        )
    return y, h, mean, rstd


def _norm_fwd_wide(x, residual, weight, bias, y, h, mean, rstd, seed, spec, flags, block_n, num_warps):
    """The two passes over rows wider than registers hold. With fewer rows than SMs, each row
    is split into S segments of whole column blocks (grid (M, S)) so that every SM works."""
    M, N = x.shape
    blocks = cdiv(N, block_n)
    segment_cols = cdiv(blocks, max(1, min(blocks, multiprocessor_count(x.device) // M))) * block_n
    segments = cdiv(N, segment_cols)
    stats = torch.empty((M, segments, 2), dtype=torch.float32, device=x.device)
    _norm_fwd_wide_stats_kernel[(M, segments)](
        x, residual, h, seed, stats, N, spec.dropout_p, segment_cols, **flags, BLOCK_N=block_n, num_warps=num_warps
    )
    recompute = h is None  # memory-efficient mode: h is recomputed, not reloaded
    _norm_fwd_wide_apply_kernel[(M, segments)](
        x if recompute else None,
        residual if recompute else None,
        weight,
        bias,
        y,
        h,
        mean,
        rstd,
        seed if recompute or flags["DROPOUT_AFTER"] else None,
        stats,
        N,
        spec.eps,
        spec.dropout_p,
        segment_cols,
        **{k: v for k, v in flags.items() if k != "STORE_H"},
        SEGMENTS=next_power_of_2(segments),
        BLOCK_N=block_n,
        num_warps=num_warps,
    )


def _norm_bwd(dy, dh_out, saved, weight, bias, mean, rstd, seed, x_dtype, residual_dtype, spec):
    """Launch the backward kernel. Returns (dx, dresidual or None, dw or None, db or None)."""
    M, N = dy.shape
    dx = torch.empty((M, N), dtype=x_dtype, device=dy.device)
    separate_dresidual = residual_dtype is not None and (seed is not None or residual_dtype != x_dtype)
    dresidual = torch.empty((M, N), dtype=residual_dtype, device=dy.device) if separate_dresidual else None
    block_m, block_n, num_warps, wide = _block_config(max(N, 1))
    # One fp32 partial row of dw (and db) per program, at most one program per SM, each with
    # at least one row: every partial row is written, so nothing is zero-filled first. The
    # whole-row kernel sums them itself (``_sum_partial_rows``), into dw and db in their dtypes.
    programs = max(1, min(cdiv(M, block_m), multiprocessor_count(dy.device)))
    rows_per_program = max(1, cdiv(cdiv(M, programs), block_m)) * block_m
    programs = max(1, cdiv(M, rows_per_program))
    partial_shape = (programs, N)
    allocate = torch.empty if M > 0 else torch.zeros
    dw_partial = None if weight is None else allocate(partial_shape, dtype=torch.float32, device=dy.device)
    db_partial = None if bias is None else allocate(partial_shape, dtype=torch.float32, device=dy.device)
    summed_in_kernel = M > 0 and N > 0 and not wide
    dw = None if weight is None or not summed_in_kernel else torch.empty(N, dtype=weight.dtype, device=dy.device)
    db = None if bias is None or not summed_in_kernel else torch.empty(N, dtype=bias.dtype, device=dy.device)
    if M > 0 and N > 0:
        # x̂ = (y - b) · (1 / w): a multiply per element instead of a division
        w_reciprocal = weight.float().reciprocal() if spec.rebuild_from_output and weight is not None else None
        args = (dy, saved, weight, w_reciprocal, bias, mean, rstd, dh_out, dx, dresidual, dw_partial, db_partial)
        scalars = (seed, M, N, spec.dropout_p, rows_per_program)
        flags = dict(
            IS_RMS=spec.is_rms,
            REBUILD_FROM_OUTPUT=spec.rebuild_from_output,
            N_ALIGN=_row_alignment(N),
            DROPOUT_AFTER=spec.dropout_after and seed is not None,
        )
        if wide:
            _norm_bwd_wide_kernel[(programs,)](*args, *scalars, **flags, BLOCK_N=block_n, num_warps=num_warps)
        else:
            # enough tree levels for one program per SM, so that the kernel compiles once per device
            levels = max(1, (multiprocessor_count(dy.device) - 1).bit_length())
            summed = weight is not None or bias is not None
            arrivals = torch.zeros((levels, programs), dtype=torch.int32, device=dy.device) if summed else None
            _norm_bwd_kernel[(programs,)](
                *args,
                dw,
                db,
                arrivals,
                *scalars,
                **flags,
                LEVELS=levels,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                num_warps=num_warps,
            )
    if residual_dtype is not None and dresidual is None:
        dresidual = dx
    if not summed_in_kernel:
        dw = None if weight is None else dw_partial.sum(0).to(weight.dtype)
        db = None if bias is None else db_partial.sum(0).to(bias.dtype)
    return dx, dresidual, dw, db


def _runs_kernels(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype != torch.float64


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' compute dtype for tensors of ``dtype``: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _dropout_scale_rows(seed, start: int, stop: int, n_cols: int, spec: _NormSpec, dtype, device) -> torch.Tensor:
    """keep · scale in ``dtype`` for rows start:stop of the (M, n_cols) rows, as the kernels draw it."""
    keep = dropout_keep_block(seed, torch.arange(start, stop, device=device), 0, n_cols, n_cols, spec.dropout_p)
    return keep.to(dtype).mul_(spec.dropout_scale)


def _norm_fwd_reference(x, residual, weight, bias, seed, spec: _NormSpec, shape: torch.Size):
    """PyTorch statement of ``_norm_fwd``: same outputs, same dtypes, same mask, in blocks of
    rows (torch's fused CPU LayerNorm for the normalisation), in fp32, or fp64 for fp64."""
    M, N = x.shape
    fused = _input_is_fused(seed, residual, spec)
    store_h = fused and (spec.return_residual or not spec.rebuild_from_output)
    keep_mean = not spec.is_rms and not spec.rebuild_from_output
    h_dtype = _h_dtype(x, residual)
    acc = _reference_dtype(h_dtype)
    # new tensors, not views: an output of the differentiable op can be modified in place
    y = torch.empty(shape, dtype=spec.out_dtype, device=x.device)
    h_out = torch.empty(shape, dtype=h_dtype, device=x.device) if store_h else None
    mean = torch.empty(M, dtype=acc, device=x.device)
    rstd = torch.empty(M, dtype=acc, device=x.device)
    w = None if weight is None else weight.to(acc)
    b = None if bias is None else bias.to(acc)
    for start, stop in reference_row_blocks(M, N):
        h = x[start:stop].to(acc)
        if seed is not None and not spec.dropout_after:
            h = h * _dropout_scale_rows(seed, start, stop, N, spec, acc, x.device)
        if residual is not None:
            h = h + residual[start:stop].to(acc)
        if fused:
            h = h.to(h_dtype)
            if store_h:
                h_out.view(M, N)[start:stop] = h
            h = h.to(acc)
        if spec.is_rms:
            rstd[start:stop] = torch.rsqrt(h.square().mean(dim=1) + spec.eps)
            y_rows = h * rstd[start:stop, None]
            y_rows = y_rows if w is None else y_rows.mul_(w)
        else:
            y_rows, block_mean, block_rstd = torch.native_layer_norm(h, [N], w, b, spec.eps)
            mean[start:stop], rstd[start:stop] = block_mean.view(-1), block_rstd.view(-1)
        if spec.dropout_after and seed is not None:
            y_rows = y_rows.mul_(_dropout_scale_rows(seed, start, stop, N, spec, acc, x.device))
        y.view(M, N)[start:stop] = y_rows
    if M and not N:  # no blocks: the statistics of empty rows, as the row formulas give them
        mean.fill_(math.nan)
        rstd.fill_(math.nan)
    return y, h_out, mean if keep_mean else None, rstd


def _norm_bwd_reference(dy, dh_out, saved, weight, bias, mean, rstd, seed, x_dtype, residual_dtype, spec):
    """PyTorch statement of ``_norm_bwd``, in blocks of rows (torch's LayerNorm backward
    for LayerNorm; with a rebuilt x̂ it runs on x̂ with mean 0 and rstd 1, then scales by rstd),
    in the forward's compute dtype (rstd's)."""
    M, N = dy.shape
    acc = rstd.dtype
    dx = torch.empty((M, N), dtype=x_dtype, device=dy.device)
    separate_dresidual = residual_dtype is not None and (seed is not None or residual_dtype != x_dtype)
    dresidual = torch.empty((M, N), dtype=residual_dtype, device=dy.device) if separate_dresidual else None
    w = None if weight is None else weight.to(acc)
    b = None if bias is None else bias.to(acc)
    dw = None if weight is None else torch.zeros(N, dtype=acc, device=dy.device)
    db = None if bias is None else torch.zeros(N, dtype=acc, device=dy.device)
    for start, stop in reference_row_blocks(M, N):
        dy_rows, saved_rows = dy[start:stop].to(acc), saved[start:stop].to(acc)
        if spec.dropout_after and seed is not None:
            dy_rows = dy_rows * _dropout_scale_rows(seed, start, stop, N, spec, acc, dy.device)
        block_rstd = rstd[start:stop, None]
        if spec.rebuild_from_output:
            x_hat = saved_rows if b is None else saved_rows - b
            x_hat = x_hat if w is None else x_hat / w
        elif spec.is_rms:
            x_hat = saved_rows * block_rstd
        else:
            x_hat = None
        if spec.is_rms:
            g = dy_rows if w is None else dy_rows * w
            dh = (g - x_hat * (g * x_hat).mean(dim=1, keepdim=True)).mul_(block_rstd)
            dw_rows = None if w is None else (dy_rows * x_hat).sum(dim=0)
            db_rows = None
        elif x_hat is None:
            dh, dw_rows, db_rows = torch.ops.aten.native_layer_norm_backward(
                dy_rows, saved_rows, [N], mean[start:stop, None], block_rstd, w, b, [True, w is not None, b is not None]
            )
        else:
            stats = torch.zeros_like(block_rstd), torch.ones_like(block_rstd)
            dh, dw_rows, db_rows = torch.ops.aten.native_layer_norm_backward(
                dy_rows, x_hat, [N], *stats, w, b, [True, w is not None, b is not None]
            )
            dh.mul_(block_rstd)
        if dw is not None:
            dw += dw_rows
        if db is not None:
            db += dy_rows.sum(dim=0) if db_rows is None else db_rows
        if dh_out is not None:
            dh += dh_out[start:stop].to(acc)
        if dresidual is not None:
            dresidual[start:stop] = dh
        if seed is not None and not spec.dropout_after:
            dh.mul_(_dropout_scale_rows(seed, start, stop, N, spec, acc, dy.device))
        dx[start:stop] = dh
    if residual_dtype is not None and dresidual is None:
        dresidual = dx
    return dx, dresidual, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def _as_rows(t: torch.Tensor, spec: _NormSpec) -> torch.Tensor:
    """View a contiguous (..., *normalized_shape) tensor as (M, N) rows."""
    split = t.dim() - spec.normalized_ndim
    return t.view(math.prod(t.shape[:split]), math.prod(t.shape[split:]))


# The differentiable op: two ``torch.library`` ops (forward, backward) joined by
# ``register_autograd``, so that torch.compile keeps exactly the tensors listed below
# instead of re-planning what to save. The spec travels as its fields (schema types).


@functools.lru_cache(maxsize=256)  # one spec per distinct call, made once: every norm asks for its own
def _spec(
    is_rms, normalized_ndim, eps, dropout_p, rebuild_from_output, return_residual, out_dtype, dropout_after
) -> _NormSpec:
    return _NormSpec(
        is_rms, normalized_ndim, eps, dropout_p, rebuild_from_output, return_residual, out_dtype, dropout_after
    )


def _stores_h(fused: bool, spec: _NormSpec) -> bool:
    return fused and (spec.return_residual or not spec.rebuild_from_output)


def _keeps_mean(spec: _NormSpec) -> bool:
    return not spec.is_rms and not spec.rebuild_from_output


@torch.library.custom_op("slimformer::fused_norm", mutates_args=())
def _norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    is_rms: bool,
    normalized_ndim: int,
    eps: float,
    dropout_p: float,
    rebuild_from_output: bool,
    return_residual: bool,
    out_dtype: torch.dtype,
    dropout_after: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd) for contiguous x (and residual) of the caller's shape; h and mean
    are empty placeholders where ``_stores_h`` / ``_keeps_mean`` say they are not produced."""
    spec = _spec(
        is_rms, normalized_ndim, eps, dropout_p, rebuild_from_output, return_residual, out_dtype, dropout_after
    )
    rows = _as_rows(x, spec)
    residual_rows = None if residual is None else _as_rows(residual, spec)
    fwd = _norm_fwd if _runs_kernels(x) else _norm_fwd_reference
    # y and h come back in x's shape and are not views: outputs may be changed in place.
    y, h, mean, rstd = fwd(rows, residual_rows, weight, bias, seed, spec, x.shape)
    return (
        y,
        absent_output(x.device) if h is None else h,
        absent_output(x.device) if mean is None else mean,
        rstd,
    )


@_norm_op.register_fake
def _(
    x,
    residual,
    weight,
    bias,
    seed,
    is_rms,
    normalized_ndim,
    eps,
    dropout_p,
    rebuild_from_output,
    return_residual,
    out_dtype,
    dropout_after,
):
    spec = _spec(
        is_rms, normalized_ndim, eps, dropout_p, rebuild_from_output, return_residual, out_dtype, dropout_after
    )
    rows = math.prod(x.shape[: x.dim() - normalized_ndim])
    fused = _input_is_fused(seed, residual, spec)
    h = torch.empty(x.shape, dtype=_h_dtype(x, residual), device=x.device) if _stores_h(fused, spec) else None
    stats = _reference_dtype(x.dtype)  # the kernels' fp32 too
    mean = torch.empty(rows, dtype=stats, device=x.device) if _keeps_mean(spec) else None
    return (
        torch.empty(x.shape, dtype=out_dtype, device=x.device),
        absent_output(x.device) if h is None else h,
        absent_output(x.device) if mean is None else mean,
        torch.empty(rows, dtype=stats, device=x.device),
    )


def _separate_dresidual(seed, x_dtype, residual_dtype) -> bool:
    """Whether dresidual differs from dx (else backward hands dx out for both)."""
    return residual_dtype is not None and (seed is not None or residual_dtype != x_dtype)


@torch.library.custom_op("slimformer::fused_norm_backward", mutates_args=())
def _norm_backward_op(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    seed: torch.Tensor | None,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    is_rms: bool,
    normalized_ndim: int,
    eps: float,
    dropout_p: float,
    rebuild_from_output: bool,
    dropout_after: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual, dw, db) in the caller's shape; dresidual is a placeholder where it
    is dx itself (no dropout, one dtype), dw and db where there is no weight / bias."""
    spec = _spec(is_rms, normalized_ndim, eps, dropout_p, rebuild_from_output, False, x_dtype, dropout_after)
    shape = dy.shape
    bwd = _norm_bwd if _runs_kernels(saved) else _norm_bwd_reference
    dx, dresidual, dw, db = bwd(
        _as_rows(dy.contiguous(), spec),
        None if dh_out is None else _as_rows(dh_out.contiguous(), spec),
        _as_rows(saved, spec),
        weight,
        bias,
        mean,
        rstd,
        seed,
        x_dtype,
        residual_dtype,
        spec,
    )
    return (
        dx.view(shape),
        absent_output(dy.device) if dresidual is None or dresidual is dx else dresidual.view(shape),
        absent_output(dy.device) if dw is None else dw,
        absent_output(dy.device) if db is None else db,
    )


@_norm_backward_op.register_fake
def _(
    dy,
    dh_out,
    saved,
    weight,
    bias,
    mean,
    rstd,
    seed,
    x_dtype,
    residual_dtype,
    is_rms,
    normalized_ndim,
    eps,
    dropout_p,
    rebuild_from_output,
    dropout_after,
):
    separate = _separate_dresidual(seed, x_dtype, residual_dtype)
    return (
        torch.empty(dy.shape, dtype=x_dtype, device=dy.device),
        torch.empty(dy.shape, dtype=residual_dtype, device=dy.device) if separate else absent_output(dy.device),
        absent_output(dy.device) if weight is None else torch.empty_like(weight),
        absent_output(dy.device) if bias is None else torch.empty_like(bias),
    )


def _norm_setup_context(ctx, inputs, output):
    """Saves h (x itself when nothing is fused, y in memory-efficient mode), the weights,
    the fp32 statistics and the seed."""
    x, residual, weight, bias, seed, *fields = inputs
    spec = _spec(*fields)
    y, h, mean, rstd = output
    ctx.has_h = _stores_h(_input_is_fused(seed, residual, spec), spec)
    saved = y if spec.rebuild_from_output else (h if ctx.has_h else x)
    ctx.save_for_backward(saved, weight, bias, mean if _keeps_mean(spec) else None, rstd, seed)
    ctx.mark_non_differentiable(mean, rstd, *(() if ctx.has_h else (h,)))
    ctx.set_materialize_grads(False)  # an unused h gets no zero gradient
    ctx.spec = spec
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype


def _norm_backward(ctx, dy, dh_out, _dmean, _drstd):
    """When dx and dresidual are one tensor (no dropout, one dtype), returns that very
    object twice, as torch's add does: two views of it would let autograd steal both as
    two leaves' ``.grad`` sharing one storage, and the next accumulation into one would
    change the other."""
    try:
        saved, weight, bias, mean, rstd, seed = ctx.saved_tensors
    except RuntimeError as error:
        if ctx.spec.rebuild_from_output and "inplace operation" in str(error):
            raise RuntimeError(
                "the output of a memory-efficient slimformer LayerNorm/RMSNorm was modified in place, "
                "but its backward rebuilds the input from that output; use memory_efficient=False "
                "(it keeps the input, as torch.nn.LayerNorm does) or an out-of-place op"
            ) from error
        raise
    spec = ctx.spec
    if dy is None and (dh_out is None or not ctx.has_h):  # no output got a gradient
        return (None,) * 13
    if dy is None:  # only h was used
        dy = torch.zeros(saved.shape, dtype=spec.out_dtype, device=saved.device)
    dx, dresidual, dw, db = direct(_norm_backward_op)(
        dy,
        dh_out if ctx.has_h else None,
        saved,
        weight,
        bias,
        mean,
        rstd,
        seed,
        ctx.x_dtype,
        ctx.residual_dtype,
        spec.is_rms,
        spec.normalized_ndim,
        spec.eps,
        spec.dropout_p,
        spec.rebuild_from_output,
        spec.dropout_after,
    )
    if ctx.residual_dtype is None:
        dresidual = None
    elif not _separate_dresidual(seed, ctx.x_dtype, ctx.residual_dtype):
        dresidual = dx
    return (
        dx,
        dresidual,
        None if weight is None else dw,
        None if bias is None else db,
        None,
        *(None,) * 8,
    )


_norm = eager_autograd(_norm_op, _norm_backward, _norm_setup_context)


def output_rebuilds_input_flag(weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``output_rebuilds_input`` as a 0-d bool tensor on the weights' device (no host sync),
    for deciding many norms with one sync (``slimformer.layers.memory_modes``)."""
    if weight is None:
        return torch.tensor(True)
    w = weight.detach().float().abs()
    ok = torch.isfinite(w).all() & (w >= _MIN_ABS_WEIGHT).all()
    if bias is not None:
        ok &= (bias.detach().float().abs() <= _MAX_BIAS_OVER_WEIGHT * w).all()
    return ok


def output_rebuilds_input(weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether x̂ = (y - b) / w can be trusted, so the memory-efficient mode is safe.

    True when every |w| >= 1e-3 and |b| <= 7 |w| (y's rounding error then grows at most
    8x in x̂). Reads the weights (a host sync); the layers' ``MemoryModes``
    (``slimformer.layers.memory_modes``) decides it for many norms with one sync. Weights on the meta device have no values to judge: False.
    """
    if weight is not None and weight.is_meta:
        return False
    return bool(output_rebuilds_input_flag(weight, bias))


def check_normalized_shape(normalized_shape) -> tuple[int, ...]:
    """``normalized_shape`` (an int or a sequence of ints) as a tuple; TypeError/ValueError otherwise."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    # the common case first, without the Sequence ABC's isinstance (µs a call)
    plain = type(shape) in (tuple, torch.Size, list) and all(type(d) is int for d in shape)
    if not plain and (
        not isinstance(shape, Sequence) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__} "
            f"{normalized_shape!r}"
        )
    if not shape or any(d < 0 for d in shape):
        raise ValueError(f"normalized_shape must be a non-empty sequence of sizes, got {normalized_shape!r}")
    return tuple(shape)


def check_eps(eps) -> None:
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__} {eps!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _normalized_size(x: torch.Tensor, normalized_shape) -> tuple[tuple[int, ...], int]:
    shape = check_normalized_shape(normalized_shape)
    if tuple(x.shape[len(x.shape) - len(shape) :]) != shape or len(shape) > x.dim():
        raise ValueError(
            f"normalized_shape {list(shape)} must match the last dimensions of input, got input shape {list(x.shape)}"
        )
    n_cols = math.prod(shape)
    if n_cols > MAX_HIDDEN_SIZE:
        raise ValueError(f"normalized_shape covers {n_cols} features; at most {MAX_HIDDEN_SIZE} are supported")
    return shape, n_cols


def _check_tensor(name: str, tensor, x: torch.Tensor, shape, autocast: bool) -> None:
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.device != x.device:
        raise ValueError(f"{name} must be on the input's device {x.device}, got {tensor.device}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {tensor.dtype}")
    if torch.float64 in (x.dtype, tensor.dtype) and tensor.dtype != x.dtype:
        # autocast casts no float64 tensor, so eager torch fails on this pair too
        raise TypeError(f"{name} dtype must match input dtype {x.dtype} when either is float64, got {tensor.dtype}")
    if not autocast and tensor.dtype != x.dtype:
        raise TypeError(f"{name} dtype must match input dtype {x.dtype} outside autocast, got {tensor.dtype}")


def _output_dtype(x: torch.Tensor, residual: torch.Tensor | None, autocast: bool) -> torch.dtype:
    # CUDA autocast runs layer_norm/rms_norm in float32 (float64 stays float64); elsewhere the
    # norm's input h = x + residual sets it (the types promote under autocast, as eager x + residual does).
    cuda_autocast = autocast and x.device.type == "cuda" and x.dtype != torch.float64
    return torch.float32 if cuda_autocast else _h_dtype(x, residual)


def fused_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    is_rms: bool,
    residual: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    memory_efficient: bool = False,
    return_residual: bool = False,
    dropout_after: bool = False,
):
    """LayerNorm or RMSNorm of dropout(x) + residual, or dropout of the norm of x: the one
    checked entry of the fused norm, which ``layer_norm``, ``rms_norm`` and the layers call.

    Computes h = dropout(x, dropout_p) + residual (h = x without either), then
    y = (h - mean(h)) · rstd · weight + bias, or y = h · rstd · weight with ``is_rms``,
    statistics in fp32 (float64 for float64 input).

    x: (..., *normalized_shape), float32, float16 or bfloat16 (the Triton kernel on CUDA,
        the PyTorch reference elsewhere) or float64 (the reference, on any device); at most
        65536 normalised features.
    normalized_shape: an int or a sequence of ints, the last dimensions of x.
    weight, bias: normalized_shape, or None; x's dtype outside autocast and whenever
        either is float64. ``bias`` is None for RMSNorm.
    eps: >= 0, added to the variance (mean square for RMSNorm).
    is_rms: RMSNorm (no mean subtracted, no bias) instead of LayerNorm.
    residual: x's shape, or None; added after the dropout.
    dropout_p: in [0, 1); pass 0 in eval. The mask is regenerated in backward from a seed.
    memory_efficient: save y instead of h and rebuild x̂ = (y - b) / w in backward. Not
        checked here: the caller decides that the weights allow it
        (``output_rebuilds_input``; the layers' ``MEMORY_MODES``). Ignored when
        ``dropout_after`` drops anything (y then has zeros where x̂ does not).
    return_residual: also return h (the next pre-LN block's residual); needs ``residual``.
    dropout_after: apply the dropout to y instead of x, out = dropout(y) (the LayerNorm
        then dropout that ends BERT-family embeddings); x itself is saved when dropout_p > 0.

    Returns y shaped like x, in float32 under CUDA autocast, else in the dtype of
    x + residual; with ``return_residual``, (y, h).

    Raises:
        TypeError: x is not a float tensor of a supported dtype; weight, bias or residual
            is not a tensor or None, or has a dtype that does not match x as above; eps or
            dropout_p is not a real number.
        ValueError: normalized_shape is not x's last dimensions or is wider than 65536;
            weight, bias or residual has the wrong shape or device; eps < 0; dropout_p
            outside [0, 1); return_residual without residual.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input must be float32, float16, bfloat16 or float64, got {x.dtype}")
    shape, n_cols = _normalized_size(x, normalized_shape)
    autocast = torch.is_autocast_enabled(x.device.type)
    _check_tensor("weight", weight, x, shape, autocast)
    _check_tensor("bias", bias, x, shape, autocast)
    _check_tensor("residual", residual, x, x.shape, autocast)
    check_eps(eps)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if return_residual and residual is None:
        raise ValueError("return_residual=True needs a residual tensor to add")

    spec = _NormSpec(
        is_rms=is_rms,
        normalized_ndim=len(shape),
        eps=float(eps),
        dropout_p=float(dropout_p),
        rebuild_from_output=bool(memory_efficient) and not (dropout_after and dropout_p > 0),
        return_residual=bool(return_residual),
        out_dtype=_output_dtype(x, residual, autocast),
        dropout_after=bool(dropout_after),
    )
    seed = new_dropout_seed(x.device, x.detach(), "fused_norm") if dropout_p > 0 else None
    weight = None if weight is None else weight.contiguous().view(n_cols)
    bias = None if bias is None else bias.contiguous().view(n_cols)
    residual = None if residual is None else residual.contiguous()
    y, h, _, _ = _norm(x.contiguous(), residual, weight, bias, seed, *spec.fields())
    return (y, h) if spec.return_residual else y


def default_rms_norm_eps(x) -> float:
    """torch's RMSNorm eps for ``eps=None``: the machine epsilon of x's accumulation type."""
    dtype = x.dtype if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else torch.float32
    return torch.finfo(_reference_dtype(dtype)).eps


def _checked_memory_mode(memory_efficient: bool, weight, bias) -> bool:
    """The functional's ``memory_efficient``: kept only when the weights allow rebuilding."""
    if not isinstance(memory_efficient, bool):
        raise TypeError(f"memory_efficient must be a bool, got {type(memory_efficient).__name__}")
    return memory_efficient and torch.is_grad_enabled() and output_rebuilds_input(weight, bias)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    memory_efficient: bool = False,
    return_residual: bool = False,
):
    """``torch.nn.functional.layer_norm`` with fused dropout and residual add.

    Computes h = dropout(input, dropout_p) + residual, then y = LayerNorm(h) * weight + bias.

    input: (..., *normalized_shape), float32/float16/bfloat16 (the fused kernel) or float64
        (the PyTorch reference in float64, on any device: ``torch.autograd.gradcheck``),
        at most 65536 features.
    weight, bias: normalized_shape, same dtype as input (outside autocast, and always
        with float64), or None.
    residual: same shape as input, or None. dropout_p: in [0, 1); pass 0 in eval.
    memory_efficient: save the output instead of h and rebuild x̂ from it in backward,
        when ``output_rebuilds_input(weight, bias)`` says that is exact enough (checked
        on every call that records a graph: one host sync; the layers decide it once per
        weight update); otherwise h is saved. The output must not then be modified in
        place (backward raises an error saying so).
    return_residual: also return h (the sum, for the next pre-LN block).
    Returns y shaped like input (float32 under CUDA autocast, else the dtype of
    input + residual), or
    (y, h). Raises ValueError/TypeError naming the argument on bad shapes, dtypes, devices.
    """
    memory_efficient = _checked_memory_mode(memory_efficient, weight, bias)
    return fused_norm(
        input,
        normalized_shape,
        weight,
        bias,
        eps,
        is_rms=False,
        residual=residual,
        dropout_p=dropout_p,
        memory_efficient=memory_efficient,
        return_residual=return_residual,
    )


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    residual: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    memory_efficient: bool = False,
    return_residual: bool = False,
):
    """``torch.nn.functional.rms_norm`` with fused dropout and residual add.

    Computes h = dropout(input, dropout_p) + residual, then y = h / sqrt(mean(h^2) + eps) * weight.
    eps defaults to the machine epsilon of the accumulation type, as in torch: float32's,
    float64's for float64 input. Other arguments, the return value and the errors are
    those of ``layer_norm``.
    """
    if eps is None:
        eps = default_rms_norm_eps(input)
    memory_efficient = _checked_memory_mode(memory_efficient, weight, None)
    return fused_norm(
        input,
        normalized_shape,
        weight,
        None,
        eps,
        is_rms=True,
        residual=residual,
        dropout_p=dropout_p,
        memory_efficient=memory_efficient,
        return_residual=return_residual,
    )


def __getattr__(name: str):
    # MemoryModes and MEMORY_MODES lived here before the layers took the memory-mode policy;
    # imported when asked for, since kernels never import layers.
    if name in ("MemoryModes", "MEMORY_MODES"):
        from slimformer.layers import memory_modes

        return getattr(memory_modes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
