"""Fused scaled-dot-product attention (FlashAttention-2) with masks, dropout and GQA.

For query row i and key j, with ``z`` the dropout keep mask and ``r = 1 / (1 - dropout_p)``:

    s_ij = scale · q_i·k_j + mask_ij   (−inf where key j is not allowed for row i)
    lse_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij − lse_i),   o_i = Σ_j r z_ij p_ij v_j

The forward walks over key blocks with an online softmax, so neither s nor p is ever
written to memory. It saves q, k, v, o, the fp32 ``lse`` and the dropout seed: with
``lse`` the backward rebuilds p block by block, and z comes back from the seed (the
Philox offset of (b, h, i, j) is its flat index in the (batch, heads, seq_q, seq_k)
matrix). The backward uses ``delta_i = Σ_d dO_id O_id = Σ_j dP_ij P_ij`` and

    dP = r z ∘ dO Vᵀ,   dS = P ∘ (dP − delta),   dV = (r z ∘ P)ᵀ dO,
    dK = scale · dSᵀ Q,   dQ = scale · dS K

in two passes without races: one program per key block accumulates dK and dV over
every query block of every query head sharing that key/value head (GQA), and one
program per query block accumulates dQ.

A row with no allowed key (all padding, say) gets o = 0 and lse = +inf; so does a row
whose best score is below ``MASKED_ROW_SCORE`` (a row masked by finite additive values
such as finfo.min, where SDPA would average v uniformly). With
lse = +inf every p_ij of that row is exp(−inf) = 0, so the backward gives the row, and
the keys it would have seen, zero gradient without a special case.

The kernels read q, k, v through their strides (only head_dim must be contiguous), so
the heads of a fused QKV projection are used in place, and write o as (batch, seq,
heads, head_dim), so that merging the heads for the output projection is a view and
that projection saves the very storage attention saved. ``self_attention`` adds the
``qkv`` recompute policy: its backward recomputes the projection from the layer input
and keeps only the input, o and lse.
"""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels.dispatch import reference_row_blocks, use_triton
from slimformer.kernels.philox import (
    dropout_keep_block,
    dropout_keep_tile,
    dropout_keep_tile_t,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# A row whose best score (scale · q·k + additive mask) is at most this counts as having
# no allowed key, like a row masked with −inf. Its lse would be too large for fp32 to
# hold log Σ exp (at |lse| = 1e9 the ulp is 64), so backward could not rebuild p from it;
# finite masks such as finfo.min or −1e9 reach here only when they mask the whole row.
MASKED_ROW_SCORE = -(2.0**16)
_MASKED_ROW_SCORE_LOG2 = tl.constexpr(MASKED_ROW_SCORE * _LOG2E.value)
_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_MASK, _BOOL_MASK, _ADDITIVE_MASK = 0, 1, 2


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32."""
    if UPCAST:
        # Triton 3.6's interpreter multiplies bf16 blocks as their raw uint16 bits; the
        # fp32 product of bf16 values is exact, so upcasting changes no result.
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _masked_scores(
    qk, rows, cols, off_b, off_h, seq_q, seq_k, qk_scale,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    KPM, stride_kpb, stride_kpn,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    """Scores of one tile in log2 units, −inf where a key is not allowed.

    ``rows`` (query indices) and ``cols`` (key indices) broadcast to the tile's shape,
    so the same code serves (query, key) tiles and the transposed (key, query) tiles.
    """
    s = qk * qk_scale
    in_bounds = (rows < seq_q) & (cols < seq_k)
    allowed = in_bounds
    if IS_CAUSAL:
        allowed &= cols <= rows
    if HAS_KPM:
        padding = tl.load(KPM + off_b * stride_kpb + cols.to(tl.int64) * stride_kpn, mask=cols < seq_k, other=1)
        allowed &= padding == 0
    if MASK_KIND != 0:
        mask_ptrs = (
            MASK + off_b * stride_mb + off_h * stride_mh
            + rows.to(tl.int64) * stride_mm + cols.to(tl.int64) * stride_mn
        )
        mask = tl.load(mask_ptrs, mask=in_bounds, other=0)
        if MASK_KIND == 1:
            allowed &= mask != 0
        else:
            bias = mask.to(tl.float32)
            # finfo.min · log2(e) would overflow; such a key is masked either way
            s += tl.where(bias >= -1e38, bias * _LOG2E, float("-inf"))
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _dropout_scale(seed, off_bh, seq_q, seq_k, offs_m, start_n, dropout_p, BLOCK_N: tl.constexpr,
                   KEYS_FIRST: tl.constexpr):
    """``r · z`` for queries ``offs_m`` and keys start_n .. start_n + BLOCK_N: [BLOCK_M, BLOCK_N],
    or [BLOCK_N, BLOCK_M] when KEYS_FIRST. Dropout-matrix row (batch · heads + head) · seq_q + i,
    column j (see ``philox.py``); ``off_bh`` = batch · heads + head, int64."""
    threshold, scale = dropout_threshold_and_scale(dropout_p)
    rows = off_bh * seq_q + offs_m
    if KEYS_FIRST:
        keep = dropout_keep_tile_t(seed, rows, start_n, seq_k, threshold, BLOCK_N)
    else:
        keep = dropout_keep_tile(seed, rows, start_n, seq_k, threshold, BLOCK_N)
    return tl.where(keep, scale, 0.0)


@triton.jit
def _attention_fwd_kernel(
    Q,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    K,  # (batch, kv_heads, seq_k, head_dim), likewise
    V,  # (batch, kv_heads, seq_k, head_dim), likewise
    O,  # (batch, heads, seq_q, head_dim) output, likewise
    LSE,  # (batch, heads, seq_q) fp32 output, natural log, contiguous
    SEED,  # () int64 dropout seed
    MASK,  # attn_mask broadcast to (batch, heads, seq_q, seq_k) by its strides, uint8 or float
    KPM,  # (batch, seq_k) uint8 key padding mask, nonzero = padding
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, head_dim, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = off_h // group_size
    # Scalar int64 offsets select the tiles; int32 offsets index inside them, so no
    # 64-bit index tile has to stay live across the loop.
    first_row = pid_m.to(tl.int64) * BLOCK_M
    Q += off_b * stride_qb + off_h * stride_qh + first_row * stride_qs
    O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    qk_scale = sm_scale * _LOG2E

    start_m = pid_m * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_m = start_m + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    q_in = (offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim)
    q = tl.load(Q + tile_m[:, None] * stride_qs + offs_d[None, :], mask=q_in, other=0.0)
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seq_k
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tile_n
        kv_in = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)
        first_col = tl.cast(start_n, tl.int64)
        k = tl.load(K + first_col * stride_ks + tile_n[:, None] * stride_ks + offs_d[None, :], mask=kv_in, other=0.0)
        s = _masked_scores(
            _dot(q, tl.trans(k), PRECISION, UPCAST), offs_m[:, None], offs_n[None, :], off_b, off_h,
            seq_q, seq_k, qk_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
            KPM, stride_kpb, stride_kpn, MASK_KIND, HAS_KPM, IS_CAUSAL,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key so far has m = −inf; shifting by 0 keeps its p at 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = p * _dropout_scale(
                seed, off_b * num_heads + off_h, seq_q, seq_k, offs_m, start_n, dropout_p, BLOCK_N, False
            )
        v = tl.load(V + first_col * stride_vs + tile_n[:, None] * stride_vs + offs_d[None, :], mask=kv_in, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    has_keys = (l_i > 0.0) & (m_i > _MASKED_ROW_SCORE_LOG2)
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * _LN2, float("inf"))
    tl.store(O + tile_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=q_in)
    tl.store(LSE + (off_b * num_heads + off_h) * seq_q + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _attention_bwd_preprocess_kernel(
    O,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    DO,  # (batch, heads, seq_q, head_dim), likewise
    DELTA,  # (batch, heads, seq_q) fp32 output, contiguous
    stride_ob, stride_oh, stride_os,
    stride_dob, stride_doh, stride_dos,
    num_heads, seq_q, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    first_row = pid_m.to(tl.int64) * BLOCK_M
    O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
    DO += off_b * stride_dob + off_h * stride_doh + first_row * stride_dos
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    in_bounds = (offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim)
    o = tl.load(O + tile_m[:, None] * stride_os + offs_d[None, :], mask=in_bounds, other=0.0)
    do = tl.load(DO + tile_m[:, None] * stride_dos + offs_d[None, :], mask=in_bounds, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (off_b * num_heads + off_h) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V,  # as in the forward
    DO,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    LSE, DELTA,  # (batch, heads, seq_q) fp32, contiguous
    DK, DV,  # (batch, kv_heads, seq_k, head_dim) outputs, strided, last dim contiguous
    SEED, MASK, KPM,  # as in the forward
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, head_dim, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    off_hk = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    first_col = pid_n.to(tl.int64) * BLOCK_N
    K += off_b * stride_kb + off_hk * stride_kh + first_col * stride_ks
    V += off_b * stride_vb + off_hk * stride_vh + first_col * stride_vs
    DK += off_b * stride_dkb + off_hk * stride_dkh + first_col * stride_dks
    DV += off_b * stride_dvb + off_hk * stride_dvh + first_col * stride_dvs
    qk_scale = sm_scale * _LOG2E

    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tile_n
    offs_d = tl.arange(0, BLOCK_D)
    kv_in = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)
    k = tl.load(K + tile_n[:, None] * stride_ks + offs_d[None, :], mask=kv_in, other=0.0)
    v = tl.load(V + tile_n[:, None] * stride_vs + offs_d[None, :], mask=kv_in, other=0.0)
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if IS_CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(group_size):
        off_h = off_hk * group_size + g
        off_bh = off_b * num_heads + off_h
        q_head = Q + off_b * stride_qb + off_h * stride_qh
        do_head = DO + off_b * stride_dob + off_h * stride_doh
        for start_m in range(lo, seq_q, BLOCK_M):
            # Tiles are (key, query) so that dK and dV accumulate without transposing
            # register tiles.
            offs_m = start_m + tile_m
            first_row = tl.cast(start_m, tl.int64)
            q_tile = q_head + first_row * stride_qs
            do_tile = do_head + first_row * stride_dos
            row_in = offs_m < seq_q
            q_t = tl.load(
                q_tile + tile_m[None, :] * stride_qs + offs_d[:, None],
                mask=row_in[None, :] & (offs_d[:, None] < head_dim), other=0.0,
            )
            do = tl.load(
                do_tile + tile_m[:, None] * stride_dos + offs_d[None, :],
                mask=row_in[:, None] & (offs_d[None, :] < head_dim), other=0.0,
            )
            lse = tl.load(LSE + off_bh * seq_q + offs_m, mask=row_in, other=float("inf"))
            delta = tl.load(DELTA + off_bh * seq_q + offs_m, mask=row_in, other=0.0)
            s_t = _masked_scores(
                _dot(k, q_t, PRECISION, UPCAST), offs_m[None, :], offs_n[:, None], off_b, off_h,
                seq_q, seq_k, qk_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                KPM, stride_kpb, stride_kpn, MASK_KIND, HAS_KPM, IS_CAUSAL,
            )
            p_t = tl.exp2(s_t - lse[None, :] * _LOG2E)
            dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST)
            if HAS_DROPOUT:
                z_t = _dropout_scale(seed, off_bh, seq_q, seq_k, offs_m, pid_n * BLOCK_N, dropout_p, BLOCK_N, True)
                dv += _dot((p_t * z_t).to(do.dtype), do, PRECISION, UPCAST)
                dp_t = dp_t * z_t
            else:
                dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), PRECISION, UPCAST)

    tl.store(DK + tile_n[:, None] * stride_dks + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_in)
    tl.store(DV + tile_n[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_in)


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA,  # as in the dK/dV kernel
    DQ,  # (batch, heads, seq_q, head_dim) output, strided, last dim contiguous
    SEED, MASK, KPM,  # as in the forward
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, head_dim, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = off_h // group_size
    off_bh = off_b * num_heads + off_h
    first_row = pid_m.to(tl.int64) * BLOCK_M
    Q += off_b * stride_qb + off_h * stride_qh + first_row * stride_qs
    DO += off_b * stride_dob + off_h * stride_doh + first_row * stride_dos
    DQ += off_b * stride_dqb + off_h * stride_dqh + first_row * stride_dqs
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    qk_scale = sm_scale * _LOG2E

    start_m = pid_m * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_m = start_m + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    q_in = (offs_m[:, None] < seq_q) & (offs_d[None, :] < head_dim)
    q = tl.load(Q + tile_m[:, None] * stride_qs + offs_d[None, :], mask=q_in, other=0.0)
    do = tl.load(DO + tile_m[:, None] * stride_dos + offs_d[None, :], mask=q_in, other=0.0)
    row_in = offs_m < seq_q
    lse = tl.load(LSE + off_bh * seq_q + offs_m, mask=row_in, other=float("inf"))
    delta = tl.load(DELTA + off_bh * seq_q + offs_m, mask=row_in, other=0.0)
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seq_k
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tile_n
        kv_in = (offs_n[:, None] < seq_k) & (offs_d[None, :] < head_dim)
        first_col = tl.cast(start_n, tl.int64)
        k = tl.load(K + first_col * stride_ks + tile_n[:, None] * stride_ks + offs_d[None, :], mask=kv_in, other=0.0)
        v = tl.load(V + first_col * stride_vs + tile_n[:, None] * stride_vs + offs_d[None, :], mask=kv_in, other=0.0)
        s = _masked_scores(
            _dot(q, tl.trans(k), PRECISION, UPCAST), offs_m[:, None], offs_n[None, :], off_b, off_h,
            seq_q, seq_k, qk_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
            KPM, stride_kpb, stride_kpn, MASK_KIND, HAS_KPM, IS_CAUSAL,
        )
        p = tl.exp2(s - lse[:, None] * _LOG2E)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        if HAS_DROPOUT:
            dp = dp * _dropout_scale(seed, off_bh, seq_q, seq_k, offs_m, start_n, dropout_p, BLOCK_N, False)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)

    tl.store(DQ + tile_m[:, None] * stride_dqs + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_in)


# (largest BLOCK_D, (BLOCK_M, BLOCK_N, num_warps, num_stages)) per kernel for 16-bit inputs,
# picked by compiling for sm_90 so that ptxas reports no register spills (or a few
# hundred bytes at head dim 256 with every mask and dropout); BLOCK_M indexes queries
# and BLOCK_N keys in every kernel.
_TENSOR_CORE_CONFIGS = {
    "fwd": ((64, (128, 64, 8, 3)), (128, (128, 32, 8, 3)), (256, (64, 32, 8, 2))),
    "dkdv": ((64, (32, 64, 4, 2)), (128, (64, 32, 8, 2)), (256, (32, 32, 8, 1))),
    "dq": ((64, (128, 64, 8, 2)), (128, (128, 32, 8, 2)), (256, (32, 32, 8, 1))),
}
# fp32 dots run in exact ("ieee") precision on CUDA cores, whose operands live in
# registers: small tiles at every head dim.
_FP32_CONFIG = (32, 32, 8, 1)


def _block_config(head_dim: int, dtype: torch.dtype, kernel: str) -> dict:
    """Launch options (BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of ``kernel``,
    one of "fwd", "dkdv", "dq".

    BLOCK_D is the head dim padded to a power of two >= 16, as ``tl.dot`` and ``tl.arange``
    need; the padding lanes load as zeros.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_m, block_n, num_warps, num_stages = _FP32_CONFIG
    else:
        block_m, block_n, num_warps, num_stages = next(
            config for largest, config in _TENSOR_CORE_CONFIGS[kernel] if block_d <= largest
        )
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages
    )


def _mask_args(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, q: torch.Tensor, seq_k: int
) -> tuple[list, list, dict]:
    """The masks' pointer arguments, their stride arguments and their constexpr flags.

    ``attn_mask`` is expanded (a view, stride 0 on broadcast dims) so the kernels read
    it block by block; bool masks are viewed as uint8, which Triton loads natively.
    """
    batch, heads, seq_q, _ = q.shape
    if attn_mask is None:
        mask, mask_strides, mask_kind = None, (0, 0, 0, 0), _NO_MASK
    else:
        mask = attn_mask.expand(batch, heads, seq_q, seq_k)
        mask_strides = mask.stride()
        if mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), _BOOL_MASK
        else:
            mask_kind = _ADDITIVE_MASK
    if key_padding_mask is None:
        kpm, kpm_strides = None, (0, 0)
    else:
        kpm, kpm_strides = key_padding_mask.view(torch.uint8), key_padding_mask.stride()
    flags = dict(MASK_KIND=mask_kind, HAS_KPM=kpm is not None)
    return [mask, kpm], [*mask_strides, *kpm_strides], flags


def _kernel_flags(q: torch.Tensor, is_causal: bool, dropout_p: float) -> dict:
    return dict(
        IS_CAUSAL=is_causal,
        HAS_DROPOUT=dropout_p > 0.0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )


def _head_strides(*tensors: torch.Tensor) -> list[int]:
    """(batch, heads, seq) strides of each (batch, heads, seq, head_dim) tensor, flattened."""
    return [stride for tensor in tensors for stride in tensor.stride()[:3]]


def _empty_output(q: torch.Tensor) -> torch.Tensor:
    """An output shaped like q, (batch, heads, seq_q, head_dim), stored as (batch, seq_q,
    heads, head_dim) so that ``rearrange(out, "b h s d -> b s (h d)")`` is a view."""
    batch, heads, seq_q, head_dim = q.shape
    return torch.empty(batch, seq_q, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)


def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; q, k, v have a contiguous last dim. Returns (out, lse)."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    out = _empty_output(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(math.inf)
    config = _block_config(head_dim, q.dtype, "fwd")
    masks, mask_strides, mask_flags = _mask_args(attn_mask, key_padding_mask, q, seq_k)
    _attention_fwd_kernel[(triton.cdiv(seq_q, config["BLOCK_M"]), heads, batch)](
        q, k, v, out, lse, seed, *masks, *_head_strides(q, k, v, out), *mask_strides,
        heads, heads // kv_heads, seq_q, seq_k, head_dim, scale, dropout_p,
        **mask_flags, **_kernel_flags(q, is_causal, dropout_p), **config,
    )
    return out, lse


def _attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Launch the backward kernels (delta, then dK/dV and dQ), writing into dq, dk, dv.

    Every (batch, heads, seq, head_dim) tensor may be strided with a contiguous last dim.
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    delta = torch.empty_like(lse)
    dq_config = _block_config(head_dim, q.dtype, "dq")
    _attention_bwd_preprocess_kernel[(triton.cdiv(seq_q, dq_config["BLOCK_M"]), heads, batch)](
        out, grad_out, delta, *_head_strides(out, grad_out), heads, seq_q, head_dim,
        BLOCK_M=dq_config["BLOCK_M"], BLOCK_D=dq_config["BLOCK_D"], num_warps=dq_config["num_warps"],
    )
    masks, mask_strides, mask_flags = _mask_args(attn_mask, key_padding_mask, q, seq_k)
    scalars = (*mask_strides, heads, heads // kv_heads, seq_q, seq_k, head_dim, scale, dropout_p)
    flags = dict(**mask_flags, **_kernel_flags(q, is_causal, dropout_p))
    dkdv_config = _block_config(head_dim, q.dtype, "dkdv")
    _attention_bwd_dkdv_kernel[(triton.cdiv(seq_k, dkdv_config["BLOCK_N"]), kv_heads, batch)](
        q, k, v, grad_out, lse, delta, dk, dv, seed, *masks,
        *_head_strides(q, k, v, grad_out, dk, dv), *scalars, **flags, **dkdv_config,
    )
    _attention_bwd_dq_kernel[(triton.cdiv(seq_q, dq_config["BLOCK_M"]), heads, batch)](
        q, k, v, grad_out, lse, delta, dq, seed, *masks,
        *_head_strides(q, k, v, grad_out, dq), *scalars, **flags, **dq_config,
    )


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, heads per kv head, ...)."""
    return rearrange(x, "b (k g) ... -> b k g ...", k=kv_heads)


def _reference_query_blocks(batch: int, heads: int, seq_q: int, seq_k: int) -> list[tuple[int, int]]:
    """(start, stop) of the reference's blocks of query rows, every head at once: the
    reference walks over them as the kernels walk over tiles, so no (batch, heads, seq_q,
    seq_k) score, probability, dropout-mask or dS tensor is ever alive."""
    return reference_row_blocks(seq_q, batch * heads * seq_k)


def _fp32_grouped_rows(x: torch.Tensor, kv_heads: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a (batch, heads, seq, head_dim) tensor as one contiguous fp32
    (batch · kv_heads, heads per kv head · rows, head_dim) stack of matrices: the query
    heads sharing a kv head are stacked, so one bmm serves the whole group (GQA)."""
    block = _grouped(x[:, :, start:stop], kv_heads)
    rows = torch.empty(block.shape, dtype=torch.float32, device=x.device).copy_(block)
    return rows.view(-1, rows.shape[2] * rows.shape[3], rows.shape[4])


def _no_allowed_key(best: torch.Tensor) -> torch.Tensor:
    """Rows that count as fully masked, from their best masked score (see MASKED_ROW_SCORE)."""
    return best <= MASKED_ROW_SCORE


def _masked_block_scores(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    start: int,
    stop: int,
    heads: int,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """fp32 scores of query rows start:stop against the keys ``k``, −inf where a key is
    not allowed: (batch · kv_heads, heads per kv head · rows, keys).

    ``q_rows`` and ``k`` are as ``_fp32_grouped_rows`` gives them; ``k`` may hold only the
    first keys (a causal block leaves out the keys after its last row).
    """
    s = torch.bmm(q_rows, k.mT).mul_(scale)
    n_keys = k.shape[1]
    scores = s.view(-1, heads, stop - start, n_keys)  # (batch, heads, rows, keys)
    if attn_mask is not None:
        per_row = attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1
        mask = attn_mask[..., start:stop, :n_keys] if per_row else attn_mask[..., :n_keys]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, -math.inf)
        else:
            scores.add_(mask)
    if key_padding_mask is not None:
        scores.masked_fill_(key_padding_mask[:, None, None, :n_keys], -math.inf)
    if is_causal:
        rows = torch.arange(start, stop, device=s.device)[:, None]
        scores.masked_fill_(torch.arange(n_keys, device=s.device) > rows, -math.inf)
    return s


def _dropout_keep_block(
    seed: torch.Tensor, batch_heads: int, seq_q: int, seq_k: int, start: int, stop: int, n_keys: int, p: float
) -> torch.Tensor:
    """The kernels' keep mask for query rows start:stop of every (batch, head) and keys
    0:n_keys, as a bool (batch · heads · rows, n_keys) tensor. Row (b·heads + h)·seq_q + i of
    the dropout matrix, which has seq_k columns, is query i of head h of batch entry b."""
    device = seed.device
    rows = torch.arange(batch_heads, device=device)[:, None] * seq_q + torch.arange(start, stop, device=device)
    return dropout_keep_block(seed, rows.view(-1), 0, n_keys, seq_k, p)


def _attention_fwd_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_attention_fwd`` computes, in fp32 PyTorch, over blocks of query rows:
    (out in q's dtype and the kernel's layout, fp32 lse)."""
    batch, heads, seq_q, _ = q.shape
    out = _empty_output(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(math.inf)
    with torch.autocast(q.device.type, enabled=False):  # fp32 bmm even when called under autocast
        _attention_fwd_blocks(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, out, lse)
    return out, lse


def _attention_fwd_blocks(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, out, lse):
    """The body of ``_attention_fwd_reference``: writes out and lse block by block."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    k_all, v_all = _fp32_grouped_rows(k, kv_heads, 0, seq_k), _fp32_grouped_rows(v, kv_heads, 0, seq_k)
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _fp32_grouped_rows(q, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows, k_all[:, :n_keys], start, stop, heads, attn_mask, key_padding_mask, is_causal, scale
        )
        best = p.amax(-1, keepdim=True)
        no_key = _no_allowed_key(best)
        p.sub_(best.masked_fill(no_key, 0.0)).exp_()
        total = p.sum(-1, keepdim=True)
        row_scale = total.reciprocal().masked_fill_(no_key, 0.0)
        if seed is not None:
            p.mul_(_dropout_keep_block(seed, batch * heads, seq_q, seq_k, start, stop, n_keys, dropout_p).view(p.shape))
            row_scale.mul_(dropout_threshold(dropout_p)[1])
        o = torch.bmm(p.mul_(row_scale), v_all[:, :n_keys])
        out[:, :, start:stop].copy_(o.view(batch, heads, stop - start, head_dim))
        block_lse = best.add_(total.log_()).masked_fill_(no_key, math.inf)
        lse[:, :, start:stop].copy_(block_lse.view(batch, heads, stop - start))


def _attention_bwd_reference(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """What ``_attention_bwd`` computes, in fp32 PyTorch over blocks of query rows (dK and
    dV accumulate over the blocks), written into dq, dk, dv. ``out`` is not read: each
    block holds whole rows of P and dP, from which it takes delta."""
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    with torch.autocast(q.device.type, enabled=False):  # fp32 bmm even when called under autocast
        _attention_bwd_blocks(
            grad_out, q, k, v, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale, dq, dk, dv
        )


def _attention_bwd_blocks(
    grad_out, q, k, v, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale, dq, dk, dv
):
    """The body of ``_attention_bwd_reference``: dq block by block, dk and dv accumulated."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    k_all, v_all = _fp32_grouped_rows(k, kv_heads, 0, seq_k), _fp32_grouped_rows(v, kv_heads, 0, seq_k)
    dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _fp32_grouped_rows(q, kv_heads, start, stop)
        do_rows = _fp32_grouped_rows(grad_out, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows, k_all[:, :n_keys], start, stop, heads, attn_mask, key_padding_mask, is_causal, scale
        )
        p.sub_(lse[:, :, start:stop].reshape(*q_rows.shape[:2], 1)).exp_()
        if seed is None:
            dv_all[:, :n_keys].baddbmm_(p.mT, do_rows)
            dp = torch.bmm(do_rows, v_all[:, :n_keys].mT)
        else:
            keep = _dropout_keep_block(seed, batch * heads, seq_q, seq_k, start, stop, n_keys, dropout_p).view(p.shape)
            dv_all[:, :n_keys].baddbmm_((p * keep).mT, do_rows, alpha=keep_scale)
            dp = torch.bmm(do_rows * keep_scale, v_all[:, :n_keys].mT).mul_(keep)
        # delta = Σ_j P_ij dP_ij, which equals the kernels' Σ_d dO_id O_id: a block holds
        # whole rows, and summing the row itself keeps each row of dS summing to ~0, as
        # torch's softmax backward does (no cancellation error from two different sums).
        delta = torch.linalg.vecdot(p, dp).unsqueeze(-1)
        ds = dp.sub_(delta).mul_(p)
        dk_all[:, :n_keys].baddbmm_(ds.mT, q_rows)
        dq_rows = torch.bmm(ds, k_all[:, :n_keys]).mul_(scale)
        dq[:, :, start:stop].copy_(dq_rows.view(batch, heads, stop - start, head_dim))
    dk.copy_(dk_all.mul_(scale).view(batch, kv_heads, seq_k, head_dim))
    dv.copy_(dv_all.view(batch, kv_heads, seq_k, head_dim))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch, head and sequence strides (head views of a fused
    # projection need no copy) but load rows of head_dim contiguous elements.
    return x if x.stride(-1) == 1 else x.contiguous()


def _split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, seq, 3 · embed) projection -> q, k, v (batch, heads, seq, head_dim) views."""
    return rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=num_heads).unbind(0)


class _Attention(torch.autograd.Function):
    """Fused attention; saves q, k, v, out, lse and the dropout seed (plus the caller's masks)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale):
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        seed = new_dropout_seed(q.device) if dropout_p > 0.0 else None
        fwd = _attention_fwd if use_triton(q) else _attention_fwd_reference
        out, lse = fwd(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)
        ctx.save_for_backward(q, k, v, out, lse, seed, attn_mask, key_padding_mask)
        ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seed, attn_mask, key_padding_mask = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd = _attention_bwd if use_triton(q) else _attention_bwd_reference
        bwd(
            _last_dim_contiguous(grad_out), q, k, v, out, lse, seed, attn_mask, key_padding_mask,
            ctx.dropout_p, ctx.is_causal, ctx.scale, dq, dk, dv,
        )
        return dq, dk, dv, None, None, None, None, None


class _SelfAttentionRecomputeQKV(torch.autograd.Function):
    """x -> attention of q, k, v = split(x Wᵀ + b), as (batch, seq, embed).

    Saves x, the weights, out, lse and the seed; backward recomputes the projection
    and writes dq, dk, dv straight into one (batch, seq, 3 · embed) gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, num_heads, attn_mask, key_padding_mask, dropout_p, is_causal, scale):
        q, k, v = _split_heads(F.linear(x, weight, bias), num_heads)
        seed = new_dropout_seed(q.device) if dropout_p > 0.0 else None
        fwd = _attention_fwd if use_triton(q) else _attention_fwd_reference
        out, lse = fwd(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)
        ctx.save_for_backward(x, weight, bias, out, lse, seed, attn_mask, key_padding_mask)
        ctx.num_heads, ctx.dropout_p, ctx.is_causal, ctx.scale = num_heads, dropout_p, is_causal, scale
        return rearrange(out, "b h s d -> b s (h d)")

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, out, lse, seed, attn_mask, key_padding_mask = ctx.saved_tensors
        # The forward's projection ran in out's dtype (autocast's, if it was on); redo it
        # in that dtype, since autocast is off in backward.
        dtype = out.dtype
        x_, weight_ = x.to(dtype), weight.to(dtype)
        qkv = F.linear(x_, weight_, None if bias is None else bias.to(dtype))
        q, k, v = _split_heads(qkv, ctx.num_heads)
        dqkv = torch.empty_like(qkv)
        dq, dk, dv = _split_heads(dqkv, ctx.num_heads)
        grad_out = rearrange(_last_dim_contiguous(grad_out.to(dtype)), "b s (h d) -> b h s d", h=ctx.num_heads)
        bwd = _attention_bwd if use_triton(q) else _attention_bwd_reference
        bwd(
            grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask,
            ctx.dropout_p, ctx.is_causal, ctx.scale, dq, dk, dv,
        )
        dx = (dqkv @ weight_).to(x.dtype) if ctx.needs_input_grad[0] else None
        dweight = (dqkv.flatten(0, 1).mT @ x_.flatten(0, 1)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None, None, None


def _check_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
) -> None:
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask must be on q's device {device}, got {attn_mask.device}")
        target = (batch, heads, seq_q, seq_k)
        if attn_mask.dim() > 4 or any(
            size not in (1, want) for size, want in zip(reversed(attn_mask.shape), reversed(target))
        ):
            raise ValueError(
                f"attn_mask must broadcast to (batch, heads, seq_q, seq_k) = {target}, "
                f"got shape {tuple(attn_mask.shape)}"
            )
        if attn_mask.requires_grad:
            raise ValueError("attn_mask must not require grad: slimformer.attention gives masks no gradient")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                f"key_padding_mask must be a torch.Tensor or None, got {type(key_padding_mask).__name__}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask must be on q's device {device}, got {key_padding_mask.device}")
        if key_padding_mask.shape != (batch, seq_k):
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_k) = {(batch, seq_k)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


def _check_dropout_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention that never materialises the score matrix.

    Same contract as ``torch.nn.functional.scaled_dot_product_attention`` on 4-d inputs,
    plus ``key_padding_mask``; all masks may be combined.

    Args:
        q: (batch, heads, seq_q, head_dim), float16, bfloat16 or float32.
        k, v: (batch, kv_heads, seq_k, head_dim), q's dtype and device. ``kv_heads`` equals
            ``heads``, or divides it when ``enable_gqa`` (query head h reads kv head
            h // (heads // kv_heads), as in SDPA); k and v are never repeated in memory.
            head_dim is at most 256. Any strides are read in place as long as the last
            dim is contiguous (head views of a fused projection need no copy).
        attn_mask: bool (True = may attend) or an additive float mask, broadcastable to
            (batch, heads, seq_q, seq_k); read through broadcast strides, never expanded.
            It gets no gradient.
        dropout_p: attention dropout probability in [0, 1), applied whenever it is > 0 (as
            in SDPA). The mask is drawn from torch's generator, so ``torch.manual_seed``
            reproduces it, and regenerated in backward rather than stored.
        is_causal: row i attends keys j <= i (top-left aligned, as in SDPA).
        scale: score scale, default ``1 / sqrt(head_dim)``.
        enable_gqa: allow fewer kv heads than query heads.
        key_padding_mask: bool (batch, seq_k), True = padding (as in ``nn.MultiheadAttention``).

    Returns:
        (batch, heads, seq_q, head_dim) in q's dtype (under autocast q, k and v are
        first cast to the autocast dtype, as for SDPA), stored as (batch, seq_q, heads,
        head_dim) so that merging the heads is a view. Rows with no allowed key are
        zero, and so is their gradient.

    Raises:
        TypeError: a non-tensor input, dtypes other than float16/bfloat16/float32 or not
            matching, a mask of the wrong dtype.
        ValueError: wrong ranks or shapes (unlike SDPA, v must have k's shape: a value
            head_dim other than q's is not supported), kv heads that do not divide the query heads,
            head_dim outside [1, 256], dropout_p outside [0, 1), a mask that does not
            broadcast or requires grad, tensors on different devices.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-d (batch, heads, seq, head_dim), got shape {tuple(tensor.shape)}"
            )
    if torch.is_autocast_enabled(q.device.type):
        # as autocast casts SDPA's q, k, v (masks keep their dtype)
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}")
    batch, heads, seq_q, head_dim = q.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's head_dim {head_dim}, got {k.shape[3]}")
    _check_head_dim(head_dim)
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if enable_gqa:
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(
                f"k and v heads must divide q's {heads} heads when enable_gqa=True, got {kv_heads}"
            )
    elif kv_heads != heads:
        raise ValueError(
            f"k and v must have q's {heads} heads (pass enable_gqa=True for fewer), got {kv_heads}"
        )
    _check_dropout_p(dropout_p)
    _check_masks(attn_mask, key_padding_mask, q.device, batch, heads, seq_q, seq_k)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return _Attention.apply(q, k, v, attn_mask, key_padding_mask, float(dropout_p), bool(is_causal), scale)


def self_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    recompute_qkv: bool = False,
) -> torch.Tensor:
    """Multi-head self-attention of ``x`` with a fused QKV projection, before the output projection.

    Computes ``attention(q, k, v)`` with q, k, v the heads of ``F.linear(x, qkv_weight,
    qkv_bias)`` and returns it as (batch, seq, embed), a view of the kernel's output.
    With ``recompute_qkv`` (the ``qkv`` recompute policy) backward recomputes the
    projection from ``x``, so only x, the output and the fp32 log-sum-exp (plus the
    dropout seed) stay alive; otherwise the projection (q, k, v) is kept.

    Args:
        x: (batch, seq, embed), float16, bfloat16 or float32.
        qkv_weight: (3 · embed, embed), the q, k, v rows stacked as in
            ``nn.MultiheadAttention.in_proj_weight``; x's dtype and device.
        qkv_bias: (3 · embed,) or None.
        num_heads: divides embed; embed / num_heads is at most 256.
        attn_mask, dropout_p, is_causal, key_padding_mask: as in ``attention``.

    Raises:
        TypeError: x not float16/bfloat16/float32, weights of another dtype (outside
            autocast), a mask of the wrong dtype.
        ValueError: wrong shapes, num_heads not dividing embed, head_dim > 256,
            dropout_p outside [0, 1), masks that do not fit, tensors on other devices.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-d (batch, seq, embed), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    batch, seq, embed = x.shape
    weights = [("qkv_weight", qkv_weight, (3 * embed, embed))]
    if qkv_bias is not None:
        weights.append(("qkv_bias", qkv_bias, (3 * embed,)))
    autocast = torch.is_autocast_enabled(x.device.type)
    for name, tensor, shape in weights:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != x.dtype and not autocast:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {tensor.device}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1 or embed % num_heads != 0:
        raise ValueError(f"num_heads must divide embed {embed}, got {num_heads}")
    _check_head_dim(embed // num_heads)
    _check_dropout_p(dropout_p)
    _check_masks(attn_mask, key_padding_mask, x.device, batch, num_heads, seq, seq)
    if not recompute_qkv:
        q, k, v = _split_heads(F.linear(x, qkv_weight, qkv_bias), num_heads)
        out = attention(q, k, v, attn_mask, dropout_p, is_causal, key_padding_mask=key_padding_mask)
        return rearrange(out, "b h s d -> b s (h d)")
    scale = 1.0 / math.sqrt(embed // num_heads)
    return _SelfAttentionRecomputeQKV.apply(
        x, qkv_weight, qkv_bias, num_heads, attn_mask, key_padding_mask, float(dropout_p), bool(is_causal), scale
    )
