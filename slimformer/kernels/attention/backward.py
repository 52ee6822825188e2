"""The attention backward: delta = rowsum(dO ∘ O), then one program per key block for dK
and dV (and, with ``deterministic=False``, dQ by fp32 atomics), and one per query block
for dQ; dense (batch, heads, seq) and packed varlen inputs alike. See the package
docstring for the math.
"""

import torch
import triton
import triton.language as tl

from slimformer.kernels import dispatch
from slimformer.kernels.attention.configs import block_config, launch_kind
from slimformer.kernels.attention.launch import (
    grid,
    head_strides,
    kernel_flags,
    mask_args,
    relative_bias_mask,
    stride_unit,
    varlen_mask_args,
    window_args,
)
from slimformer.kernels.attention.tiles import (
    LOG2E,
    atomic_add_rows,
    dot,
    dropout_words,
    key_padding,
    load_row_stat,
    load_rows,
    load_sequence_rows,
    masked_scores,
    sequence,
    store_rows,
    tile_ids,
    without_padding,
)
from slimformer.kernels.dispatch import cdiv
from slimformer.kernels.philox import dropout_mma_apply, dropout_threshold_and_scale


@triton.jit
def _attention_bwd_preprocess_kernel(
    O,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    DO,  # (batch, heads, seq_q, head_dim), likewise
    DELTA,  # (batch, heads, seq_q) or varlen (heads, total_q) fp32 output, contiguous
    CU_Q,  # varlen: (batch + 1,) int32 first row of each sequence, then total_q
    stride_ob,
    stride_oh,
    stride_os,  # in units of STRIDE_UNIT elements, as in the forward
    stride_dob,
    stride_doh,
    stride_dos,
    num_heads,
    seq_q,
    total_q,  # as in the forward
    HEAD_DIM: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr,
):
    stride_ob, stride_oh, stride_os = stride_ob * STRIDE_UNIT, stride_oh * STRIDE_UNIT, stride_os * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    pid_m, off_h, off_b = tile_ids(num_heads, seq_q, BLOCK_M, False)
    first_row = pid_m.to(tl.int64) * BLOCK_M
    if VARLEN:
        q_first, seq_q = sequence(CU_Q, off_b)
        if first_row >= seq_q:
            return
        O += (q_first + first_row) * stride_os + off_h * stride_oh
        DO += (q_first + first_row) * stride_dos + off_h * stride_doh
    else:
        O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
        DO += off_b * stride_dob + off_h * stride_doh + first_row * stride_dos
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    o = load_rows(O + tile_m[:, None] * stride_os + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_rows(DO + tile_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if VARLEN:
        tl.store(DELTA + off_h * total_q + q_first + offs_m, delta, mask=offs_m < seq_q)
    else:
        tl.store(DELTA + (off_b * num_heads + off_h) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _attention_bwd_dkdv_tile(
    dk,
    dv,
    k,
    v,
    q_head,
    do_head,
    lse_head,
    delta_head,
    dq_head,
    start_m,
    start_n,
    tile_m,
    offs_n,
    offs_d,
    off_b,
    off_h,
    off_bh,
    seq_q,
    seq_k,
    qk_scale,
    stride_qs,
    stride_dos,
    MASK,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    KPM,
    stride_kpb,
    stride_kpn,
    seed,
    dropout_p,
    MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    VARLEN: tl.constexpr,
    DBIAS,
    stride_dbh,
    BIAS_GRAD: tl.constexpr,
    window,
    HAS_WINDOW: tl.constexpr,
):
    """One query block's share of dK and dV: the updated (dk, dv). With DQ_ATOMIC, also
    this key block's share of the query block's dQ / scale, added into ``dq_head``. With
    BIAS_GRAD, the tile's dS summed along its diagonals j − i is added into the relative
    bias's gradient ``DBIAS`` (fp32, a pointer at its centre, ``stride_dbh`` per head).

    Tiles are (key, query), so dK and dV accumulate without transposing register tiles.
    Keys past seq_k need no mask: their rows of dk and dv are never stored (for dQ the
    kernel runs a partial key block's tiles as EDGE tiles, which mask them). Queries past
    seq_q load lse = +inf, so their p is 0.
    """
    offs_m = start_m + tile_m
    first_row = tl.cast(start_m, tl.int64)
    if VARLEN:
        q = load_sequence_rows(q_head, offs_m, stride_qs, seq_q, offs_d, HEAD_DIM, BLOCK_D, EDGE)
        do = load_sequence_rows(do_head, offs_m, stride_dos, seq_q, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    else:
        q = load_rows(
            q_head + first_row * stride_qs + tile_m[:, None] * stride_qs + offs_d[None, :],
            offs_m,
            seq_q,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            EDGE,
        )
        do = load_rows(
            do_head + first_row * stride_dos + tile_m[:, None] * stride_dos + offs_d[None, :],
            offs_m,
            seq_q,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            EDGE,
        )
    lse_log2 = load_row_stat(lse_head + offs_m, offs_m, seq_q, float("inf"), EDGE) * LOG2E
    delta = load_row_stat(delta_head + offs_m, offs_m, seq_q, 0.0, EDGE)
    qk_t = dot(k, tl.trans(q), None, PRECISION, UPCAST)
    if EDGE or MASK_KIND != 0 or HAS_KPM:
        s_t = masked_scores(
            qk_t,
            offs_m[None, :],
            offs_n[:, None],
            start_m,
            start_n,
            off_b,
            off_h,
            seq_q,
            seq_k,
            qk_scale,
            MASK,
            stride_mb,
            stride_mh,
            stride_mm,
            stride_mn,
            KPM,
            stride_kpb,
            stride_kpn,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            EDGE,
            window,
            HAS_WINDOW,
        )
        p_t = tl.exp2(s_t - lse_log2[None, :])
    else:
        p_t = tl.exp2(qk_t * qk_scale - lse_log2[None, :])
    dp_t = dot(v, tl.trans(do), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        words0, words1, byte = dropout_words(
            seed, off_bh, start_m, start_n, seq_k, tile_m.shape[0], BLOCK_N, True, HAS_DROPOUT
        )
        # r applied to dv at the end
        dv = dot(dropout_mma_apply(p_t.to(do.dtype), words0, words1, byte, threshold), do, dv, PRECISION, UPCAST)
        ds_t = p_t * (dropout_mma_apply(dp_t, words0, words1, byte, threshold) * scale - delta[None, :])
    else:
        dv = dot(p_t.to(do.dtype), do, dv, PRECISION, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
    if BIAS_GRAD:
        # dS is the gradient of every score, so of the bias value it added: one atomic per
        # score into the entry of its diagonal (a tile touches BLOCK_M + BLOCK_N − 1 of them)
        tl.atomic_add(
            DBIAS + off_h * stride_dbh + (offs_n[:, None] - offs_m[None, :]),
            ds_t,
            mask=(offs_n[:, None] < seq_k) & (offs_m[None, :] < seq_q),
            sem="relaxed",
        )
    ds_t = ds_t.to(q.dtype)
    dk = dot(ds_t, q, dk, PRECISION, UPCAST)
    if DQ_ATOMIC:
        dq = dot(tl.trans(ds_t), k, None, PRECISION, UPCAST)
        atomic_add_rows(
            dq_head + first_row * HEAD_DIM + tile_m[:, None] * HEAD_DIM + offs_d[None, :],
            dq,
            offs_m,
            seq_q,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            EDGE,
        )
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,  # as in the forward
    DO,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    LSE,
    DELTA,  # (batch, heads, seq_q) fp32, contiguous
    DK,
    DV,  # (batch, kv_heads, seq_k, head_dim) outputs, strided, last dim contiguous
    # (batch, heads, seq_q, head_dim) or varlen (heads, total_q, head_dim) fp32, contiguous,
    # zeroed: dQ / scale (DQ_ATOMIC only)
    DQ_ACC,
    SEED,
    MASK,
    KPM,
    CU_Q,
    CU_K,  # as in the forward
    # strides of q, k, v, do, dk, dv in units of STRIDE_UNIT elements
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_kpb,
    stride_kpn,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    total_q,
    sm_scale,
    dropout_p,  # as in the forward
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,  # also add each tile's dQ into DQ_ACC (one pass, not deterministic)
    VARLEN: tl.constexpr,
    DBIAS=None,  # the relative bias's fp32 gradient, a pointer at its centre (BIAS_GRAD only)
    stride_dbh=0,
    BIAS_GRAD: tl.constexpr = False,
    window=0,  # |j − i| allowed at most (HAS_WINDOW only),
    HAS_WINDOW: tl.constexpr = False,
):
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    stride_dkb, stride_dkh, stride_dks = stride_dkb * STRIDE_UNIT, stride_dkh * STRIDE_UNIT, stride_dks * STRIDE_UNIT
    stride_dvb, stride_dvh, stride_dvs = stride_dvb * STRIDE_UNIT, stride_dvh * STRIDE_UNIT, stride_dvs * STRIDE_UNIT
    pid_n, off_hk, off_b = tile_ids(num_heads // group_size, seq_k, BLOCK_N, False)
    first_col = pid_n.to(tl.int64) * BLOCK_N
    if VARLEN:
        q_first, seq_q = sequence(CU_Q, off_b)
        k_first, seq_k = sequence(CU_K, off_b)
        if first_col >= seq_k:
            return
        K += (k_first + first_col) * stride_ks + off_hk * stride_kh
        V += (k_first + first_col) * stride_vs + off_hk * stride_vh
        DK += (k_first + first_col) * stride_dks + off_hk * stride_dkh
        DV += (k_first + first_col) * stride_dvs + off_hk * stride_dvh
    else:
        K += off_b * stride_kb + off_hk * stride_kh + first_col * stride_ks
        V += off_b * stride_vb + off_hk * stride_vh + first_col * stride_vs
        DK += off_b * stride_dkb + off_hk * stride_dkh + first_col * stride_dks
        DV += off_b * stride_dvb + off_hk * stride_dvh + first_col * stride_dvs
    qk_scale = sm_scale * LOG2E

    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tile_n
    offs_d = tl.arange(0, BLOCK_D)
    k = load_rows(K + tile_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_rows(V + tile_n[:, None] * stride_vs + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query blocks [lo, edge_hi) straddle the causal diagonal and the last one may pass
    # seq_q: edge blocks. The blocks in between need no compares.
    start_n = pid_n * BLOCK_N
    lo = 0
    edge_hi = 0
    if IS_CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        edge_hi = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, seq_q)
    if DQ_ATOMIC:
        # Keys past seq_k score q·0 outside edge tiles, a p that dK and dV never store but
        # dQ would add: a partial key block takes every query block as an edge block.
        edge_hi = tl.where(start_n + BLOCK_N > seq_k, seq_q, edge_hi)
    full_hi = seq_q // BLOCK_M * BLOCK_M
    q_hi = seq_q
    if HAS_WINDOW:
        # only the query blocks within the window of some key of the block, as edge tiles
        lo = tl.maximum(lo, tl.maximum(start_n - window, 0) // BLOCK_M * BLOCK_M)
        edge_hi = tl.minimum(start_n + BLOCK_N + window, seq_q)
        full_hi = edge_hi
        q_hi = edge_hi
    for g in range(group_size):
        off_h = off_hk * group_size + g
        off_bh = off_b * num_heads + off_h
        if VARLEN:
            q_head = Q + q_first * stride_qs + off_h * stride_qh
            do_head = DO + q_first * stride_dos + off_h * stride_doh
            lse_head = LSE + off_h * total_q + q_first
            delta_head = DELTA + off_h * total_q + q_first
            dq_head = DQ_ACC
            if DQ_ATOMIC:
                dq_head += (off_h * total_q + q_first) * HEAD_DIM
        else:
            q_head = Q + off_b * stride_qb + off_h * stride_qh
            do_head = DO + off_b * stride_dob + off_h * stride_doh
            lse_head = LSE + off_bh * seq_q
            delta_head = DELTA + off_bh * seq_q
            dq_head = DQ_ACC
            if DQ_ATOMIC:
                dq_head += off_bh * seq_q * HEAD_DIM
        for start_m in range(lo, edge_hi, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk,
                dv,
                k,
                v,
                q_head,
                do_head,
                lse_head,
                delta_head,
                dq_head,
                start_m,
                start_n,
                tile_m,
                offs_n,
                offs_d,
                off_b,
                off_h,
                off_bh,
                seq_q,
                seq_k,
                qk_scale,
                stride_qs,
                stride_dos,
                MASK,
                stride_mb,
                stride_mh,
                stride_mm,
                stride_mn,
                KPM,
                stride_kpb,
                stride_kpn,
                seed,
                dropout_p,
                MASK_KIND,
                HAS_KPM,
                IS_CAUSAL,
                HAS_DROPOUT,
                True,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                PRECISION,
                UPCAST,
                DQ_ATOMIC,
                VARLEN,
                DBIAS,
                stride_dbh,
                BIAS_GRAD,
                window,
                HAS_WINDOW,
            )
        for start_m in range(tl.maximum(lo, edge_hi), full_hi, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk,
                dv,
                k,
                v,
                q_head,
                do_head,
                lse_head,
                delta_head,
                dq_head,
                start_m,
                start_n,
                tile_m,
                offs_n,
                offs_d,
                off_b,
                off_h,
                off_bh,
                seq_q,
                seq_k,
                qk_scale,
                stride_qs,
                stride_dos,
                MASK,
                stride_mb,
                stride_mh,
                stride_mm,
                stride_mn,
                KPM,
                stride_kpb,
                stride_kpn,
                seed,
                dropout_p,
                MASK_KIND,
                HAS_KPM,
                IS_CAUSAL,
                HAS_DROPOUT,
                False,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                PRECISION,
                UPCAST,
                DQ_ATOMIC,
                VARLEN,
                DBIAS,
                stride_dbh,
                BIAS_GRAD,
                window,
                HAS_WINDOW,
            )
        for start_m in range(tl.maximum(tl.maximum(lo, edge_hi), full_hi), q_hi, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk,
                dv,
                k,
                v,
                q_head,
                do_head,
                lse_head,
                delta_head,
                dq_head,
                start_m,
                start_n,
                tile_m,
                offs_n,
                offs_d,
                off_b,
                off_h,
                off_bh,
                seq_q,
                seq_k,
                qk_scale,
                stride_qs,
                stride_dos,
                MASK,
                stride_mb,
                stride_mh,
                stride_mm,
                stride_mn,
                KPM,
                stride_kpb,
                stride_kpn,
                seed,
                dropout_p,
                MASK_KIND,
                HAS_KPM,
                IS_CAUSAL,
                HAS_DROPOUT,
                True,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                PRECISION,
                UPCAST,
                DQ_ATOMIC,
                VARLEN,
                DBIAS,
                stride_dbh,
                BIAS_GRAD,
                window,
                HAS_WINDOW,
            )

    if HAS_KPM:
        # A key's dk, dv read only its own k, v (a padding key's score is −inf, so its p is 0):
        # zeroing them here keeps a NaN in a padding key's k or v, or a NaN row's p, out of them.
        padding = key_padding(KPM, off_b, stride_kpb, stride_kpn, pid_n * BLOCK_N, offs_n, seq_k)
        dk = without_padding(dk, padding)
        dv = without_padding(dv, padding)
    store_rows(
        DK + tile_n[:, None] * stride_dks + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        offs_n,
        seq_k,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )
    if HAS_DROPOUT:
        dv = dv * dropout_threshold_and_scale(dropout_p)[1]
    store_rows(
        DV + tile_n[:, None] * stride_dvs + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        offs_n,
        seq_k,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )


@triton.jit
def _attention_bwd_dq_tile(
    dq,
    q,
    do,
    lse_log2,
    delta,
    K,
    V,
    start_m,
    start_n,
    offs_m,
    tile_n,
    offs_d,
    off_b,
    off_h,
    off_bh,
    seq_q,
    seq_k,
    qk_scale,
    stride_ks,
    stride_vs,
    MASK,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    KPM,
    stride_kpb,
    stride_kpn,
    seed,
    dropout_p,
    MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VARLEN: tl.constexpr,
    window,
    HAS_WINDOW: tl.constexpr,
):
    """One key block's share of dQ: the updated dq."""
    offs_n = start_n + tile_n
    first_col = tl.cast(start_n, tl.int64)
    if VARLEN:
        k = load_sequence_rows(K, offs_n, stride_ks, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
        v = load_sequence_rows(V, offs_n, stride_vs, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    else:
        # A padding key's k and v load as zeros (its row index moved past seq_k), or a NaN in
        # them would reach dq through its ds of 0 and through dp (0 · NaN).
        rows = offs_n
        if HAS_KPM:
            rows = tl.where(key_padding(KPM, off_b, stride_kpb, stride_kpn, start_n, offs_n, seq_k) == 0, offs_n, seq_k)
        k = load_rows(
            K + first_col * stride_ks + tile_n[:, None] * stride_ks + offs_d[None, :],
            rows,
            seq_k,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            EDGE or HAS_KPM,
        )
        v = load_rows(
            V + first_col * stride_vs + tile_n[:, None] * stride_vs + offs_d[None, :],
            rows,
            seq_k,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            EDGE or HAS_KPM,
        )
    qk = dot(q, tl.trans(k), None, PRECISION, UPCAST)
    if EDGE or MASK_KIND != 0 or HAS_KPM:
        s = masked_scores(
            qk,
            offs_m[:, None],
            offs_n[None, :],
            start_m,
            start_n,
            off_b,
            off_h,
            seq_q,
            seq_k,
            qk_scale,
            MASK,
            stride_mb,
            stride_mh,
            stride_mm,
            stride_mn,
            KPM,
            stride_kpb,
            stride_kpn,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            EDGE,
            window,
            HAS_WINDOW,
        )
        p = tl.exp2(s - lse_log2[:, None])
    else:
        p = tl.exp2(qk * qk_scale - lse_log2[:, None])
    dp = dot(do, tl.trans(v), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        words0, words1, byte = dropout_words(
            seed, off_bh, start_m, start_n, seq_k, offs_m.shape[0], BLOCK_N, False, HAS_DROPOUT
        )
        ds = p * (dropout_mma_apply(dp, words0, words1, byte, threshold) * scale - delta[:, None])
    else:
        ds = p * (dp - delta[:, None])
    return dot(ds.to(k.dtype), k, dq, PRECISION, UPCAST)


@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,  # as in the dK/dV kernel
    DQ,  # like Q, output
    SEED,
    MASK,
    KPM,
    CU_Q,
    CU_K,  # as in the forward
    # strides of q, k, v, do, dq in units of STRIDE_UNIT elements
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_kpb,
    stride_kpn,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    total_q,
    sm_scale,
    dropout_p,  # as in the forward
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VARLEN: tl.constexpr,
    window=0,  # |j − i| allowed at most (HAS_WINDOW only),
    HAS_WINDOW: tl.constexpr = False,
):
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    stride_dqb, stride_dqh, stride_dqs = stride_dqb * STRIDE_UNIT, stride_dqh * STRIDE_UNIT, stride_dqs * STRIDE_UNIT
    pid_m, off_h, off_b = tile_ids(num_heads, seq_q, BLOCK_M, IS_CAUSAL)
    off_hk = off_h // group_size
    off_bh = off_b * num_heads + off_h
    first_row = pid_m.to(tl.int64) * BLOCK_M
    if VARLEN:
        q_first, seq_q = sequence(CU_Q, off_b)
        k_first, seq_k = sequence(CU_K, off_b)
        if first_row >= seq_q:
            return
        Q += (q_first + first_row) * stride_qs + off_h * stride_qh
        DO += (q_first + first_row) * stride_dos + off_h * stride_doh
        DQ += (q_first + first_row) * stride_dqs + off_h * stride_dqh
        K += k_first * stride_ks + off_hk * stride_kh
        V += k_first * stride_vs + off_hk * stride_vh
    else:
        Q += off_b * stride_qb + off_h * stride_qh + first_row * stride_qs
        DO += off_b * stride_dob + off_h * stride_doh + first_row * stride_dos
        DQ += off_b * stride_dqb + off_h * stride_dqh + first_row * stride_dqs
        K += off_b * stride_kb + off_hk * stride_kh
        V += off_b * stride_vb + off_hk * stride_vh
    qk_scale = sm_scale * LOG2E

    start_m = pid_m * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_m = start_m + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(Q + tile_m[:, None] * stride_qs + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_rows(DO + tile_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    if VARLEN:
        stats = off_h * total_q + q_first
    else:
        stats = off_bh * seq_q
    lse_log2 = load_row_stat(LSE + stats + offs_m, offs_m, seq_q, float("inf"), True) * LOG2E
    delta = load_row_stat(DELTA + stats + offs_m, offs_m, seq_q, 0.0, True)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # As in the forward: key blocks below full_hi need no compares.
    lo = 0
    hi = seq_k
    full_hi = seq_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
        full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, start_m + BLOCK_M + window)
        full_hi = lo
    for start_n in range(lo, full_hi, BLOCK_N):
        dq = _attention_bwd_dq_tile(
            dq,
            q,
            do,
            lse_log2,
            delta,
            K,
            V,
            start_m,
            start_n,
            offs_m,
            tile_n,
            offs_d,
            off_b,
            off_h,
            off_bh,
            seq_q,
            seq_k,
            qk_scale,
            stride_ks,
            stride_vs,
            MASK,
            stride_mb,
            stride_mh,
            stride_mm,
            stride_mn,
            KPM,
            stride_kpb,
            stride_kpn,
            seed,
            dropout_p,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            HAS_DROPOUT,
            False,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
            UPCAST,
            VARLEN,
            window,
            HAS_WINDOW,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _attention_bwd_dq_tile(
            dq,
            q,
            do,
            lse_log2,
            delta,
            K,
            V,
            start_m,
            start_n,
            offs_m,
            tile_n,
            offs_d,
            off_b,
            off_h,
            off_bh,
            seq_q,
            seq_k,
            qk_scale,
            stride_ks,
            stride_vs,
            MASK,
            stride_mb,
            stride_mh,
            stride_mm,
            stride_mn,
            KPM,
            stride_kpb,
            stride_kpn,
            seed,
            dropout_p,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            HAS_DROPOUT,
            True,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
            UPCAST,
            VARLEN,
            window,
            HAS_WINDOW,
        )

    store_rows(
        DQ + tile_m[:, None] * stride_dqs + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        offs_m,
        seq_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )


def attention_backward(
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
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    relative_bias: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """Launch the backward kernels (delta, then dK/dV and dQ), writing into dq, dk, dv (a
    sliding ``window`` as in ``forward.attention_forward``), and
    with a (contiguous) ``relative_bias`` adding its gradient into ``dbias`` (fp32, zeroed,
    contiguous, shaped like it) with atomics, in no fixed order.

    Every (batch, heads, seq, head_dim) tensor may be strided with a contiguous last dim.
    ``deterministic=False`` computes dQ in the dK/dV kernel with fp32 atomics (5 GEMMs per
    tile pair rather than 7; the order of the additions, so dQ's rounding, varies by run).
    """
    batch, _, seq_q, _ = q.shape
    seq_k = k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    _launch(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        seed,
        dq,
        dk,
        dv,
        mask_args(attn_mask, key_padding_mask, q, seq_k, relative_bias),
        launch_kind(attn_mask, relative_bias, window, key_padding_mask, dropout_p),
        dropout_p,
        is_causal,
        scale,
        deterministic,
        batch,
        seq_q,
        seq_k,
        None,
        None,
        None,
        dbias,
        window,
    )


def varlen_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    seed,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    scale,
    deterministic,
    relative_bias=None,
    dbias=None,
    window=None,
):
    """Launch the backward kernels on packed (total, heads, head_dim) tensors: (dq, dk, dv);
    with a relative bias (heads, max_q + max_k − 1), its gradient is added into ``dbias`` as
    in ``attention_backward``."""
    batch = cu_q.numel() - 1
    if q.numel() == 0 or k.numel() == 0 or batch == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _launch(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        seed,
        dq,
        dk,
        dv,
        varlen_mask_args(relative_bias, max_q),
        launch_kind(None, relative_bias, window, None, dropout_p),
        dropout_p,
        is_causal,
        scale,
        deterministic,
        batch,
        max_q,
        max_k,
        cu_q,
        cu_k,
        q.shape[0],
        dbias,
        window,
    )
    return dq, dk, dv


def _bias_grad_args(dbias: torch.Tensor | None, seq_q: int, config: dict) -> dict:
    """The dK/dV kernel's arguments for a relative bias's gradient (centre at seq_q − 1), and
    its config: the atomics address a (BLOCK_N, BLOCK_M) tile of 64-bit pointers, which
    spills in 4 warps on sm_90 (compile report), so 8 warps share it."""
    if dbias is None:
        return config
    return dict(
        config,
        num_warps=max(config["num_warps"], 8),
        DBIAS=relative_bias_mask(dbias, seq_q - 1)[0],
        stride_dbh=dbias.stride(0),
        BIAS_GRAD=True,
    )


def _launch(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    seed,
    dq,
    dk,
    dv,
    masks_args,
    kind,
    dropout_p,
    is_causal,
    scale,
    deterministic,
    batch,
    seq_q,
    seq_k,
    cu_q,
    cu_k,
    total_q,
    dbias=None,
    window=None,
):
    """The launches of both layouts: varlen ones have cu_q, cu_k and total_q, and seq_q,
    seq_k are their longest sequences. ``dbias``: the relative bias's gradient, or None."""
    varlen = cu_q is not None
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    target = dispatch.device_target(q)
    delta = torch.empty_like(lse)
    dq_config = block_config(head_dim, q.dtype, "dq", kind, *target, varlen=varlen)
    if dbias is not None:
        # a relative bias's tile is read through negative strides, whose offsets the masked
        # config's 64-key tiles spill on sm_90 (compile report): half the keys per tile
        dq_config = dict(dq_config, BLOCK_N=min(dq_config["BLOCK_N"], 32))
    q_blocks = cdiv(seq_q, dq_config["BLOCK_M"])
    unit = stride_unit(q, k, v, out, grad_out, dq, dk, dv)
    _attention_bwd_preprocess_kernel[grid(q_blocks, heads, batch)](
        out,
        grad_out,
        delta,
        cu_q,
        *head_strides(unit, out, grad_out),
        heads,
        seq_q,
        total_q,
        HEAD_DIM=head_dim,
        STRIDE_UNIT=unit,
        BLOCK_M=dq_config["BLOCK_M"],
        BLOCK_D=dq_config["BLOCK_D"],
        VARLEN=varlen,
        num_warps=dq_config["num_warps"],
    )
    masks, mask_strides, mask_flags = masks_args
    scalars = (*mask_strides, heads, heads // kv_heads, seq_q, seq_k, total_q, scale, dropout_p)
    flags = dict(
        **mask_flags, **kernel_flags(q, is_causal, dropout_p), **window_args(window), STRIDE_UNIT=unit, VARLEN=varlen
    )
    # The atomic path adds dQ / scale into a zeroed fp32 buffer, in whatever order the
    # key blocks' programs reach it, then scales and casts it in one pass.
    dq_acc = None if deterministic else torch.zeros((*lse.shape, head_dim), dtype=torch.float32, device=q.device)
    dkdv_config = block_config(
        head_dim,
        q.dtype,
        "dkdv" if deterministic else "dkdv_dq",
        kind,
        *target,
        grouped=heads != kv_heads,
        varlen=varlen,
    )
    # GQA's loop over the group's heads keeps more live, so its dK/dV tiles draw without
    # lane-paired Philox calls (HAS_DROPOUT 1), which would need the registers
    dkdv_flags = dict(flags, HAS_DROPOUT=min(flags["HAS_DROPOUT"], 1)) if heads != kv_heads else flags
    _attention_bwd_dkdv_kernel[grid(cdiv(seq_k, dkdv_config["BLOCK_N"]), kv_heads, batch)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        seed,
        *masks,
        cu_q,
        cu_k,
        *head_strides(unit, q, k, v, grad_out, dk, dv),
        *scalars,
        **dkdv_flags,
        **_bias_grad_args(dbias, seq_q, dkdv_config),
        DQ_ATOMIC=not deterministic,
    )
    if not deterministic:
        # varlen's buffer is (heads, total_q, head_dim), its dq (total_q, heads, head_dim)
        torch.mul(dq_acc.transpose(0, 1) if varlen else dq_acc, scale, out=dq)
        return
    _attention_bwd_dq_kernel[grid(q_blocks, heads, batch)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dq,
        seed,
        *masks,
        cu_q,
        cu_k,
        *head_strides(unit, q, k, v, grad_out, dq),
        *scalars,
        **flags,
        **dq_config,
    )
