"""The attention forward: one program per block of queries of one (batch, head), or of
one (sequence, head) of packed varlen inputs, walking over the key blocks with an online
softmax (FlashAttention-2). It writes o and the fp32 ``lse``; see the package docstring.
"""

import torch
import triton
import triton.language as tl

from slimformer.kernels import dispatch
from slimformer.kernels.attention.configs import block_config, launch_kind
from slimformer.kernels.attention.launch import (
    empty_forward,
    empty_output,
    grid,
    head_strides,
    kernel_flags,
    mask_args,
    stride_unit,
    tma_descriptors,
    varlen_mask_args,
    window_args,
)
from slimformer.kernels.attention.tiles import (
    LN2,
    LOG2E,
    dot,
    dropout_words,
    key_padding,
    load_head_rows,
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
def _attention_fwd_tile(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    start_m,
    start_n,
    offs_m,
    tile_n,
    offs_d,
    off_b,
    off_h,
    off_hk,
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
    off_bh,
    dropout_p,
    MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    window,
    HAS_WINDOW: tl.constexpr,
):
    """One key block of the online softmax: the updated (acc, l_i, m_i)."""
    offs_n = start_n + tile_n
    first_col = tl.cast(start_n, tl.int64)
    if VARLEN:
        k = load_sequence_rows(K, offs_n, stride_ks, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    else:
        k = load_head_rows(
            K,
            off_b,
            off_hk,
            start_n,
            first_col * stride_ks,
            tile_n[:, None] * stride_ks,
            offs_n,
            seq_k,
            offs_d,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            EDGE,
            TMA,
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
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key so far has m = −inf; shifting by 0 keeps its p at 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
    else:
        # Every key of this tile is allowed, so the row max is finite and the scale folds
        # into the exponent's multiply-add (max(c·x) is c·max(x) for c >= 0, c·min(x) else).
        if NEGATIVE_SCALE:
            m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_shift = m_new
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VARLEN:
        v = load_sequence_rows(V, offs_n, stride_vs, seq_k, offs_d, HEAD_DIM, BLOCK_D, EDGE)
    else:
        v = load_head_rows(
            V,
            off_b,
            off_hk,
            start_n,
            first_col * stride_vs,
            tile_n[:, None] * stride_vs,
            offs_n,
            seq_k,
            offs_d,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            EDGE,
            TMA,
        )
    if HAS_KPM:
        # A padding key's score is −inf (masked_scores), its p 0; its v zeroed too, or 0 · NaN
        # would reach every row. The mask is read again here, not kept live across the tile.
        v = without_padding(v, key_padding(KPM, off_b, stride_kpb, stride_kpn, start_n, offs_n, seq_k))
    p = p.to(v.dtype)
    if HAS_DROPOUT:
        words0, words1, byte = dropout_words(
            seed, off_bh, start_m, start_n, seq_k, offs_m.shape[0], BLOCK_N, False, HAS_DROPOUT
        )
        p = dropout_mma_apply(p, words0, words1, byte, dropout_threshold_and_scale(dropout_p)[0])
    acc = dot(p, v, acc * alpha[:, None], PRECISION, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _attention_fwd_kernel(
    # (batch, heads, seq_q, head_dim) or varlen (total_q, heads, head_dim), strided, last dim
    # contiguous; with TMA its descriptor
    Q,
    K,  # (batch, kv_heads, seq_k, head_dim) or varlen (total_k, kv_heads, head_dim), likewise
    V,  # like K
    O,  # like Q, output
    LSE,  # (batch, heads, seq_q) or varlen (heads, total_q), fp32 output, natural log, contiguous
    SEED,  # () int64 dropout seed
    MASK,  # attn_mask broadcast to (batch, heads, seq_q, seq_k) by its strides, uint8 or float
    KPM,  # (batch, seq_k) uint8 key padding mask, nonzero = padding
    CU_Q,  # varlen: (batch + 1,) int32 first row of each sequence in q, then total_q
    CU_K,  # varlen: (batch + 1,) int32 likewise in k and v
    # (batch, head, seq) strides of q, k, v, o in units of STRIDE_UNIT elements; varlen: (0, head, token)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_kpb,
    stride_kpn,
    num_heads,
    group_size,
    seq_q,
    seq_k,  # varlen: the longest sequences, which size the grid
    total_q,  # varlen: q's rows
    sm_scale,
    dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences found by CU_Q / CU_K instead of a batch dim
    window=0,  # |j − i| allowed at most (HAS_WINDOW only),
    HAS_WINDOW: tl.constexpr = False,
):
    # Multiplying by the constexpr unit tells Triton each row starts 16 bytes aligned
    # (head_dim % 8 == 0), so rows load as 16-byte vectors even when head_dim % 16 != 0.
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_ob, stride_oh, stride_os = stride_ob * STRIDE_UNIT, stride_oh * STRIDE_UNIT, stride_os * STRIDE_UNIT
    pid_m, off_h, off_b = tile_ids(num_heads, seq_q, BLOCK_M, IS_CAUSAL)
    off_hk = off_h // group_size
    off_bh = off_b * num_heads + off_h
    # Scalar int64 offsets select the tiles; int32 offsets index inside them, so no
    # 64-bit index tile has to stay live across the loop.
    first_row = pid_m.to(tl.int64) * BLOCK_M
    if VARLEN:
        q_first, seq_q = sequence(CU_Q, off_b)
        k_first, seq_k = sequence(CU_K, off_b)
        if first_row >= seq_q:  # a block past the end of a shorter sequence
            return
        O += (q_first + first_row) * stride_os + off_h * stride_oh
        Q += (q_first + first_row) * stride_qs + off_h * stride_qh
        K += k_first * stride_ks + off_hk * stride_kh
        V += k_first * stride_vs + off_hk * stride_vh
    else:
        O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
        if not TMA:
            Q += off_b * stride_qb + off_h * stride_qh + first_row * stride_qs
            K += off_b * stride_kb + off_hk * stride_kh
            V += off_b * stride_vb + off_hk * stride_vh
    qk_scale = sm_scale * LOG2E

    start_m = pid_m * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_m = start_m + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    q = load_head_rows(
        Q,
        off_b,
        off_h,
        start_m,
        0,
        tile_m[:, None] * stride_qs,
        offs_m,
        seq_q,
        offs_d,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        True,
        TMA,
    )
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key blocks below full_hi are inside seq_k and (causal) before every query of the
    # block: no bounds or causal compares. The rest, up to hi, are edge blocks.
    lo = 0
    hi = seq_k
    full_hi = seq_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
        full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
    if HAS_WINDOW:
        # only the key blocks within the window of some query of the block, as edge tiles
        lo = tl.maximum(start_m - window, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, start_m + BLOCK_M + window)
        full_hi = lo
    for start_n in range(lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attention_fwd_tile(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            start_m,
            start_n,
            offs_m,
            tile_n,
            offs_d,
            off_b,
            off_h,
            off_hk,
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
            off_bh,
            dropout_p,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            HAS_DROPOUT,
            False,
            NEGATIVE_SCALE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
            UPCAST,
            TMA,
            VARLEN,
            window,
            HAS_WINDOW,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attention_fwd_tile(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            start_m,
            start_n,
            offs_m,
            tile_n,
            offs_d,
            off_b,
            off_h,
            off_hk,
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
            off_bh,
            dropout_p,
            MASK_KIND,
            HAS_KPM,
            IS_CAUSAL,
            HAS_DROPOUT,
            True,
            NEGATIVE_SCALE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
            UPCAST,
            TMA,
            VARLEN,
            window,
            HAS_WINDOW,
        )

    # l_i >= 1 (the best key adds exp2(0)) or NaN once a row has an allowed key; only a
    # row with none has l_i = 0. NaN scores leave l_i NaN, so o and lse come out NaN.
    has_keys = l_i != 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if HAS_DROPOUT:
        out = out * dropout_threshold_and_scale(dropout_p)[1]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("inf"))
    store_rows(
        O + tile_m[:, None] * stride_os + offs_d[None, :],
        out.to(O.dtype.element_ty),
        offs_m,
        seq_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
    )
    if VARLEN:
        tl.store(LSE + off_h * total_q + q_first + offs_m, lse, mask=offs_m < seq_q)
    else:
        tl.store(LSE + off_bh * seq_q + offs_m, lse, mask=offs_m < seq_q)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: torch.Tensor | None,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on (batch, heads, seq, head_dim) q, k, v with a contiguous
    last dim, a contiguous relative bias (heads, seq_q + seq_k − 1) or None, and a sliding
    window (keys with |j − i| <= window) or None. Returns (out, lse)."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        return empty_forward(q)
    out = empty_output(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    masks, mask_strides, mask_flags = mask_args(attn_mask, key_padding_mask, q, seq_k, relative_bias)
    kind = launch_kind(attn_mask, relative_bias, window, key_padding_mask, dropout_p)
    config = block_config(head_dim, q.dtype, "fwd", kind, *dispatch.device_target(q))
    unit = stride_unit(q, k, v, out)
    # Masked launches run small tiles, where TMA's barrier wait per tile costs more than
    # the cp.async addresses it saves (compile report): they keep the pointer loads.
    inputs = None
    if kind != "masked":
        rows = (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_N"])
        inputs = tma_descriptors((q, k, v), rows, config["BLOCK_D"])
    _attention_fwd_kernel[grid(cdiv(seq_q, config["BLOCK_M"]), heads, batch)](
        *(inputs or (q, k, v)),
        out,
        lse,
        seed,
        *masks,
        None,
        None,
        *head_strides(unit, q, k, v, out),
        *mask_strides,
        heads,
        heads // kv_heads,
        seq_q,
        seq_k,
        None,
        scale,
        dropout_p,
        **mask_flags,
        **kernel_flags(q, is_causal, dropout_p),
        NEGATIVE_SCALE=scale < 0,
        STRIDE_UNIT=unit,
        TMA=inputs is not None,
        VARLEN=False,
        **window_args(window),
        **config,
    )
    return out, lse


def varlen_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed, relative_bias=None, window=None
):
    """Launch the forward kernel on packed (total, heads, head_dim) q, k, v, with a contiguous
    relative bias (heads, max_q + max_k − 1) or None: (out (total_q, heads, head_dim)
    contiguous, lse (heads, total_q) fp32)."""
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    batch = cu_q.numel() - 1
    if q.numel() == 0 or batch == 0 or max_q == 0:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.full((heads, total_q), float("inf"), dtype=torch.float32, device=q.device)
    # every row belongs to a sequence (checked), whose programs write all of its rows
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device)
    kind = launch_kind(None, relative_bias, window, None, dropout_p)
    config = block_config(head_dim, q.dtype, "fwd", kind, *dispatch.device_target(q), varlen=True)
    unit = stride_unit(q, k, v, out)
    masks, mask_strides, mask_flags = varlen_mask_args(relative_bias, max_q)
    _attention_fwd_kernel[grid(cdiv(max_q, config["BLOCK_M"]), heads, batch)](
        q,
        k,
        v,
        out,
        lse,
        seed,
        *masks,
        cu_q,
        cu_k,
        *head_strides(unit, q, k, v, out),
        *mask_strides,
        heads,
        heads // kv_heads,
        max_q,
        max_k,
        total_q,
        scale,
        dropout_p,
        **mask_flags,
        **kernel_flags(q, is_causal, dropout_p),
        NEGATIVE_SCALE=scale < 0,
        STRIDE_UNIT=unit,
        TMA=False,
        VARLEN=True,
        **window_args(window),
        **config,
    )
    return out, lse
