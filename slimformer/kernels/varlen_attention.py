"""Attention over packed variable-length sequences (FlashAttention-2's varlen API).

A batch of sequences of different lengths is packed without padding: q is
(total_q, heads, head_dim), sequence b owning rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``,
and likewise k and v with ``cu_seqlens_k``. Each sequence attends only to its own keys:

    s_ij = scale · q_i·k_j   (−inf for keys after i when causal, top-left aligned)
    lse_i = log Σ_j exp(s_ij),   o_i = Σ_j r z_ij exp(s_ij − lse_i) v_j

with i, j positions inside one sequence, z the dropout keep mask and r = 1 / (1 − p).
The forward saves q, k, v, o, the fp32 ``lse`` (heads, total_q), the dropout seed and
the two cu_seqlens; the backward is that of ``slimformer.kernels.attention``
(delta = Σ_d dO·O, dS = P ∘ (dP − delta)) restricted to each sequence.

Grids run over (block, head, sequence) with ``max_seqlen`` blocks per sequence; the
programs past a sequence's end do nothing. Compute and memory are proportional to the
real tokens: Σ_b len_b² per head for the scores, none of it for padding.

Dropout. The keep decision of query i of sequence b, head h and key j is element
(row, j) of the Philox dropout matrix of ``slimformer.kernels.philox`` with
``row = (cu_seqlens_q[b] + i) · heads + h`` (the packed (token, head) index) and
``max_seqlen_k`` columns, so every (token, head, key) has its own counter and the
kernels and the PyTorch reference draw the same bits.
"""

import math

import torch
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels.attention import (
    _SM80_TENSOR_CORE_CONFIGS,
    _SMALL_SHARED_TENSOR_CORE_CONFIGS,
    _TENSOR_CORE_CONFIGS,
    _block_config,
    _check_dropout_p,
    _check_head_dim,
    _device_arch,
    _device_shared_bytes,
    _dot,
    _kernel_flags,
    _last_dim_contiguous,
    _load_rows,
    _reference_dtype,
    _runs_kernels,
    _store_rows,
    _stride_unit,
    _tensor_core_configs,
)
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
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_PROGRAMS = 2**31 - 1


@triton.jit
def _sequence(CU_SEQLENS, off_b):
    """(first packed row, length) of sequence ``off_b``; the row as int64."""
    start = tl.load(CU_SEQLENS + off_b)
    return start.to(tl.int64), tl.load(CU_SEQLENS + off_b + 1) - start


@triton.jit
def _program_ids(num_heads, max_seqlen, BLOCK: tl.constexpr):
    """(block, head, sequence) of this program: blocks fastest, then heads."""
    num_blocks = tl.cdiv(max_seqlen, BLOCK)
    pid = tl.program_id(0)
    bh = pid // num_blocks
    return pid % num_blocks, bh % num_heads, bh // num_heads


@triton.jit
def _keep_scale(seed, rows, start_n, max_seqlen_k, dropout_p, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """``r · z`` for dropout-matrix rows ``rows`` and keys start_n .. start_n + BLOCK_N:
    [rows, BLOCK_N], or [BLOCK_N, rows] when KEYS_FIRST."""
    threshold, scale = dropout_threshold_and_scale(dropout_p)
    if KEYS_FIRST:
        keep = dropout_keep_tile_t(seed, rows, start_n, max_seqlen_k, threshold, BLOCK_N)
    else:
        keep = dropout_keep_tile(seed, rows, start_n, max_seqlen_k, threshold, BLOCK_N)
    return tl.where(keep, scale, 0.0)


@triton.jit
def _allowed_scores(s, rows, cols, seq_k, IS_CAUSAL: tl.constexpr):
    """Scores with −inf at keys past seq_k or (causal) after their query."""
    allowed = cols < seq_k
    if IS_CAUSAL:
        allowed &= cols <= rows
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _varlen_fwd_tile(
    acc, l_i, m_i, q, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
    seed, drop_rows, max_seqlen_k, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, EDGE: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One key block of the online softmax: the updated (acc, l_i, m_i)."""
    offs_n = start_n + tile_n
    k = _load_rows(K + offs_n[:, None] * stride_kt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    qk = _dot(q, tl.trans(k), None, PRECISION, UPCAST)
    if EDGE:
        s = _allowed_scores(qk * qk_scale, offs_m[:, None], offs_n[None, :], seq_k, IS_CAUSAL)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key so far has m = −inf; shifting by 0 keeps its p at 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
    else:
        # Every key is allowed, so the row max is finite and the scale folds into the
        # exponent's multiply-add (max(c·x) is c·max(x) for c >= 0, c·min(x) else).
        if NEGATIVE_SCALE:
            m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_shift = m_new
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = p * _keep_scale(seed, drop_rows, start_n, max_seqlen_k, dropout_p, BLOCK_N, False)
    v = _load_rows(V + offs_n[:, None] * stride_vt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _varlen_fwd_kernel(
    Q,  # (total_q, heads, head_dim), strided, last dim contiguous
    K,  # (total_k, kv_heads, head_dim), likewise
    V,  # (total_k, kv_heads, head_dim), likewise
    O,  # (total_q, heads, head_dim) output, likewise
    LSE,  # (heads, total_q) fp32 output, natural log, contiguous
    SEED,  # () int64 dropout seed
    CU_Q,  # (batch + 1,) int32 first row of each sequence in q, then total_q
    CU_K,  # (batch + 1,) int32 likewise in k and v
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q, num_heads, group_size, max_seqlen_q, max_seqlen_k, sm_scale, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Strides come in units of STRIDE_UNIT elements: multiplying by the constexpr tells
    # Triton that rows start 16-byte aligned (head_dim % 8 == 0), so they load as vectors.
    stride_qt, stride_qh, stride_kt, stride_kh = (
        stride_qt * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_kt * STRIDE_UNIT, stride_kh * STRIDE_UNIT
    )
    stride_vt, stride_vh, stride_ot, stride_oh = (
        stride_vt * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_ot * STRIDE_UNIT, stride_oh * STRIDE_UNIT
    )
    pid_m, off_h, off_b = _program_ids(num_heads, max_seqlen_q, BLOCK_M)
    q_start, seq_q = _sequence(CU_Q, off_b)
    k_start, seq_k = _sequence(CU_K, off_b)
    start_m = pid_m * BLOCK_M
    if start_m < seq_q:
        off_hk = off_h // group_size
        Q += (q_start + start_m) * stride_qt + off_h * stride_qh
        O += (q_start + start_m) * stride_ot + off_h * stride_oh
        K += k_start * stride_kt + off_hk * stride_kh
        V += k_start * stride_vt + off_hk * stride_vh
        qk_scale = sm_scale * _LOG2E
        tile_m = tl.arange(0, BLOCK_M)
        tile_n = tl.arange(0, BLOCK_N)
        offs_m = start_m + tile_m
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + tile_m[:, None] * stride_qt + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D,
                       True)  # fmt: skip
        seed = 0
        if HAS_DROPOUT:
            seed = tl.load(SEED)
        drop_rows = (q_start + offs_m) * num_heads + off_h

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Key blocks below full_hi are inside the sequence and (causal) before every query
        # of the block: no compares. The rest, up to hi, are edge blocks.
        hi = seq_k
        full_hi = seq_k // BLOCK_N * BLOCK_N
        if IS_CAUSAL:
            hi = tl.minimum(seq_k, start_m + BLOCK_M)
            full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
        for start_n in range(0, full_hi, BLOCK_N):
            acc, l_i, m_i = _varlen_fwd_tile(
                acc, l_i, m_i, q, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
                seed, drop_rows, max_seqlen_k, dropout_p,
                IS_CAUSAL, HAS_DROPOUT, False, NEGATIVE_SCALE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
            )
        for start_n in range(full_hi, hi, BLOCK_N):
            acc, l_i, m_i = _varlen_fwd_tile(
                acc, l_i, m_i, q, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
                seed, drop_rows, max_seqlen_k, dropout_p,
                IS_CAUSAL, HAS_DROPOUT, True, NEGATIVE_SCALE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
            )
        # Only a row with no allowed key (an empty key sequence) has l_i = 0: o = 0, lse = +inf.
        has_keys = l_i != 0.0
        out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * _LN2, float("inf"))
        _store_rows(O + tile_m[:, None] * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty), offs_m, seq_q,
                    offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        tl.store(LSE + off_h * total_q + q_start + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _varlen_bwd_dkdv_tile(
    dk, dv, k, v, Q, DO, LSE, DELTA, start_m, tile_m, offs_n, offs_d, seq_q, seq_k, qk_scale,
    stride_qt, stride_dot, seed, drop_base, num_heads, max_seqlen_k, start_n, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, EDGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One query block's share of dK and dV, in (key, query) tiles. Queries past seq_q
    load lse = +inf, so their p is 0; keys past seq_k are never stored."""
    offs_m = start_m + tile_m
    q = _load_rows(Q + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    do = _load_rows(DO + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D,
                    EDGE)  # fmt: skip
    if EDGE:
        lse = tl.load(LSE + offs_m, mask=offs_m < seq_q, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=offs_m < seq_q, other=0.0)
    else:
        lse = tl.load(LSE + offs_m)
        delta = tl.load(DELTA + offs_m)
    s_t = _dot(k, tl.trans(q), None, PRECISION, UPCAST) * qk_scale
    if EDGE:
        s_t = _allowed_scores(s_t, offs_m[None, :], offs_n[:, None], seq_k, IS_CAUSAL)
    p_t = tl.exp2(s_t - lse[None, :] * _LOG2E)
    dp_t = _dot(v, tl.trans(do), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        z_t = _keep_scale(seed, drop_base + offs_m * num_heads, start_n, max_seqlen_k, dropout_p, BLOCK_N, True)
        dv = _dot((p_t * z_t).to(do.dtype), do, dv, PRECISION, UPCAST)
        dp_t = dp_t * z_t
    else:
        dv = _dot(p_t.to(do.dtype), do, dv, PRECISION, UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _dot(ds_t.to(q.dtype), q, dk, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def _varlen_bwd_dkdv_kernel(
    Q, K, V,  # as in the forward
    DO,  # (total_q, heads, head_dim), strided, last dim contiguous
    LSE, DELTA,  # (heads, total_q) fp32, contiguous
    DK, DV,  # (total_k, kv_heads, head_dim) outputs, strided, last dim contiguous
    SEED, CU_Q, CU_K,  # as in the forward
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_q, num_heads, group_size, max_seqlen_k, sm_scale, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    stride_qt, stride_qh, stride_kt, stride_kh = (
        stride_qt * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_kt * STRIDE_UNIT, stride_kh * STRIDE_UNIT
    )
    stride_vt, stride_vh, stride_dot, stride_doh = (
        stride_vt * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_dot * STRIDE_UNIT, stride_doh * STRIDE_UNIT
    )
    stride_dkt, stride_dkh, stride_dvt, stride_dvh = (
        stride_dkt * STRIDE_UNIT, stride_dkh * STRIDE_UNIT, stride_dvt * STRIDE_UNIT, stride_dvh * STRIDE_UNIT
    )
    pid_n, off_hk, off_b = _program_ids(num_heads // group_size, max_seqlen_k, BLOCK_N)
    q_start, seq_q = _sequence(CU_Q, off_b)
    k_start, seq_k = _sequence(CU_K, off_b)
    start_n = pid_n * BLOCK_N
    if start_n < seq_k:
        K += (k_start + start_n) * stride_kt + off_hk * stride_kh
        V += (k_start + start_n) * stride_vt + off_hk * stride_vh
        DK += (k_start + start_n) * stride_dkt + off_hk * stride_dkh
        DV += (k_start + start_n) * stride_dvt + off_hk * stride_dvh
        qk_scale = sm_scale * _LOG2E
        tile_m = tl.arange(0, BLOCK_M)
        tile_n = tl.arange(0, BLOCK_N)
        offs_n = start_n + tile_n
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_rows(K + tile_n[:, None] * stride_kt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D,
                       True)  # fmt: skip
        v = _load_rows(V + tile_n[:, None] * stride_vt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D,
                       True)  # fmt: skip
        seed = 0
        if HAS_DROPOUT:
            seed = tl.load(SEED)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # Query blocks [lo, edge_hi) straddle the causal diagonal, the last one may pass
        # seq_q: edge blocks. The blocks in between need no compares.
        lo = 0
        edge_hi = 0
        if IS_CAUSAL:
            lo = start_n // BLOCK_M * BLOCK_M
            edge_hi = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, seq_q)
        full_hi = seq_q // BLOCK_M * BLOCK_M
        for g in range(group_size):
            off_h = off_hk * group_size + g
            q_head = Q + q_start * stride_qt + off_h * stride_qh
            do_head = DO + q_start * stride_dot + off_h * stride_doh
            lse_head = LSE + off_h * total_q + q_start
            delta_head = DELTA + off_h * total_q + q_start
            drop_base = q_start * num_heads + off_h
            for start_m in range(lo, edge_hi, BLOCK_M):
                dk, dv = _varlen_bwd_dkdv_tile(
                    dk, dv, k, v, q_head, do_head, lse_head, delta_head, start_m, tile_m, offs_n, offs_d, seq_q,
                    seq_k, qk_scale, stride_qt, stride_dot, seed, drop_base, num_heads, max_seqlen_k, start_n,
                    dropout_p, IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                )
            for start_m in range(tl.maximum(lo, edge_hi), full_hi, BLOCK_M):
                dk, dv = _varlen_bwd_dkdv_tile(
                    dk, dv, k, v, q_head, do_head, lse_head, delta_head, start_m, tile_m, offs_n, offs_d, seq_q,
                    seq_k, qk_scale, stride_qt, stride_dot, seed, drop_base, num_heads, max_seqlen_k, start_n,
                    dropout_p, IS_CAUSAL, HAS_DROPOUT, False, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                )
            for start_m in range(tl.maximum(tl.maximum(lo, edge_hi), full_hi), seq_q, BLOCK_M):
                dk, dv = _varlen_bwd_dkdv_tile(
                    dk, dv, k, v, q_head, do_head, lse_head, delta_head, start_m, tile_m, offs_n, offs_d, seq_q,
                    seq_k, qk_scale, stride_qt, stride_dot, seed, drop_base, num_heads, max_seqlen_k, start_n,
                    dropout_p, IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                )
        _store_rows(DK + tile_n[:, None] * stride_dkt + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                    offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        _store_rows(DV + tile_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), offs_n, seq_k,
                    offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip


@triton.jit
def _varlen_bwd_dq_tile(
    dq, q, do, lse, delta, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
    seed, drop_rows, max_seqlen_k, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, EDGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key block's share of dQ: the updated dq."""
    offs_n = start_n + tile_n
    k = _load_rows(K + offs_n[:, None] * stride_kt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    v = _load_rows(V + offs_n[:, None] * stride_vt + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    s = _dot(q, tl.trans(k), None, PRECISION, UPCAST) * qk_scale
    if EDGE:
        s = _allowed_scores(s, offs_m[:, None], offs_n[None, :], seq_k, IS_CAUSAL)
    p = tl.exp2(s - lse[:, None] * _LOG2E)
    dp = _dot(do, tl.trans(v), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        dp = dp * _keep_scale(seed, drop_rows, start_n, max_seqlen_k, dropout_p, BLOCK_N, False)
    ds = p * (dp - delta[:, None])
    return _dot(ds.to(k.dtype), k, dq, PRECISION, UPCAST)


@triton.jit
def _varlen_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA,  # as in the dK/dV kernel
    DQ,  # (total_q, heads, head_dim) output, strided, last dim contiguous
    SEED, CU_Q, CU_K,  # as in the forward
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    total_q, num_heads, group_size, max_seqlen_q, max_seqlen_k, sm_scale, dropout_p,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    stride_qt, stride_qh, stride_kt, stride_kh = (
        stride_qt * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_kt * STRIDE_UNIT, stride_kh * STRIDE_UNIT
    )
    stride_vt, stride_vh, stride_dot, stride_doh = (
        stride_vt * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_dot * STRIDE_UNIT, stride_doh * STRIDE_UNIT
    )
    stride_dqt, stride_dqh = stride_dqt * STRIDE_UNIT, stride_dqh * STRIDE_UNIT
    pid_m, off_h, off_b = _program_ids(num_heads, max_seqlen_q, BLOCK_M)
    q_start, seq_q = _sequence(CU_Q, off_b)
    k_start, seq_k = _sequence(CU_K, off_b)
    start_m = pid_m * BLOCK_M
    if start_m < seq_q:
        off_hk = off_h // group_size
        Q += (q_start + start_m) * stride_qt + off_h * stride_qh
        DO += (q_start + start_m) * stride_dot + off_h * stride_doh
        DQ += (q_start + start_m) * stride_dqt + off_h * stride_dqh
        K += k_start * stride_kt + off_hk * stride_kh
        V += k_start * stride_vt + off_hk * stride_vh
        qk_scale = sm_scale * _LOG2E
        tile_m = tl.arange(0, BLOCK_M)
        tile_n = tl.arange(0, BLOCK_N)
        offs_m = start_m + tile_m
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + tile_m[:, None] * stride_qt + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D,
                       True)  # fmt: skip
        do = _load_rows(DO + tile_m[:, None] * stride_dot + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM,
                        BLOCK_D, True)  # fmt: skip
        row_ok = offs_m < seq_q
        lse = tl.load(LSE + off_h * total_q + q_start + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + off_h * total_q + q_start + offs_m, mask=row_ok, other=0.0)
        seed = 0
        if HAS_DROPOUT:
            seed = tl.load(SEED)
        drop_rows = (q_start + offs_m) * num_heads + off_h
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = seq_k
        full_hi = seq_k // BLOCK_N * BLOCK_N
        if IS_CAUSAL:
            hi = tl.minimum(seq_k, start_m + BLOCK_M)
            full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
        for start_n in range(0, full_hi, BLOCK_N):
            dq = _varlen_bwd_dq_tile(
                dq, q, do, lse, delta, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
                seed, drop_rows, max_seqlen_k, dropout_p,
                IS_CAUSAL, HAS_DROPOUT, False, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
            )
        for start_n in range(full_hi, hi, BLOCK_N):
            dq = _varlen_bwd_dq_tile(
                dq, q, do, lse, delta, K, V, start_n, offs_m, tile_n, offs_d, seq_k, qk_scale, stride_kt, stride_vt,
                seed, drop_rows, max_seqlen_k, dropout_p,
                IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
            )
        _store_rows(DQ + tile_m[:, None] * stride_dqt + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                    offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip


def _grid(max_seqlen: int, block: int, heads: int, batch: int) -> tuple[int]:
    programs = triton.cdiv(max_seqlen, block) * heads * batch
    if programs > _MAX_PROGRAMS:
        raise ValueError(
            f"varlen_attention needs {programs} programs ({batch} sequences x {heads} heads x "
            f"{triton.cdiv(max_seqlen, block)} blocks), more than CUDA's {_MAX_PROGRAMS}; split the batch"
        )
    return (programs,)


# The varlen kernels' own 16-bit configs where the dense table's spill in them (their
# per-sequence bounds keep more live), as (table, kernel, BLOCK_D, kind, (BLOCK_M, BLOCK_N,
# num_warps, num_stages)). Picked by compiling every varlen case of bench.compile_cases for
# sm_90, sm_80 and sm_86: the dense tables' configs spilled 8 / 12 B (sm_90 forward, causal,
# 255 registers: 2 stages fit), 20 / 16 B (sm_80 dK/dV; 64 query rows also take 37% fewer
# warp-instructions per tile) and 28 / 20 B (sm_80 dQ with dropout; sm_86 takes it too).
_VARLEN_CONFIGS = (
    (_TENSOR_CORE_CONFIGS, "fwd", 128, "plain", (128, 128, 8, 2)),
    (_SM80_TENSOR_CORE_CONFIGS, "dkdv", 256, "plain", (64, 32, 8, 2)),
    (_SM80_TENSOR_CORE_CONFIGS, "dq", 128, "masked", (64, 32, 4, 2)),
    (_SMALL_SHARED_TENSOR_CORE_CONFIGS, "dq", 128, "masked", (64, 32, 4, 2)),
)


def _varlen_block_config(q: torch.Tensor, kernel: str, dropout_p: float) -> dict:
    """Launch options of ``kernel`` ("fwd", "dkdv", "dq") for q's device: the dense kernels'
    (``_block_config``), of kind "masked" with dropout, since it draws the per-row Philox
    tiles (``dropout_keep_tile``) for which those were chosen (the dense "dropout" configs fit
    the 4x4-block scheme only), else "plain"; ``_VARLEN_CONFIGS`` where they spill."""
    arch, shared_bytes = _device_arch(q), _device_shared_bytes(q)
    kind = "masked" if dropout_p > 0.0 else "plain"
    config = _block_config(q.shape[-1], q.dtype, kernel, kind, arch, shared_bytes)
    if q.dtype != torch.float32:
        table = _tensor_core_configs(arch, shared_bytes)
        for row_table, row_kernel, block_d, row_kind, own in _VARLEN_CONFIGS:
            if row_table is table and (row_kernel, block_d, row_kind) == (kernel, config["BLOCK_D"], kind):
                config.update(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), own))
    return config


def _strides(unit: int, *tensors: torch.Tensor) -> list[int]:
    """(token, head) strides of each tensor in units of ``unit`` elements, flattened."""
    return [stride // unit for tensor in tensors for stride in tensor.stride()[:2]]


def _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed):
    """Launch the forward kernel: (out (total_q, heads, head_dim), lse (heads, total_q) fp32)."""
    total_q, heads, _ = q.shape
    kv_heads = k.shape[1]
    batch = cu_q.numel() - 1
    if q.numel() == 0 or batch == 0 or max_q == 0:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.full((heads, total_q), math.inf, dtype=torch.float32, device=q.device)
    # every row belongs to a sequence (checked), whose programs write all of its rows
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device)
    config = _varlen_block_config(q, "fwd", dropout_p)
    unit = _stride_unit(q, k, v, out)
    _varlen_fwd_kernel[_grid(max_q, config["BLOCK_M"], heads, batch)](
        q, k, v, out, lse, seed, cu_q, cu_k, *_strides(unit, q, k, v, out),
        total_q, heads, heads // kv_heads, max_q, max_k, scale, dropout_p,
        **_kernel_flags(q, is_causal, dropout_p), NEGATIVE_SCALE=scale < 0, STRIDE_UNIT=unit, **config,
    )  # fmt: skip
    return out, lse


def _varlen_bwd(grad_out, q, k, v, out, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale):
    """Launch the backward kernels: (dq, dk, dv)."""
    total_q, heads, _ = q.shape
    kv_heads = k.shape[1]
    batch = cu_q.numel() - 1
    if q.numel() == 0 or k.numel() == 0 or batch == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.linalg.vecdot(out.float(), grad_out.float()).T.contiguous()  # (heads, total_q)
    unit = _stride_unit(q, k, v, grad_out, dq, dk, dv)
    flags = dict(**_kernel_flags(q, is_causal, dropout_p), STRIDE_UNIT=unit)
    dkdv_config = _varlen_block_config(q, "dkdv", dropout_p)
    _varlen_bwd_dkdv_kernel[_grid(max_k, dkdv_config["BLOCK_N"], kv_heads, batch)](
        q, k, v, grad_out, lse, delta, dk, dv, seed, cu_q, cu_k, *_strides(unit, q, k, v, grad_out, dk, dv),
        total_q, heads, heads // kv_heads, max_k, scale, dropout_p, **flags, **dkdv_config,
    )  # fmt: skip
    dq_config = _varlen_block_config(q, "dq", dropout_p)
    _varlen_bwd_dq_kernel[_grid(max_q, dq_config["BLOCK_M"], heads, batch)](
        q, k, v, grad_out, lse, delta, dq, seed, cu_q, cu_k, *_strides(unit, q, k, v, grad_out, dq),
        total_q, heads, heads // kv_heads, max_q, max_k, scale, dropout_p, **flags, **dq_config,
    )  # fmt: skip
    return dq, dk, dv


def _sequence_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q_start, q_stop, k_start, k_stop) of each sequence, on the host."""
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    return [(starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]) for b in range(len(starts_q) - 1)]


def _grouped_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(rows, heads, d) -> contiguous fp32 (fp64) (kv_heads, heads per kv head · rows, d): the
    query heads sharing a kv head stacked, so one bmm serves the group (GQA)."""
    grouped = rearrange(x, "l (k g) d -> k (g l) d", k=kv_heads)
    return torch.empty(grouped.shape, dtype=_reference_dtype(x), device=x.device).copy_(grouped)


def _causal_fill(s: torch.Tensor, heads: int, start: int, stop: int) -> None:
    """−inf at keys after their query, in place, for query rows start:stop."""
    n_keys = s.shape[-1]
    future = torch.arange(n_keys, device=s.device) > torch.arange(start, stop, device=s.device)[:, None]
    s.view(heads, stop - start, n_keys).masked_fill_(future, -math.inf)


def _keep_mask(seed, heads, q_start, start, stop, n_keys, max_k, p, shape) -> torch.Tensor:
    """The kernels' keep mask of query rows start:stop of a sequence starting at packed row
    q_start, every head, keys 0:n_keys; shaped like the block's scores."""
    tokens = torch.arange(q_start + start, q_start + stop, device=seed.device)
    rows = tokens[None, :] * heads + torch.arange(heads, device=seed.device)[:, None]  # (heads, rows)
    return dropout_keep_block(seed, rows, 0, n_keys, max_k, p).view(shape)


def _varlen_fwd_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed):
    """What ``_varlen_fwd`` computes, in fp32 PyTorch (fp64 for fp64 inputs), sequence by
    sequence and, within a long sequence, over blocks of query rows."""
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((heads, total_q), math.inf, dtype=_reference_dtype(q), device=q.device)
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    with torch.autocast(q.device.type, enabled=False):
        for q_start, q_stop, k_start, k_stop in _sequence_bounds(cu_q, cu_k):
            if q_stop == q_start or k_stop == k_start:
                continue  # no keys: o = 0, lse = +inf
            k_all, v_all = _grouped_rows(k[k_start:k_stop], kv_heads), _grouped_rows(v[k_start:k_stop], kv_heads)
            seq_k = k_stop - k_start
            for start, stop in reference_row_blocks(q_stop - q_start, heads * seq_k):
                n_keys = min(seq_k, stop) if is_causal else seq_k
                q_rows = _grouped_rows(q[q_start + start : q_start + stop], kv_heads)
                p = torch.bmm(q_rows, k_all[:, :n_keys].mT).mul_(scale)
                if is_causal:
                    _causal_fill(p, heads, start, stop)
                best = p.amax(-1, keepdim=True)
                p.sub_(best).exp_()
                total = p.sum(-1, keepdim=True)
                row_scale = total.reciprocal()
                if seed is not None:
                    p.mul_(_keep_mask(seed, heads, q_start, start, stop, n_keys, max_k, dropout_p, p.shape))
                    row_scale.mul_(keep_scale)
                o = torch.bmm(p.mul_(row_scale), v_all[:, :n_keys])
                rows = slice(q_start + start, q_start + stop)
                out[rows] = rearrange(o, "k (g l) d -> l (k g) d", l=stop - start)
                lse[:, rows] = best.add_(total.log_()).view(heads, stop - start)
    return out, lse


def _varlen_bwd_reference(grad_out, q, k, v, out, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale):
    """What ``_varlen_bwd`` computes, in fp32 PyTorch sequence by sequence: (dq, dk, dv).
    ``out`` is not read: each block holds whole rows of P and dP, from which it takes delta."""
    heads = q.shape[1]
    kv_heads = k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    with torch.autocast(q.device.type, enabled=False):
        for q_start, q_stop, k_start, k_stop in _sequence_bounds(cu_q, cu_k):
            if q_stop == q_start or k_stop == k_start:
                continue
            k_all, v_all = _grouped_rows(k[k_start:k_stop], kv_heads), _grouped_rows(v[k_start:k_stop], kv_heads)
            dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
            seq_k = k_stop - k_start
            for start, stop in reference_row_blocks(q_stop - q_start, heads * seq_k):
                n_keys = min(seq_k, stop) if is_causal else seq_k
                rows = slice(q_start + start, q_start + stop)
                q_rows = _grouped_rows(q[rows], kv_heads)
                do_rows = _grouped_rows(grad_out[rows], kv_heads)
                p = torch.bmm(q_rows, k_all[:, :n_keys].mT).mul_(scale)
                if is_causal:
                    _causal_fill(p, heads, start, stop)
                p.sub_(lse[:, rows].reshape(kv_heads, -1, 1)).exp_()
                if seed is None:
                    dv_all[:, :n_keys].baddbmm_(p.mT, do_rows)
                    dp = torch.bmm(do_rows, v_all[:, :n_keys].mT)
                else:
                    keep = _keep_mask(seed, heads, q_start, start, stop, n_keys, max_k, dropout_p, p.shape)
                    dv_all[:, :n_keys].baddbmm_((p * keep).mT, do_rows, alpha=keep_scale)
                    dp = torch.bmm(do_rows * keep_scale, v_all[:, :n_keys].mT).mul_(keep)
                delta = torch.linalg.vecdot(p, dp).unsqueeze(-1)
                ds = dp.sub_(delta).mul_(p)
                dk_all[:, :n_keys].baddbmm_(ds.mT, q_rows)
                dq_rows = torch.bmm(ds, k_all[:, :n_keys]).mul_(scale)
                dq[rows] = rearrange(dq_rows, "k (g l) d -> l (k g) d", l=stop - start)
            dk[k_start:k_stop] = rearrange(dk_all.mul_(scale), "k l d -> l k d")
            dv[k_start:k_stop] = rearrange(dv_all, "k l d -> l k d")
    return dq, dk, dv


# The differentiable op: forward and backward ``torch.library`` ops joined by
# ``register_autograd`` (as in ``slimformer.kernels.attention``), so that torch.compile
# keeps exactly the tensors listed below and traces a packed batch without reading
# cu_seqlens on the host: the token counts are the tensors' first dims, the longest
# sequences int arguments, and the cu_seqlens value checks run inside the op.


@torch.library.custom_op("slimformer::varlen_attention", mutates_args=())
def _varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seed: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, heads, head_dim) contiguous, lse (heads, total_q)) of q, k, v with a
    contiguous last dim."""
    _check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], max_q, "query")
    _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], max_k, "key")
    fwd = _varlen_fwd if _runs_kernels(q) else _varlen_fwd_reference
    return fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed)


@_varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, seed, max_q, max_k, dropout_p, is_causal, scale):
    total_q, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(heads, total_q, dtype=_reference_dtype(q), device=q.device)


@torch.library.custom_op("slimformer::varlen_attention_backward", mutates_args=())
def _varlen_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each shaped and strided like q, k, v (``empty_like``)."""
    bwd = _varlen_bwd if _runs_kernels(q) else _varlen_bwd_reference
    args = (seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale)
    return bwd(_last_dim_contiguous(grad_out), q, k, v, out, lse, *args)


@_varlen_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse, the dropout seed and both cu_seqlens."""
    q, k, v, cu_q, cu_k, seed, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.args = args


def _varlen_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 11
    q, k, v, out, lse, seed, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _varlen_backward_op(grad_out, q, k, v, out, lse, seed, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, *(None,) * 8


_varlen_op.register_autograd(_varlen_grad, setup_context=_varlen_setup_context)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, tensor_name: str) -> None:
    """Value checks of one cu_seqlens: exact errors on CPU; on GPU device-side asserts,
    so that no check costs a host sync."""
    if cu.device.type != "cpu":
        lengths = cu.diff()
        torch._assert_async(cu[0] == 0, f"{name}[0] must be 0")
        torch._assert_async(cu[-1] == total, f"{name}[-1] must equal {tensor_name}'s {total} rows")
        torch._assert_async((lengths >= 0).all(), f"{name} must be non-decreasing")
        torch._assert_async((lengths <= max_seqlen).all(), f"{name}'s sequences must be at most {max_seqlen} long")
        return
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"{name} must be non-decreasing, got {values[index]} then {values[index + 1]} at index {index}"
            )
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal {tensor_name}'s number of rows {total}, got {values[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"max_seqlen for {name} must be at least its longest sequence {max(lengths)}, got {max_seqlen}"
        )


def _check_max_seqlen(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed variable-length sequences, like flash-attn's ``flash_attn_varlen_func``.

    Sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key/value rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; it attends only to its own keys. Equal to
    ``slimformer.attention`` run on each sequence alone.

    Args:
        query: (total_q, heads, head_dim), float16, bfloat16 or float32 (float64 runs the
            PyTorch reference, for gradcheck); strided, last dim contiguous.
        key, value: (total_k, kv_heads, head_dim), query's dtype and device; kv_heads
            divides heads (query head h reads kv head h // (heads // kv_heads)).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on query's device: 0, then the
            running total of the lengths, ending at total_q / total_k. Zero-length
            sequences are allowed (their rows are none; a query with no key gets o = 0).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (an upper bound
            is fine: the grid has that many blocks per sequence, the extra ones exit).
            ``max_seqlen_k`` also sets the dropout mask's column count (see the module
            docstring), so it is part of what a seed reproduces.
        dropout_p: attention dropout in [0, 1), applied whenever > 0; the mask is drawn
            from torch's generator and regenerated in backward.
        is_causal: query i attends keys j <= i of its sequence (top-left aligned, as in
            ``slimformer.attention`` and SDPA; flash-attn >= 2.1 aligns bottom-right
            when a sequence has fewer queries than keys).
        scale: score scale, default 1 / sqrt(head_dim).
        return_lse: also return the fp32 log-sum-exp, (heads, total_q), +inf for rows
            with no key.

    Returns:
        (total_q, heads, head_dim) in query's dtype, contiguous; with ``return_lse``,
        (out, lse).

    Raises:
        TypeError: non-tensors, dtypes other than float16/bfloat16/float32/float64 or
            not matching, cu_seqlens not int32, max_seqlen not an int.
        ValueError: wrong ranks or shapes, kv heads not dividing heads, head_dim outside
            [1, 256], different devices, cu_seqlens of different lengths, not 1-d, not
            starting at 0, decreasing, not ending at the row count, a sequence longer than
            max_seqlen (on CUDA these value checks are device-side asserts: no host sync).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-d (total_tokens, heads, head_dim), got shape {tuple(tensor.shape)}")
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
    if query.dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"query must be float16, bfloat16, float32 or float64, got {query.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {tensor.device}")
    _, heads, head_dim = query.shape
    if key.shape[-1] != head_dim:
        raise ValueError(f"key must have query's head_dim {head_dim}, got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    _check_head_dim(head_dim)
    kv_heads = key.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"key and value heads must divide query's {heads} heads, got {kv_heads}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"{name} must be 1-d (batch + 1,), got shape {tuple(cu.shape)}")
        if cu.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's {cu_seqlens_q.numel()} entries (one sequence each), "
            f"got {cu_seqlens_k.numel()}"
        )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_dropout_p(dropout_p, 0, 0)  # 64-bit Philox counters here (dropout_keep_tile): none wrap
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    query, key, value = _last_dim_contiguous(query), _last_dim_contiguous(key), _last_dim_contiguous(value)
    seed = new_dropout_seed(query.device, query.detach(), "varlen_attention") if dropout_p > 0.0 else None
    out, lse = _varlen_op(
        query, key, value, cu_seqlens_q, cu_seqlens_k, seed, max_seqlen_q, max_seqlen_k, float(dropout_p),
        bool(is_causal), scale,
    )  # fmt: skip
    return (out, lse) if return_lse else out
