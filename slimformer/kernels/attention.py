"""Fused scaled-dot-product attention (FlashAttention-2) with masks, dropout and GQA.

For query row i and key j, with ``z`` the dropout keep mask and ``r = 1 / (1 - dropout_p)``:

    s_ij = scale · q_i·k_j + mask_ij   (−inf where key j is not allowed for row i)
    lse_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij − lse_i),   o_i = Σ_j r z_ij p_ij v_j

The forward walks over key blocks with an online softmax, so neither s nor p is ever
written to memory. It saves q, k, v, o, the fp32 ``lse`` and the dropout seed: with
``lse`` the backward rebuilds p block by block, and z comes back from the seed (Philox
stream b · heads + h, counter and byte from (i, j) in the MMA-layout scheme of
``philox.py``, so each thread draws the keep bits of the scores it holds). The backward
uses ``delta_i = Σ_d dO_id O_id = Σ_j dP_ij P_ij`` and

    dP = r z ∘ dO Vᵀ,   dS = P ∘ (dP − delta),   dV = (r z ∘ P)ᵀ dO,
    dK = scale · dSᵀ Q,   dQ = scale · dS K

in two passes without races: one program per key block accumulates dK and dV over
every query block of every query head sharing that key/value head (GQA), and one
program per query block accumulates dQ. With ``deterministic=False`` the first pass
also adds each tile's dS K into an fp32 dQ buffer with atomics (5 GEMMs per tile pair
instead of 7, in an order that varies from run to run).

A key is not allowed where a bool mask is False, the key is padding, it lies in the
causal future, or its additive mask value is at most ``MASKED_BIAS`` (−inf, finfo.min,
−1e9: a row masked only by such values would have an lse too large for fp32 to rebuild
p from, and SDPA would average v uniformly there). Which rows have no allowed key is
decided from the masks alone, never from the scores: a row of very negative scores
(``scale=2e4``) gives SDPA's answer. A row with no allowed key gets o = 0 and
lse = +inf; with lse = +inf every p_ij of that row is exp(−inf) = 0, so the backward
gives the row, and the keys it would have seen, zero gradient without a special case.
NaN and inf in q, k, v, ``scale`` or an additive mask propagate as in SDPA (a NaN mask
value masks nothing).

The kernels read q, k, v through their strides (only head_dim must be contiguous), so
the heads of a fused QKV projection are used in place (on sm_90 the forward reads them
through TMA descriptors, which take the same strides), and write o as (batch, seq,
heads, head_dim), so that merging the heads for the output projection is a view and
that projection saves the very storage attention saved. ``self_attention`` adds the
``qkv`` recompute policy: its backward recomputes the projection from the layer input
and keeps only the input, o and lse.
"""

import math
import numbers
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from einops import rearrange
from torch.nn.attention.bias import CausalBias, CausalVariant
from triton.tools.tensor_descriptor import TensorDescriptor

from slimformer.kernels.dispatch import absent_output, reference_row_blocks, use_triton
from slimformer.kernels.philox import (
    dropout_keep_mma_block,
    dropout_mma_apply,
    dropout_mma_words,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# An additive mask value at or below this masks its key, like −inf: finfo.min of every
# float dtype and −1e9 do. A row masked only by such values would have an lse too large
# for fp32 to hold log Σ exp (at |lse| = 1e9 the ulp is 64), so backward could not
# rebuild p from it; masks of −1e4 (older HF models) still weigh their keys, as in SDPA.
MASKED_BIAS = -(2.0**15)
_MASKED_BIAS = tl.constexpr(MASKED_BIAS)
_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_MASK, _BOOL_MASK, _ADDITIVE_MASK = 0, 1, 2


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32 (the tensor cores add into ``acc`` in place)."""
    if UPCAST:
        # Triton 3.6's interpreter multiplies bf16 blocks as their raw uint16 bits; the
        # fp32 product of bf16 values is exact, so upcasting changes no result.
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _tile_ids(num_heads, seq, BLOCK: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """(block, head, batch) of this program. Axis 0 of the grid numbers the blocks of every
    (batch, head), blocks fastest, so programs running together share k and v in L2 and
    any batch fits the grid (axes 1 and 2 stop at 65,535). LONGEST_FIRST reverses the
    blocks of a causal launch, whose last query blocks have the most keys."""
    num_blocks = tl.cdiv(seq, BLOCK)
    pid = tl.program_id(0)
    block = pid % num_blocks
    if LONGEST_FIRST:
        block = num_blocks - 1 - block
    bh = pid // num_blocks
    return block, (bh % num_heads).to(tl.int64), (bh // num_heads).to(tl.int64)


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile, zero past HEAD_DIM and (when CHECK_ROWS) past ``n_rows``;
    tiles known to be in bounds load without a mask."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the first ``n_rows`` rows and HEAD_DIM columns of a (rows, BLOCK_D) tile."""
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _atomic_add_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CHECK_ROWS: tl.constexpr):  # fmt: skip
    """Add a (rows, BLOCK_D) fp32 tile into memory with atomics, as ``_store_rows`` masks."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, mask=rows[:, None] < n_rows, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    else:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")


@triton.jit
def _load_row_stat(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    """One fp32 statistic (lse, delta) per row, ``other`` past ``n_rows`` when CHECK_ROWS."""
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _masked_scores(
    qk, rows, cols, start_m, start_n, off_b, off_h, seq_q, seq_k, qk_scale,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    KPM, stride_kpb, stride_kpn,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    EDGE: tl.constexpr,
):
    """Scores of one tile in log2 units, −inf where a key is not allowed.

    ``rows`` (query indices) and ``cols`` (key indices) broadcast to the tile's shape,
    so the same code serves (query, key) tiles and the transposed (key, query) tiles;
    they start at ``start_m`` and ``start_n``. The masks' tiles are addressed by a scalar
    int64 offset plus int32 offsets inside the tile (the launcher checks they fit).
    Only an EDGE tile may hold keys past seq_k or (causal) keys after a query, so only
    it pays for those compares.
    """
    s = qk * qk_scale
    if HAS_KPM:
        kpm_row = KPM + off_b * stride_kpb + tl.cast(start_n, tl.int64) * stride_kpn
        padding = tl.load(kpm_row + (cols - start_n) * stride_kpn, mask=cols < seq_k, other=1)
        s = tl.where(padding == 0, s, float("-inf"))
    if MASK_KIND != 0:
        mask_tile = (
            MASK + off_b * stride_mb + off_h * stride_mh
            + tl.cast(start_m, tl.int64) * stride_mm + tl.cast(start_n, tl.int64) * stride_mn
        )
        mask_ptrs = mask_tile + ((rows - start_m) * stride_mm + (cols - start_n) * stride_mn)
        mask = tl.load(mask_ptrs, mask=(rows < seq_q) & (cols < seq_k), other=0)
        if MASK_KIND == 1:
            s = tl.where(mask != 0, s, float("-inf"))
        else:
            bias = mask.to(tl.float32)
            # NaN is not <= MASKED_BIAS: that key stays allowed and its NaN score propagates.
            # (finfo.min · log2(e) would overflow; such a key is masked either way.)
            weighs = (bias > _MASKED_BIAS) | (bias != bias)
            s = tl.where(weighs, s + bias * _LOG2E, float("-inf"))
    if EDGE:
        allowed = cols < seq_k
        if IS_CAUSAL:
            allowed &= cols <= rows
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def _dropout_words(seed, off_bh, start_m, start_n, seq_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   KEYS_FIRST: tl.constexpr, HAS_DROPOUT: tl.constexpr):  # fmt: skip
    """The words and bytes that decide z for queries start_m .. start_m + BLOCK_M and keys
    start_n .. start_n + BLOCK_N ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when KEYS_FIRST):
    stream ``off_bh`` = batch · heads + head of ``philox.py``'s attention scheme, drawn in
    the tile's register layout, for ``dropout_mma_apply``; lane pairs share out their
    Philox calls where HAS_DROPOUT is 2 (``_kernel_flags``). The kernels apply
    r = 1 / (1 − p) outside the loops where it is linear, else in an existing multiply-add."""
    return dropout_mma_words(seed, off_bh, start_m, start_n, seq_k, BLOCK_M, BLOCK_N, KEYS_FIRST, HAS_DROPOUT == 2)


@triton.jit
def _load_head_rows(
    X, off_b, off_h, start, first, row_offsets, rows, n_rows, offs_d,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """A (BLOCK, BLOCK_D) tile, rows start .. start + BLOCK of head (off_b, off_h): through
    ``X``'s TMA descriptor when TMA (the copy engine zero-fills past seq and HEAD_DIM and
    needs no address per element), else ``_load_rows`` at ``X + first + row_offsets +
    offs_d``, in that order: the scalar int64 offset ``first`` goes into the pointer before
    the int32 offsets of the tile, so no 64-bit index tile is made."""
    if TMA:
        x = X.load([off_b.to(tl.int32), off_h.to(tl.int32), start, 0]).reshape(BLOCK, BLOCK_D)
    else:
        x = _load_rows(X + first + row_offsets + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return x


@triton.jit
def _attention_fwd_tile(
    acc, l_i, m_i, q, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_hk, seq_q, seq_k, qk_scale,
    stride_ks, stride_vs, MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
    seed, off_bh, dropout_p,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    """One key block of the online softmax: the updated (acc, l_i, m_i)."""
    offs_n = start_n + tile_n
    first_col = tl.cast(start_n, tl.int64)
    k = _load_head_rows(K, off_b, off_hk, start_n, first_col * stride_ks, tile_n[:, None] * stride_ks,
                        offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, EDGE, TMA)  # fmt: skip
    qk = _dot(q, tl.trans(k), None, PRECISION, UPCAST)
    if EDGE or MASK_KIND != 0 or HAS_KPM:
        s = _masked_scores(
            qk, offs_m[:, None], offs_n[None, :], start_m, start_n, off_b, off_h, seq_q, seq_k, qk_scale,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
            MASK_KIND, HAS_KPM, IS_CAUSAL, EDGE,
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
    v = _load_head_rows(V, off_b, off_hk, start_n, first_col * stride_vs, tile_n[:, None] * stride_vs,
                        offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, EDGE, TMA)  # fmt: skip
    p = p.to(v.dtype)
    if HAS_DROPOUT:
        words0, words1, byte = _dropout_words(seed, off_bh, start_m, start_n, seq_k, offs_m.shape[0], BLOCK_N, False,
                                              HAS_DROPOUT)
        p = dropout_mma_apply(p, words0, words1, byte, dropout_threshold_and_scale(dropout_p)[0])
    acc = _dot(p, v, acc * alpha[:, None], PRECISION, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _attention_fwd_kernel(
    Q,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous; with TMA its descriptor
    K,  # (batch, kv_heads, seq_k, head_dim), likewise
    V,  # (batch, kv_heads, seq_k, head_dim), likewise
    O,  # (batch, heads, seq_q, head_dim) output, likewise
    LSE,  # (batch, heads, seq_q) fp32 output, natural log, contiguous
    SEED,  # () int64 dropout seed
    MASK,  # attn_mask broadcast to (batch, heads, seq_q, seq_k) by its strides, uint8 or float
    KPM,  # (batch, seq_k) uint8 key padding mask, nonzero = padding
    # strides of q, k, v, o in units of STRIDE_UNIT elements
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    # Multiplying by the constexpr unit tells Triton each row starts 16 bytes aligned
    # (head_dim % 8 == 0), so rows load as 16-byte vectors even when head_dim % 16 != 0.
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_ob, stride_oh, stride_os = stride_ob * STRIDE_UNIT, stride_oh * STRIDE_UNIT, stride_os * STRIDE_UNIT
    pid_m, off_h, off_b = _tile_ids(num_heads, seq_q, BLOCK_M, IS_CAUSAL)
    off_hk = off_h // group_size
    off_bh = off_b * num_heads + off_h
    # Scalar int64 offsets select the tiles; int32 offsets index inside them, so no
    # 64-bit index tile has to stay live across the loop.
    first_row = pid_m.to(tl.int64) * BLOCK_M
    O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
    if not TMA:
        Q += off_b * stride_qb + off_h * stride_qh + first_row * stride_qs
        K += off_b * stride_kb + off_hk * stride_kh
        V += off_b * stride_vb + off_hk * stride_vh
    qk_scale = sm_scale * _LOG2E

    start_m = pid_m * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_m = start_m + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_head_rows(Q, off_b, off_h, start_m, 0, tile_m[:, None] * stride_qs, offs_m, seq_q, offs_d, HEAD_DIM,
                        BLOCK_M, BLOCK_D, True, TMA)  # fmt: skip
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key blocks below full_hi are inside seq_k and (causal) before every query of the
    # block: no bounds or causal compares. The rest, up to hi, are edge blocks.
    hi = seq_k
    full_hi = seq_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
        full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
    for start_n in range(0, full_hi, BLOCK_N):
        acc, l_i, m_i = _attention_fwd_tile(
            acc, l_i, m_i, q, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_hk, seq_q, seq_k,
            qk_scale,
            stride_ks, stride_vs, MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
            seed, off_bh, dropout_p, MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT,
            False, NEGATIVE_SCALE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST, TMA,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attention_fwd_tile(
            acc, l_i, m_i, q, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_hk, seq_q, seq_k,
            qk_scale,
            stride_ks, stride_vs, MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
            seed, off_bh, dropout_p, MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT,
            True, NEGATIVE_SCALE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST, TMA,
        )

    # l_i >= 1 (the best key adds exp2(0)) or NaN once a row has an allowed key; only a
    # row with none has l_i = 0. NaN scores leave l_i NaN, so o and lse come out NaN.
    has_keys = l_i != 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if HAS_DROPOUT:
        out = out * dropout_threshold_and_scale(dropout_p)[1]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * _LN2, float("inf"))
    _store_rows(O + tile_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty), offs_m, seq_q,
                offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
    tl.store(LSE + off_bh * seq_q + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _attention_bwd_preprocess_kernel(
    O,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    DO,  # (batch, heads, seq_q, head_dim), likewise
    DELTA,  # (batch, heads, seq_q) fp32 output, contiguous
    stride_ob, stride_oh, stride_os,  # in units of STRIDE_UNIT elements, as in the forward
    stride_dob, stride_doh, stride_dos,
    num_heads, seq_q,
    HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    stride_ob, stride_oh, stride_os = stride_ob * STRIDE_UNIT, stride_oh * STRIDE_UNIT, stride_os * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    pid_m, off_h, off_b = _tile_ids(num_heads, seq_q, BLOCK_M, False)
    first_row = pid_m.to(tl.int64) * BLOCK_M
    O += off_b * stride_ob + off_h * stride_oh + first_row * stride_os
    DO += off_b * stride_dob + off_h * stride_doh + first_row * stride_dos
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + tile_m[:, None] * stride_os + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + tile_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (off_b * num_heads + off_h) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _attention_bwd_dkdv_tile(
    dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, start_m, start_n, tile_m, offs_n, offs_d,
    off_b, off_h, off_bh, seq_q, seq_k, qk_scale, stride_qs, stride_dos,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """One query block's share of dK and dV: the updated (dk, dv). With DQ_ATOMIC, also
    this key block's share of the query block's dQ / scale, added into ``dq_head``.

    Tiles are (key, query), so dK and dV accumulate without transposing register tiles.
    Keys past seq_k need no mask: their rows of dk and dv are never stored (for dQ the
    kernel runs a partial key block's tiles as EDGE tiles, which mask them). Queries past
    seq_q load lse = +inf, so their p is 0.
    """
    offs_m = start_m + tile_m
    first_row = tl.cast(start_m, tl.int64)
    q = _load_rows(
        q_head + first_row * stride_qs + tile_m[:, None] * stride_qs + offs_d[None, :], offs_m, seq_q, offs_d,
        HEAD_DIM, BLOCK_D, EDGE,
    )
    do = _load_rows(
        do_head + first_row * stride_dos + tile_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d,
        HEAD_DIM, BLOCK_D, EDGE,
    )
    lse_log2 = _load_row_stat(lse_head + offs_m, offs_m, seq_q, float("inf"), EDGE) * _LOG2E
    delta = _load_row_stat(delta_head + offs_m, offs_m, seq_q, 0.0, EDGE)
    qk_t = _dot(k, tl.trans(q), None, PRECISION, UPCAST)
    if EDGE or MASK_KIND != 0 or HAS_KPM:
        s_t = _masked_scores(
            qk_t, offs_m[None, :], offs_n[:, None], start_m, start_n, off_b, off_h, seq_q, seq_k, qk_scale,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
            MASK_KIND, HAS_KPM, IS_CAUSAL, EDGE,
        )
        p_t = tl.exp2(s_t - lse_log2[None, :])
    else:
        p_t = tl.exp2(qk_t * qk_scale - lse_log2[None, :])
    dp_t = _dot(v, tl.trans(do), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        words0, words1, byte = _dropout_words(seed, off_bh, start_m, start_n, seq_k, tile_m.shape[0], BLOCK_N, True,
                                              HAS_DROPOUT)
        # r applied to dv at the end
        dv = _dot(dropout_mma_apply(p_t.to(do.dtype), words0, words1, byte, threshold), do, dv, PRECISION, UPCAST)
        ds_t = p_t * (dropout_mma_apply(dp_t, words0, words1, byte, threshold) * scale - delta[None, :])
    else:
        dv = _dot(p_t.to(do.dtype), do, dv, PRECISION, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
    ds_t = ds_t.to(q.dtype)
    dk = _dot(ds_t, q, dk, PRECISION, UPCAST)
    if DQ_ATOMIC:
        dq = _dot(tl.trans(ds_t), k, None, PRECISION, UPCAST)
        _atomic_add_rows(
            dq_head + first_row * HEAD_DIM + tile_m[:, None] * HEAD_DIM + offs_d[None, :], dq, offs_m, seq_q, offs_d,
            HEAD_DIM, BLOCK_D, EDGE,
        )
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V,  # as in the forward
    DO,  # (batch, heads, seq_q, head_dim), strided, last dim contiguous
    LSE, DELTA,  # (batch, heads, seq_q) fp32, contiguous
    DK, DV,  # (batch, kv_heads, seq_k, head_dim) outputs, strided, last dim contiguous
    DQ_ACC,  # (batch, heads, seq_q, head_dim) fp32, contiguous, zeroed: dQ / scale (DQ_ATOMIC only)
    SEED, MASK, KPM,  # as in the forward
    # strides of q, k, v, do, dk, dv in units of STRIDE_UNIT elements
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,  # also add each tile's dQ into DQ_ACC (one pass, not deterministic)
):
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    stride_dkb, stride_dkh, stride_dks = stride_dkb * STRIDE_UNIT, stride_dkh * STRIDE_UNIT, stride_dks * STRIDE_UNIT
    stride_dvb, stride_dvh, stride_dvs = stride_dvb * STRIDE_UNIT, stride_dvh * STRIDE_UNIT, stride_dvs * STRIDE_UNIT
    pid_n, off_hk, off_b = _tile_ids(num_heads // group_size, seq_k, BLOCK_N, False)
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
    k = _load_rows(K + tile_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + tile_n[:, None] * stride_vs + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
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
    for g in range(group_size):
        off_h = off_hk * group_size + g
        off_bh = off_b * num_heads + off_h
        q_head = Q + off_b * stride_qb + off_h * stride_qh
        do_head = DO + off_b * stride_dob + off_h * stride_doh
        lse_head = LSE + off_bh * seq_q
        delta_head = DELTA + off_bh * seq_q
        dq_head = DQ_ACC
        if DQ_ATOMIC:
            dq_head += off_bh * seq_q * HEAD_DIM
        for start_m in range(lo, edge_hi, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, start_m, start_n, tile_m, offs_n, offs_d,
                off_b, off_h, off_bh, seq_q, seq_k, qk_scale, stride_qs, stride_dos,
                MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
                MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                DQ_ATOMIC,
            )
        for start_m in range(tl.maximum(lo, edge_hi), full_hi, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, start_m, start_n, tile_m, offs_n, offs_d,
                off_b, off_h, off_bh, seq_q, seq_k, qk_scale, stride_qs, stride_dos,
                MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
                MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT, False, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                DQ_ATOMIC,
            )
        for start_m in range(tl.maximum(tl.maximum(lo, edge_hi), full_hi), seq_q, BLOCK_M):
            dk, dv = _attention_bwd_dkdv_tile(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head, dq_head, start_m, start_n, tile_m, offs_n, offs_d,
                off_b, off_h, off_bh, seq_q, seq_k, qk_scale, stride_qs, stride_dos,
                MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
                MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
                DQ_ATOMIC,
            )

    _store_rows(DK + tile_n[:, None] * stride_dks + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
    if HAS_DROPOUT:
        dv = dv * dropout_threshold_and_scale(dropout_p)[1]
    _store_rows(DV + tile_n[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
                offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip


@triton.jit
def _attention_bwd_dq_tile(
    dq, q, do, lse_log2, delta, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_bh,
    seq_q, seq_k, qk_scale, stride_ks, stride_vs,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EDGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key block's share of dQ: the updated dq."""
    offs_n = start_n + tile_n
    first_col = tl.cast(start_n, tl.int64)
    k = _load_rows(
        K + first_col * stride_ks + tile_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_k, offs_d,
        HEAD_DIM, BLOCK_D, EDGE,
    )
    v = _load_rows(
        V + first_col * stride_vs + tile_n[:, None] * stride_vs + offs_d[None, :], offs_n, seq_k, offs_d,
        HEAD_DIM, BLOCK_D, EDGE,
    )
    qk = _dot(q, tl.trans(k), None, PRECISION, UPCAST)
    if EDGE or MASK_KIND != 0 or HAS_KPM:
        s = _masked_scores(
            qk, offs_m[:, None], offs_n[None, :], start_m, start_n, off_b, off_h, seq_q, seq_k, qk_scale,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn,
            MASK_KIND, HAS_KPM, IS_CAUSAL, EDGE,
        )
        p = tl.exp2(s - lse_log2[:, None])
    else:
        p = tl.exp2(qk * qk_scale - lse_log2[:, None])
    dp = _dot(do, tl.trans(v), None, PRECISION, UPCAST)
    if HAS_DROPOUT:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        words0, words1, byte = _dropout_words(seed, off_bh, start_m, start_n, seq_k, offs_m.shape[0], BLOCK_N, False,
                                              HAS_DROPOUT)
        ds = p * (dropout_mma_apply(dp, words0, words1, byte, threshold) * scale - delta[:, None])
    else:
        ds = p * (dp - delta[:, None])
    return _dot(ds.to(k.dtype), k, dq, PRECISION, UPCAST)


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA,  # as in the dK/dV kernel
    DQ,  # (batch, heads, seq_q, head_dim) output, strided, last dim contiguous
    SEED, MASK, KPM,  # as in the forward
    # strides of q, k, v, do, dq in units of STRIDE_UNIT elements
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    num_heads, group_size, seq_q, seq_k, sm_scale, dropout_p,
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    stride_qb, stride_qh, stride_qs = stride_qb * STRIDE_UNIT, stride_qh * STRIDE_UNIT, stride_qs * STRIDE_UNIT
    stride_kb, stride_kh, stride_ks = stride_kb * STRIDE_UNIT, stride_kh * STRIDE_UNIT, stride_ks * STRIDE_UNIT
    stride_vb, stride_vh, stride_vs = stride_vb * STRIDE_UNIT, stride_vh * STRIDE_UNIT, stride_vs * STRIDE_UNIT
    stride_dob, stride_doh, stride_dos = stride_dob * STRIDE_UNIT, stride_doh * STRIDE_UNIT, stride_dos * STRIDE_UNIT
    stride_dqb, stride_dqh, stride_dqs = stride_dqb * STRIDE_UNIT, stride_dqh * STRIDE_UNIT, stride_dqs * STRIDE_UNIT
    pid_m, off_h, off_b = _tile_ids(num_heads, seq_q, BLOCK_M, IS_CAUSAL)
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
    q = _load_rows(Q + tile_m[:, None] * stride_qs + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + tile_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    lse_log2 = _load_row_stat(LSE + off_bh * seq_q + offs_m, offs_m, seq_q, float("inf"), True) * _LOG2E
    delta = _load_row_stat(DELTA + off_bh * seq_q + offs_m, offs_m, seq_q, 0.0, True)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # As in the forward: key blocks below full_hi need no compares.
    hi = seq_k
    full_hi = seq_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
        full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
    for start_n in range(0, full_hi, BLOCK_N):
        dq = _attention_bwd_dq_tile(
            dq, q, do, lse_log2, delta, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_bh,
            seq_q, seq_k, qk_scale, stride_ks, stride_vs,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
            MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT, False, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _attention_bwd_dq_tile(
            dq, q, do, lse_log2, delta, K, V, start_m, start_n, offs_m, tile_n, offs_d, off_b, off_h, off_bh,
            seq_q, seq_k, qk_scale, stride_ks, stride_vs,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, KPM, stride_kpb, stride_kpn, seed, dropout_p,
            MASK_KIND, HAS_KPM, IS_CAUSAL, HAS_DROPOUT, True, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, UPCAST,
        )

    _store_rows(DQ + tile_m[:, None] * stride_dqs + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip


# (largest BLOCK_D, plain config, masked config, dropout config) per kernel for 16-bit
# inputs, a config being (BLOCK_M, BLOCK_N, num_warps, num_stages); "masked" launches
# (attn_mask or key_padding_mask, with or without dropout) hold more per-element state;
# "dropout" launches (dropout alone) make their keep bits in the score tile's registers
# and need only a little more than plain ones. Picked by compiling the runtime
# specialisations for sm_90: wgmma for every dot, at least two pipeline stages, shared
# memory within 227 KB, no register spills where some config avoids them (with dropout,
# the plain dK/dV config at d64 spills 4-44 B in some specialisation, and so do 128 x 128
# dQ tiles at d64 and d128). The d128 dropout dK/dV takes 2 stages: with 3, ptxas
# serializes its wgmmas (warning C7515), 25 more loop instructions than its 2-stage
# build; GQA with dropout spills there either way (20-196 B; 44-180 B with 3 stages).
# BLOCK_M indexes queries and BLOCK_N keys in every kernel.
_TENSOR_CORE_CONFIGS = {
    "fwd": (
        (64, (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)),
        (128, (128, 128, 8, 3), (64, 16, 4, 2), (128, 128, 8, 3)),
        (256, (128, 32, 8, 3), (128, 16, 8, 2), (128, 32, 8, 3)),
    ),
    # dK/dV dots have BLOCK_N rows: wgmma needs at least 64 per warpgroup. At head dim 256
    # that holds dk, dv (128 registers a thread on 8 warps) and k, v in registers and
    # spills (16-64 x 64 tiles: 32-1344 B, docs/compile-report.md); 32 rows on mma.sync do
    # not (16 query rows with masks, whose tiles need more).
    "dkdv": (
        (64, (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2)),
        (128, (32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 2)),
        (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
    ),
    # dK/dV with dQ's atomics (deterministic=False): the dkdv tiles plus a transient
    # BLOCK_M x BLOCK_D fp32 dQ tile.
    "dkdv_dq": (
        (64, (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2)),
        (128, (32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 2)),
        (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
    ),
    "dq": (
        (64, (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 2)),
        (128, (128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)),
        (256, (128, 32, 8, 2), (128, 16, 8, 2), (128, 32, 8, 2)),
    ),
}
_CONFIG_KINDS = ("plain", "masked", "dropout")
# Plain GQA launches of the dK/dV kernels ("grouped"): the loop over the group's query
# heads around the query blocks keeps more live, and the plain configs spilled there
# (44 / 68 B at d64 / d128 on sm_90); the same tiles with fewer query rows do not.
_GROUPED_CONFIGS = {
    "dkdv": ((64, (32, 128, 8, 2)), (128, (16, 128, 8, 2)), (256, (32, 32, 8, 2))),
    "dkdv_dq": ((64, (16, 128, 8, 2)), (128, (16, 128, 8, 2)), (256, (32, 32, 8, 2))),
}
# fp32 dots run in exact ("ieee") precision on CUDA cores, whose operands live in
# registers: small tiles at every head dim, as (largest BLOCK_D, config) rows.
_FP32_CONFIGS = ((256, (32, 32, 8, 1)),)
# CUDA's limit on grid axis 0
_MAX_PROGRAMS = 2**31 - 1


# ---- sm_80 (A100: compute capability 8.x, mma.sync) -------------------------------------
# The same table for Ampere, picked by compiling the runtime specialisations for sm_80
# (bench.compile_report --arch sm80, the worst of each kind: causal; causal with dropout;
# causal, dropout, bool mask and key padding; varlen): shared memory within 163 KB (the
# sm_90 configs' d256 dQ needs 168 KB there and would not launch), no register spills in
# 16-bit launches (mma.sync keeps its accumulators in registers, so the sm_90 tiles spill
# 4-384 B), at least two pipeline stages.
_SM80_TENSOR_CORE_CONFIGS = {
    "fwd": (
        (64, (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3)),
        # dropout at d72-128: 64 x 64 on 4 warps spilled 8 B (fp16 causal, GQA causal) once
        # lane-independent words (philox.dropout_mma_words) were built; 128 x 32 on 8 warps
        # does not and issues 18% fewer instructions per tile (19264 -> 15584 at d128)
        (128, (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
        (256, (64, 32, 4, 3), (64, 32, 8, 2), (64, 32, 8, 3)),
    ),
    "dkdv": (
        (64, (32, 128, 8, 2), (16, 128, 8, 2), (16, 128, 8, 2)),
        (128, (32, 64, 8, 2), (32, 64, 8, 2), (32, 64, 8, 2)),
        (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
    ),
    # dK/dV with dQ's atomics (deterministic=False): 16 query rows hold the transient fp32
    # dQ tile without spills (32 spill 44-48 B with GQA at d64 / d128).
    "dkdv_dq": (
        (64, (16, 128, 8, 2), (16, 128, 8, 2), (16, 128, 8, 2)),
        (128, (16, 64, 8, 2), (16, 64, 8, 2), (16, 64, 8, 2)),
        (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
    ),
    "dq": (
        (64, (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 2)),
        (128, (128, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)),
        (256, (64, 32, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2)),
    ),
}


# ---- 99 KB of shared memory per block (compute capability 8.6 / 8.9: RTX 30xx / 40xx, A10, L4)
# sm_80's table where it fits, picked by compiling for sm_86 (bench.compile_report --arch
# sm86) as above. sm_80's d256 forward and dQ without masks need 100 KB (> 101376 B): 32
# query rows on 4 warps take 82 / 66 KB without spills (64 x 32 on 4 warps with 2 stages
# spills 68-180 B), and its dQ issues fewer instructions per tile there too. ptxas for
# sm_86 spills 4-24 B where sm_80 does not in the d64 dQ with dropout (128 x 16). (Its
# d72-d128 forward with dropout took 128 x 32 first; sm_80 now takes it too.)
# fp32 at d256 needs 128-132 KB for its backward on 32 x 32 tiles: 16 x 16 take 65 KB.
_SMALL_SHARED_TENSOR_CORE_CONFIGS = {
    **_SM80_TENSOR_CORE_CONFIGS,
    "fwd": (
        (64, (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3)),
        (128, (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
        (256, (32, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 3)),
    ),
    "dq": (
        (64, (128, 64, 8, 2), (128, 32, 8, 2), (128, 16, 8, 2)),
        (128, (128, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)),
        (256, (32, 32, 4, 2), (64, 16, 8, 2), (32, 32, 4, 2)),
    ),
}
_SMALL_SHARED_FP32_CONFIGS = ((128, (32, 32, 8, 1)), (256, (16, 16, 4, 1)))
# opt-in shared memory per block of sm_90 and sm_80
_SM90_SHARED_BYTES = 227 * 1024
_SM80_SHARED_BYTES = 163 * 1024


def _device_arch(t: torch.Tensor) -> int:
    """Compute capability of ``t``'s device as major * 10 + minor (80 = sm_80): 90 for CPU
    tensors and interpreted launches, which keep the sm_90 table."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return 90
    major, minor = torch.cuda.get_device_capability(t.device)
    return major * 10 + minor


def _device_shared_bytes(t: torch.Tensor) -> int:
    """Shared memory a block of ``t``'s device may opt in to, in bytes: sm_90's 227 KB for
    CPU tensors and interpreted launches, like ``_device_arch``."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return _SM90_SHARED_BYTES
    return torch.cuda.get_device_properties(t.device).shared_memory_per_block_optin


def _tensor_core_configs(arch: int, shared_bytes: int = _SM90_SHARED_BYTES) -> dict:
    """The block-config table for compute capability ``arch`` with ``shared_bytes`` of shared
    memory per block: the 99 KB one below sm_80's 163 KB (8.6, 8.9), else sm_80's for 8.x and
    sm_90's for the rest."""
    if shared_bytes < _SM80_SHARED_BYTES:
        return _SMALL_SHARED_TENSOR_CORE_CONFIGS
    return _SM80_TENSOR_CORE_CONFIGS if arch // 10 == 8 else _TENSOR_CORE_CONFIGS


def _block_config(
    head_dim: int, dtype: torch.dtype, kernel: str, kind: str, arch: int = 90, shared_bytes: int = _SM90_SHARED_BYTES
) -> dict:
    """Launch options (BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of ``kernel``,
    one of "fwd", "dkdv", "dkdv_dq", "dq"; ``kind``: one of ``_CONFIG_KINDS`` (see ``_config_kind``),
    or "grouped" for the dK/dV kernels' plain GQA launches; ``arch`` and ``shared_bytes``:
    the device's compute capability and shared memory per block (``_device_arch``,
    ``_device_shared_bytes``), which pick the table.

    BLOCK_D is the head dim padded to a power of two >= 16, as ``tl.dot`` and ``tl.arange``
    need; the padding lanes load as zeros.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    table = _tensor_core_configs(arch, shared_bytes)
    if dtype == torch.float32:
        fp32_configs = _SMALL_SHARED_FP32_CONFIGS if shared_bytes < _SM80_SHARED_BYTES else _FP32_CONFIGS
        _, (block_m, block_n, num_warps, num_stages) = next(row for row in fp32_configs if block_d <= row[0])
    elif kind == "grouped" and table is _TENSOR_CORE_CONFIGS:
        _, (block_m, block_n, num_warps, num_stages) = next(
            row for row in _GROUPED_CONFIGS[kernel] if block_d <= row[0]
        )
    else:
        _, *configs = next(row for row in table[kernel] if block_d <= row[0])
        # mma.sync's plain dK/dV tiles do not spill with GQA: its tables have no "grouped" configs
        block_m, block_n, num_warps, num_stages = configs[_CONFIG_KINDS.index("plain" if kind == "grouped" else kind)]
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages
    )


def _grouped_dropout_tiles(config: dict, arch: int) -> dict:
    """BLOCK_M / BLOCK_N of the dK/dV kernels' GQA launches with dropout at head dims over 64,
    from ``config``, their dropout kind's. By the compile report (bf16, seq 512, 32 / 8
    heads): sm_90 d128 spilled 20 B (causal 192 B) and 16 query rows do not (16064 warp-
    instructions per 128² tile instead of 12352); sm_80 d128 causal 140 B and 16 x 64 tiles
    8 B (sm_86: 32 B and none). At d64 no tried tile removes sm_80's causal 8 B (sm_86: 20 B)."""
    if config["BLOCK_D"] < 128:
        return {}
    if arch // 10 == 9:
        return dict(BLOCK_M=16)
    return dict(BLOCK_M=16, BLOCK_N=min(config["BLOCK_N"], 64))


def _grid(num_blocks: int, heads: int, batch: int) -> tuple[int]:
    """The 1-d grid of ``_tile_ids``: one program per block of every (batch, head)."""
    programs = num_blocks * heads * batch
    if programs > _MAX_PROGRAMS:
        raise ValueError(
            f"attention needs {programs} programs ({batch} batch x {heads} heads x {num_blocks} blocks), "
            f"more than CUDA's {_MAX_PROGRAMS}; split the batch"
        )
    return (programs,)


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
    # The kernels address a mask tile with int32 offsets from its first element.
    max_block = 128
    extent = (min(seq_q, max_block) - 1) * abs(mask_strides[2]) + (min(seq_k, max_block) - 1) * abs(mask_strides[3])
    if max(extent, (min(seq_k, max_block) - 1) * abs(kpm_strides[1])) >= 2**31:
        raise ValueError(
            f"attn_mask / key_padding_mask strides {tuple(mask_strides)} / {tuple(kpm_strides)} are too large "
            f"for the kernels' int32 offsets within a {max_block}x{max_block} tile"
        )
    flags = dict(MASK_KIND=mask_kind, HAS_KPM=kpm is not None)
    return [mask, kpm], [*mask_strides, *kpm_strides], flags


def _config_kind(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, dropout_p: float) -> str:
    """Which of ``_CONFIG_KINDS`` a launch takes: "masked" with any mask, else "dropout" with
    dropout, else "plain"."""
    if attn_mask is not None or key_padding_mask is not None:
        return "masked"
    return "dropout" if dropout_p > 0.0 else "plain"


def _kernel_flags(q: torch.Tensor, is_causal: bool, dropout_p: float) -> dict:
    """HAS_DROPOUT: 0 without dropout, 1 with, 2 with where the fused kernels' lane pairs
    share out Philox calls (``philox.dropout_mma_words``): in wgmma accumulators (sm_90's
    16-bit dots), the layouts that ``tests/kernels/test_philox_layout.py`` proves the lane
    swap right in (on sm_80 Triton computes it in another)."""
    dropout = dropout_p > 0.0
    lane_pairs = dropout and q.dtype != torch.float32 and _device_arch(q) // 10 == 9
    return dict(
        IS_CAUSAL=is_causal,
        HAS_DROPOUT=2 if lane_pairs else int(dropout),
        HEAD_DIM=q.shape[-1],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )


def _stride_unit(*tensors: torch.Tensor) -> int:
    """The largest of 8, 4, 2, 1 elements dividing every stride but head_dim's ((batch,
    heads, seq), or varlen's (token, head)): the kernels take strides in these units, so
    Triton sees 16-byte aligned rows whenever head_dim % 8 == 0 (it only knows on its own
    that an int is a multiple of 16)."""
    strides = [stride for tensor in tensors for stride in tensor.stride()[:-1]]
    return next(unit for unit in (8, 4, 2, 1) if all(stride % unit == 0 for stride in strides))


def _tma_supported(x: torch.Tensor) -> bool:
    """Whether ``x``'s device has the Tensor Memory Accelerator (sm_90 and later)."""
    return x.is_cuda and _device_arch(x) >= 90


def _tma_descriptors(tensors, rows: tuple[int, ...], block_d: int) -> list[TensorDescriptor] | None:
    """Host-side TMA descriptors of (batch, heads, seq, head_dim) tensors, each loading
    (1, 1, rows, block_d) boxes, or None where the kernels must use pointers: no TMA on
    the device, fp32 (its small tiles run on CUDA cores), or a base or a stride the copy
    engine cannot take (it needs both 16-byte aligned; broadcast dims, stride 0, are left
    to pointers too)."""
    if not all(_tma_supported(x) and x.dtype != torch.float32 for x in tensors):
        return None
    if any(x.data_ptr() % 16 or any(s <= 0 or s * x.element_size() % 16 for s in x.stride()[:-1]) for x in tensors):
        return None
    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, n, block_d]) for x, n in zip(tensors, rows)]


def _head_strides(unit: int, *tensors: torch.Tensor) -> list[int]:
    """(batch, heads, seq) strides of each (batch, heads, seq, head_dim) tensor in units
    of ``unit`` elements, flattened."""
    return [stride // unit for tensor in tensors for stride in tensor.stride()[:3]]


def _empty_output(q: torch.Tensor) -> torch.Tensor:
    """An output shaped like q, (batch, heads, seq_q, head_dim), stored as (batch, seq_q,
    heads, head_dim) so that ``rearrange(out, "b h s d -> b s (h d)")`` is a view."""
    batch, heads, seq_q, head_dim = q.shape
    return torch.empty(batch, seq_q, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)


def _attention_fwd_empty(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of an empty problem: zeros, and +inf as for rows with no allowed key."""
    lse = torch.full(q.shape[:3], math.inf, dtype=_reference_dtype(q), device=q.device)
    return _empty_output(q).zero_(), lse


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
    if q.numel() == 0 or k.numel() == 0:
        return _attention_fwd_empty(q)
    out = _empty_output(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    masks, mask_strides, mask_flags = _mask_args(attn_mask, key_padding_mask, q, seq_k)
    kind = _config_kind(attn_mask, key_padding_mask, dropout_p)
    config = _block_config(head_dim, q.dtype, "fwd", kind, _device_arch(q), _device_shared_bytes(q))
    unit = _stride_unit(q, k, v, out)
    # Masked launches run small tiles (16 keys at d128), where TMA's barrier wait per tile
    # costs more than the cp.async addresses it saves (+5-14% warp-instructions per tile
    # in the sm_90 compile report): they keep the pointer loads.
    inputs = None
    if kind != "masked":
        rows = (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_N"])
        inputs = _tma_descriptors((q, k, v), rows, config["BLOCK_D"])
    _attention_fwd_kernel[_grid(triton.cdiv(seq_q, config["BLOCK_M"]), heads, batch)](
        *(inputs or (q, k, v)), out, lse, seed, *masks, *_head_strides(unit, q, k, v, out), *mask_strides,
        heads, heads // kv_heads, seq_q, seq_k, scale, dropout_p,
        **mask_flags, **_kernel_flags(q, is_causal, dropout_p), NEGATIVE_SCALE=scale < 0, STRIDE_UNIT=unit,
        TMA=inputs is not None, **config,
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
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Launch the backward kernels (delta, then dK/dV and dQ), writing into dq, dk, dv.

    Every (batch, heads, seq, head_dim) tensor may be strided with a contiguous last dim.
    ``deterministic=False`` computes dQ in the dK/dV kernel with fp32 atomics (5 GEMMs per
    tile pair rather than 7; the order of the additions, so dQ's rounding, varies by run).
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    delta = torch.empty_like(lse)
    kind = _config_kind(attn_mask, key_padding_mask, dropout_p)
    dq_config = _block_config(head_dim, q.dtype, "dq", kind, _device_arch(q), _device_shared_bytes(q))
    q_blocks = triton.cdiv(seq_q, dq_config["BLOCK_M"])
    unit = _stride_unit(q, k, v, out, grad_out, dq, dk, dv)
    _attention_bwd_preprocess_kernel[_grid(q_blocks, heads, batch)](
        out, grad_out, delta, *_head_strides(unit, out, grad_out), heads, seq_q,
        HEAD_DIM=head_dim, STRIDE_UNIT=unit, BLOCK_M=dq_config["BLOCK_M"], BLOCK_D=dq_config["BLOCK_D"],
        num_warps=dq_config["num_warps"],
    )
    masks, mask_strides, mask_flags = _mask_args(attn_mask, key_padding_mask, q, seq_k)
    scalars = (*mask_strides, heads, heads // kv_heads, seq_q, seq_k, scale, dropout_p)
    flags = dict(**mask_flags, **_kernel_flags(q, is_causal, dropout_p), STRIDE_UNIT=unit)
    # The atomic path adds dQ / scale into a zeroed fp32 buffer, in whatever order the
    # key blocks' programs reach it, then scales and casts it in one pass.
    dq_acc = None if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkdv_kind = "grouped" if kind == "plain" and heads != kv_heads else kind
    dkdv_config = _block_config(
        head_dim, q.dtype, "dkdv" if deterministic else "dkdv_dq", dkdv_kind, _device_arch(q), _device_shared_bytes(q)
    )
    # GQA's loop over the group's heads holds more: lane pairs sharing out Philox calls
    # (same bits) made its dK/dV tiles spill (d64 causal: 36 B, none without them)
    dkdv_flags = dict(flags, HAS_DROPOUT=min(flags["HAS_DROPOUT"], 1)) if heads != kv_heads else flags
    if heads != kv_heads and kind == "dropout":
        # and even so, dropout's words made the dropout tiles spill: fewer rows
        dkdv_config.update(_grouped_dropout_tiles(dkdv_config, _device_arch(q)))
    _attention_bwd_dkdv_kernel[_grid(triton.cdiv(seq_k, dkdv_config["BLOCK_N"]), kv_heads, batch)](
        q, k, v, grad_out, lse, delta, dk, dv, dq_acc, seed, *masks,
        *_head_strides(unit, q, k, v, grad_out, dk, dv), *scalars, **dkdv_flags, **dkdv_config,
        DQ_ATOMIC=not deterministic,
    )
    if not deterministic:
        torch.mul(dq_acc, scale, out=dq)
        return
    _attention_bwd_dq_kernel[_grid(q_blocks, heads, batch)](
        q, k, v, grad_out, lse, delta, dq, seed, *masks,
        *_head_strides(unit, q, k, v, grad_out, dq), *scalars, **flags, **dq_config,
    )


def _reference_dtype(q: torch.Tensor) -> torch.dtype:
    """The references' compute dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(q.dtype, torch.float32)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, heads per kv head, ...)."""
    return rearrange(x, "b (k g) ... -> b k g ...", k=kv_heads)


def _reference_query_blocks(batch: int, heads: int, seq_q: int, seq_k: int) -> list[tuple[int, int]]:
    """(start, stop) of the reference's blocks of query rows, every head at once: the
    reference walks over them as the kernels walk over tiles, so no (batch, heads, seq_q,
    seq_k) score, probability, dropout-mask or dS tensor is ever alive."""
    return reference_row_blocks(seq_q, batch * heads * seq_k)


def _reference_grouped_rows(x: torch.Tensor, kv_heads: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a (batch, heads, seq, head_dim) tensor as one contiguous fp32 (fp64
    for fp64 inputs) (batch · kv_heads, heads per kv head · rows, head_dim) stack of matrices: the query
    heads sharing a kv head are stacked, so one bmm serves the whole group (GQA)."""
    block = _grouped(x[:, :, start:stop], kv_heads)
    rows = torch.empty(block.shape, dtype=_reference_dtype(x), device=x.device).copy_(block)
    return rows.view(-1, rows.shape[2] * rows.shape[3], rows.shape[4])


def _no_allowed_key(best: torch.Tensor) -> torch.Tensor:
    """Rows with no allowed key, from their best masked score (a NaN row is not one: it propagates)."""
    return best == -math.inf


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
    """Scores (fp32, fp64 for fp64 inputs) of query rows start:stop against the keys ``k``, −inf where a key is
    not allowed: (batch · kv_heads, heads per kv head · rows, keys).

    ``q_rows`` and ``k`` are as ``_reference_grouped_rows`` gives them; ``k`` may hold only the
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
        else:  # a NaN in the mask is not <= MASKED_BIAS: it propagates, as in SDPA
            scores.add_(mask.to(scores.dtype).masked_fill(mask <= MASKED_BIAS, -math.inf))
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
    0:n_keys, as a bool (batch · heads, rows, n_keys) tensor: stream b·heads + h of
    ``philox.py``'s attention scheme, whose matrices are (seq_q, seq_k)."""
    return dropout_keep_mma_block(seed, batch_heads, start, stop, n_keys, seq_k, p)


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
    """What ``_attention_fwd`` computes, in fp32 PyTorch (fp64 for fp64 inputs), over
    blocks of query rows: (out in q's dtype and the kernel's layout, lse)."""
    if q.numel() == 0 or k.numel() == 0:
        return _attention_fwd_empty(q)
    out = _empty_output(q)
    lse = torch.empty(q.shape[:3], dtype=_reference_dtype(q), device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # fp32 bmm even when called under autocast
        _attention_fwd_blocks(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, out, lse)
    return out, lse


def _attention_fwd_blocks(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, out, lse):
    """The body of ``_attention_fwd_reference``: writes out and lse block by block."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    k_all, v_all = _reference_grouped_rows(k, kv_heads, 0, seq_k), _reference_grouped_rows(v, kv_heads, 0, seq_k)
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _reference_grouped_rows(q, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows, k_all[:, :n_keys], start, stop, heads, attn_mask, key_padding_mask, is_causal, scale
        )
        best = p.amax(-1, keepdim=True)
        no_key = _no_allowed_key(best)
        p.sub_(best.masked_fill(no_key, 0.0)).exp_()
        total = p.sum(-1, keepdim=True)
        row_scale = total.reciprocal().masked_fill_(no_key, 0.0)
        if seed is not None:
            keep = _dropout_keep_block(seed, batch * heads, seq_q, seq_k, start, stop, n_keys, dropout_p)
            p.mul_(keep.reshape(p.shape))
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
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """What ``_attention_bwd`` computes, in fp32 PyTorch over blocks of query rows (dK and
    dV accumulate over the blocks), written into dq, dk, dv. ``out`` is not read: each
    block holds whole rows of P and dP, from which it takes delta. Always deterministic:
    ``deterministic`` only chooses the kernels' dQ pass."""
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
    k_all, v_all = _reference_grouped_rows(k, kv_heads, 0, seq_k), _reference_grouped_rows(v, kv_heads, 0, seq_k)
    dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _reference_grouped_rows(q, kv_heads, start, stop)
        do_rows = _reference_grouped_rows(grad_out, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows, k_all[:, :n_keys], start, stop, heads, attn_mask, key_padding_mask, is_causal, scale
        )
        p.sub_(lse[:, :, start:stop].reshape(*q_rows.shape[:2], 1)).exp_()
        if seed is None:
            dv_all[:, :n_keys].baddbmm_(p.mT, do_rows)
            dp = torch.bmm(do_rows, v_all[:, :n_keys].mT)
        else:
            keep = _dropout_keep_block(seed, batch * heads, seq_q, seq_k, start, stop, n_keys, dropout_p)
            keep = keep.reshape(p.shape)
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


def _runs_kernels(q: torch.Tensor) -> bool:
    # fp64 (gradcheck) always takes the PyTorch reference, in fp64.
    return use_triton(q) and q.dtype != torch.float64


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch, head and sequence strides (head views of a fused
    # projection need no copy) but load rows of head_dim contiguous elements.
    return x if x.stride(-1) == 1 else x.contiguous()


def _split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, seq, 3 · embed) projection -> q, k, v (batch, heads, seq, head_dim) views."""
    return rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=num_heads).unbind(0)


# The differentiable ops: forward and backward ``torch.library`` ops joined by
# ``register_autograd``, so that torch.compile keeps exactly what the docstrings list and
# cannot re-plan what is saved. The dropout seed is an input (drawn by the caller).


def _attention_forward(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed):
    fwd = _attention_fwd if _runs_kernels(q) else _attention_fwd_reference
    return fwd(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)


def _attention_backward(grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale,
                        deterministic, dq, dk, dv):  # fmt: skip
    bwd = _attention_bwd if _runs_kernels(q) else _attention_bwd_reference
    bwd(grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale, deterministic,
        dq, dk, dv)  # fmt: skip


def _fake_out_and_lse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_output(q), q.new_empty(q.shape[:3], dtype=_reference_dtype(q))


@torch.library.custom_op("slimformer::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of (batch, heads, seq, head_dim) q, k, v with a contiguous last dim;
    ``deterministic`` is the backward's (see ``_attention_bwd``)."""
    return _attention_forward(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)


@_attention_op.register_fake
def _(q, k, v, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, deterministic):
    return _fake_out_and_lse(q)


@torch.library.custom_op("slimformer::attention_backward", mutates_args=())
def _attention_backward_op(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each shaped and strided like q, k, v (``empty_like``)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _attention_backward(
        _last_dim_contiguous(grad_out), q, k, v, out, lse, seed, attn_mask, key_padding_mask,
        dropout_p, is_causal, scale, deterministic, dq, dk, dv,
    )  # fmt: skip
    return dq, dk, dv


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and the dropout seed (plus the caller's masks)."""
    q, k, v, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, attn_mask, key_padding_mask)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.deterministic = dropout_p, is_causal, scale, deterministic


def _attention_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 10
    q, k, v, out, lse, seed, attn_mask, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(
        grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask, ctx.dropout_p, ctx.is_causal, ctx.scale,
        ctx.deterministic,
    )  # fmt: skip
    return dq, dk, dv, *(None,) * 7


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup_context)


@torch.library.custom_op("slimformer::self_attention_recompute_qkv", mutates_args=())
def _self_attention_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dtype: torch.dtype,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): attention of q, k, v = split(x Wᵀ + b) with the projection in ``dtype``
    (autocast's, or x's); out is (batch, heads, seq, head_dim) stored as (batch, seq, heads,
    head_dim). Saves x, the weights, out, lse and the seed; the backward op recomputes the
    projection and writes dq, dk, dv straight into one (batch, seq, 3 · embed) gradient."""
    qkv = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    q, k, v = _split_heads(qkv, num_heads)
    return _attention_forward(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)


@_self_attention_op.register_fake
def _(x, weight, bias, num_heads, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, dtype,
      deterministic):  # fmt: skip
    batch, seq, embed = x.shape
    q = x.new_empty((batch, num_heads, seq, embed // num_heads), dtype=dtype)
    return _fake_out_and_lse(q)


@torch.library.custom_op("slimformer::self_attention_recompute_qkv_backward", mutates_args=())
def _self_attention_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    num_heads: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
    needs_input_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) for grad_out (batch, heads, seq, head_dim); each an empty
    placeholder where ``needs_input_grad`` says it is not needed."""
    # The forward's projection ran in out's dtype (autocast's, if it was on); redo it
    # in that dtype, since autocast is off in backward.
    dtype = out.dtype
    x_, weight_ = x.to(dtype), weight.to(dtype)
    qkv = F.linear(x_, weight_, None if bias is None else bias.to(dtype))
    q, k, v = _split_heads(qkv, num_heads)
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = _split_heads(dqkv, num_heads)
    _attention_backward(
        _last_dim_contiguous(grad_out.to(dtype)), q, k, v, out, lse, seed, attn_mask, key_padding_mask,
        dropout_p, is_causal, scale, deterministic, dq, dk, dv,
    )  # fmt: skip
    needs_x, needs_weight, needs_bias = needs_input_grad
    dx = (dqkv @ weight_).to(x.dtype) if needs_x else absent_output(x.device)
    dweight = (dqkv.flatten(0, 1).mT @ x_.flatten(0, 1)).to(weight.dtype) if needs_weight else absent_output(x.device)
    dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None and needs_bias else absent_output(x.device)
    return dx, dweight, dbias


@_self_attention_backward_op.register_fake
def _(grad_out, x, weight, bias, out, lse, seed, attn_mask, key_padding_mask, num_heads, dropout_p, is_causal,
      scale, deterministic, needs_input_grad):  # fmt: skip
    needs_x, needs_weight, needs_bias = needs_input_grad
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x else absent_output(x.device),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if needs_weight else absent_output(x.device),
        torch.empty_like(bias) if bias is not None and needs_bias else absent_output(x.device),
    )


def _self_attention_setup_context(ctx, inputs, output):
    x, weight, bias, num_heads, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, _, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(x, weight, bias, out, lse, seed, attn_mask, key_padding_mask)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.num_heads, ctx.dropout_p, ctx.is_causal, ctx.scale = num_heads, dropout_p, is_causal, scale
    ctx.deterministic = deterministic


def _self_attention_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 12
    x, weight, bias, out, lse, seed, attn_mask, key_padding_mask = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    dx, dweight, dbias = _self_attention_backward_op(
        grad_out, x, weight, bias, out, lse, seed, attn_mask, key_padding_mask,
        ctx.num_heads, ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.deterministic, needs,
    )  # fmt: skip
    grads = [grad if need else None for grad, need in zip((dx, dweight, dbias), needs)]
    return *grads, *(None,) * 9


_self_attention_op.register_autograd(_self_attention_grad, setup_context=_self_attention_setup_context)


def _check_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
    batch_shape: tuple[int, ...],
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
        target = (*batch_shape, heads, seq_q, seq_k)
        if attn_mask.dim() > len(target) or any(
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
        if key_padding_mask.shape != (*batch_shape, seq_k):
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_k) = {(*batch_shape, seq_k)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


def _check_dropout_p(dropout_p: float, seq_q: int, seq_k: int) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    # a (batch, head)'s Philox counters are 32-bit: one per 16 scores, in 16 x 16 blocks
    if dropout_p > 0.0 and -(-seq_q // 16) * -(-seq_k // 16) * 16 > 2**32:
        raise ValueError(
            f"dropout_p > 0 needs ceil(seq_q / 16) · ceil(seq_k / 16) · 16 <= 2**32, got seq_q={seq_q}, seq_k={seq_k}"
        )


def _check_deterministic(deterministic: bool) -> bool:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    return deterministic


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")


def _causal_bias_as_mask(
    bias: CausalBias, is_causal: bool, seq_q: int, seq_k: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) computing what SDPA computes for a ``CausalBias`` mask.

    Upper-left alignment (and lower-right with seq_q == seq_k) is the kernels' causal
    path; lower-right with seq_q != seq_k lets row i see keys j <= i + seq_k - seq_q,
    which goes in as a (seq_q, seq_k) bool mask (seq_q · seq_k bytes, read block by block).
    """
    if is_causal:
        raise ValueError("is_causal must be False when attn_mask is a CausalBias (the bias already is causal)")
    if (bias.seq_len_q, bias.seq_len_kv) != (seq_q, seq_k):
        raise ValueError(
            f"attn_mask CausalBias must be for (seq_q, seq_k) = {(seq_q, seq_k)}, "
            f"got {(bias.seq_len_q, bias.seq_len_kv)}"
        )
    if bias.variant == CausalVariant.UPPER_LEFT or seq_q == seq_k:
        return None, True
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(seq_k - seq_q), False


def _check_causal_without_mask(attn_mask, is_causal: bool) -> None:
    """SDPA's rule (its math reference raises on every device; the fused CPU and CUDA
    backends let 4-d calls through): is_causal=True takes no explicit attn_mask."""
    if is_causal and attn_mask is not None:
        raise RuntimeError(
            "Explicit attn_mask should not be set when is_causal=True (as in scaled_dot_product_attention): pass "
            "attn_mask=None, or the causal mask folded into attn_mask with is_causal=False; got attn_mask of shape "
            f"{tuple(attn_mask.shape)}"
        )


def _autocast_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as autocast casts an input: floating point to ``dtype``, except float64."""
    return x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x


def _as_batch_heads(x: torch.Tensor) -> torch.Tensor:
    """(..., heads, seq, d) -> (batch, heads, seq, d), the leading dims flattened (a view)."""
    return x.reshape(-1, *x.shape[-3:])


def _mask_as_batch_heads(mask: torch.Tensor | None, batch_shape: tuple[int, ...]) -> torch.Tensor | None:
    """An attn_mask broadcastable to (*batch_shape, heads, seq_q, seq_k), as a 4-d mask."""
    if mask is None or mask.dim() <= 3 or len(batch_shape) == 1:
        return mask
    mask = mask[(None,) * (len(batch_shape) + 3 - mask.dim())]
    # a view, unless the mask's own leading dims are broadcast only in part
    return mask.expand(*batch_shape, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    deterministic: bool = True,
) -> torch.Tensor:
    """Scaled dot-product attention that never materialises the score matrix.

    Same contract and argument names as ``torch.nn.functional.scaled_dot_product_attention``,
    plus ``key_padding_mask``, which combines with ``attn_mask`` or ``is_causal``.

    Args:
        query: (..., heads, seq_q, head_dim) with any number of leading (batch) dims,
            3-d (N, L, E) included; float16, bfloat16 or float32 run the fused kernels,
            float64 (``torch.autograd.gradcheck``) runs the PyTorch reference in float64.
        key, value: (..., kv_heads, seq_k, head_dim), query's leading dims, dtype and
            device. ``kv_heads`` equals ``heads``, or divides it when ``enable_gqa`` (query
            head h reads kv head h // (heads // kv_heads), as in SDPA); k and v are never
            repeated in memory. head_dim is at most 256. Any strides are read in place as
            long as the last dim is contiguous (head views of a fused projection need no copy).
        attn_mask: bool (True = may attend), an additive float mask broadcastable to
            (..., heads, seq_q, seq_k) and read through broadcast strides, never
            expanded, or a ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left``
            / ``causal_lower_right``), honoured as SDPA does. It gets no gradient. An
            additive value <= -2**15 (finfo.min, -1e9) masks its key like -inf.
        dropout_p: attention dropout probability in [0, 1), applied whenever it is > 0 (as
            in SDPA). The mask is drawn from torch's generator, so ``torch.manual_seed``
            reproduces it, and regenerated in backward rather than stored.
        is_causal: row i attends keys j <= i (top-left aligned, as in SDPA); attn_mask
            must then be None (SDPA's rule), ``key_padding_mask`` may be given.
        scale: score scale, default ``1 / sqrt(head_dim)``.
        enable_gqa: allow fewer kv heads than query heads.
        key_padding_mask: bool (..., seq_k) with query's leading dims, True = padding (as
            in ``nn.MultiheadAttention``).
        deterministic: the backward's dQ pass. True (default): a second kernel walks the
            key blocks of each query block, so gradients are bitwise reproducible (7 GEMMs
            per tile pair). False: the dK/dV kernel adds dQ with fp32 atomics (5 GEMMs, a
            transient fp32 dQ buffer); the order of the additions varies from run to run,
            so dQ's last bits may too (as flash-attn's ``deterministic=False``). The forward
            and the PyTorch reference path are deterministic either way.

    Returns:
        (..., heads, seq_q, head_dim) in query's dtype (under autocast q, k and v are
        first cast to the autocast dtype, as for SDPA); for 4-d inputs stored as
        (batch, seq_q, heads, head_dim) so that merging the heads is a view. Rows with
        no allowed key are zero (as SDPA gives), and so is their gradient. NaN and inf
        in the inputs, ``scale`` or the mask propagate as in SDPA.

    Raises:
        TypeError: a non-tensor or nested input, dtypes other than
            float16/bfloat16/float32/float64 or not matching, a mask of the wrong dtype, a
            dropout_p or scale that is not a real number.
        RuntimeError: an attn_mask tensor with is_causal=True, as SDPA raises (its fused
            CPU and CUDA backends accept 4-d calls; its math reference and the
            documentation refuse them).
        ValueError: wrong ranks or shapes (unlike SDPA, value must have key's shape: a
            value head_dim other than query's is not supported), kv heads that do not
            divide the query heads, head_dim outside [1, 256], dropout_p outside [0, 1),
            a mask that does not broadcast or requires grad, tensors on different
            devices, a CausalBias for other sequence lengths or with is_causal=True.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_nested:
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got a nested tensor: pad the sequences and pass "
                "key_padding_mask, or pack them for slimformer.varlen_attention"
            )
        if tensor.dim() < 3:
            raise ValueError(
                f"{name} must be at least 3-d (..., heads, seq, head_dim), got shape {tuple(tensor.shape)}"
            )
    if torch.is_autocast_enabled(query.device.type):
        # as autocast casts SDPA's q, k, v (masks keep their dtype)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (_autocast_cast(t, dtype) for t in (query, key, value))
    if query.dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"query must be float16, bfloat16, float32 or float64, got {query.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {tensor.device}")
    *batch_shape, heads, seq_q, head_dim = query.shape
    batch_shape = tuple(batch_shape)
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != query.dim() or tuple(tensor.shape[:-3]) != batch_shape:
            raise ValueError(
                f"{name} must have query's leading (batch) dims {batch_shape}, got shape {tuple(tensor.shape)}"
            )
        if tensor.shape[-1] != head_dim:
            raise ValueError(f"{name} must have query's head_dim {head_dim}, got shape {tuple(tensor.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    _check_head_dim(head_dim)
    kv_heads, seq_k = key.shape[-3], key.shape[-2]
    if enable_gqa:
        if heads % max(kv_heads, 1) != 0 or (kv_heads == 0) != (heads == 0):
            raise ValueError(
                f"key and value heads must divide query's {heads} heads when enable_gqa=True, got {kv_heads}"
            )
    elif kv_heads != heads:
        raise ValueError(
            f"key and value must have query's {heads} heads (pass enable_gqa=True for fewer), got {kv_heads}"
        )
    _check_dropout_p(dropout_p, seq_q, seq_k)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if isinstance(attn_mask, CausalBias):
        attn_mask, is_causal = _causal_bias_as_mask(attn_mask, is_causal, seq_q, seq_k, query.device)
    _check_masks(attn_mask, key_padding_mask, query.device, batch_shape, heads, seq_q, seq_k)
    _check_causal_without_mask(attn_mask, is_causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if query.dim() != 4:
        attn_mask = _mask_as_batch_heads(attn_mask, batch_shape)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.reshape(-1, seq_k)
        query, key, value = _as_batch_heads(query), _as_batch_heads(key), _as_batch_heads(value)
    query, key, value = _last_dim_contiguous(query), _last_dim_contiguous(key), _last_dim_contiguous(value)
    seed = new_dropout_seed(query.device, query.detach(), "attention") if dropout_p > 0.0 else None
    out, _ = _attention_op(
        query, key, value, attn_mask, key_padding_mask, seed, float(dropout_p), bool(is_causal), scale,
        _check_deterministic(deterministic),
    )  # fmt: skip
    return out.view(*batch_shape, heads, seq_q, head_dim)


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
    deterministic: bool = True,
) -> torch.Tensor:
    """Multi-head self-attention of ``x`` with a fused QKV projection, before the output projection.

    Computes ``attention(q, k, v)`` with q, k, v the heads of ``F.linear(x, qkv_weight,
    qkv_bias)`` and returns it as (batch, seq, embed), a view of the kernel's output.
    With ``recompute_qkv`` (the ``qkv`` recompute policy) backward recomputes the
    projection from ``x``, so only x, the output and the fp32 log-sum-exp (plus the
    dropout seed) stay alive; otherwise the projection (q, k, v) is kept.

    Args:
        x: (batch, seq, embed), float16, bfloat16 or float32 (the fused kernels), or
            float64 (the PyTorch reference in float64, on any device).
        qkv_weight: (3 · embed, embed), the q, k, v rows stacked as in
            ``nn.MultiheadAttention.in_proj_weight``; x's dtype and device.
        qkv_bias: (3 · embed,) or None.
        num_heads: divides embed; embed / num_heads is at most 256.
        attn_mask, dropout_p, is_causal, key_padding_mask, deterministic: as in ``attention``.

    Raises:
        TypeError: x not float16/bfloat16/float32/float64, weights of another dtype
            (outside autocast, or float64), a mask of the wrong dtype.
        ValueError: wrong shapes, num_heads not dividing embed, head_dim > 256,
            dropout_p outside [0, 1), masks that do not fit, tensors on other devices.
        RuntimeError: an attn_mask with is_causal=True (as ``attention``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-d (batch, seq, embed), got shape {tuple(x.shape)}")
    if x.dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    batch, seq, embed = x.shape
    weights = [("qkv_weight", qkv_weight, (3 * embed, embed))]
    if qkv_bias is not None:
        weights.append(("qkv_bias", qkv_bias, (3 * embed,)))
    # autocast casts no float64 tensor: with float64 on either side the dtypes must match
    autocast = torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64
    for name, tensor, shape in weights:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != x.dtype and (not autocast or tensor.dtype == torch.float64):
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {tensor.device}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1 or embed % num_heads != 0:
        raise ValueError(f"num_heads must divide embed {embed}, got {num_heads}")
    _check_head_dim(embed // num_heads)
    _check_dropout_p(dropout_p, seq, seq)
    _check_masks(attn_mask, key_padding_mask, x.device, (batch,), num_heads, seq, seq)
    _check_causal_without_mask(attn_mask, is_causal)
    if not recompute_qkv:
        q, k, v = _split_heads(F.linear(x, qkv_weight, qkv_bias), num_heads)
        out = attention(
            q, k, v, attn_mask, dropout_p, is_causal, key_padding_mask=key_padding_mask, deterministic=deterministic
        )
        return rearrange(out, "b h s d -> b s (h d)")
    scale = 1.0 / math.sqrt(embed // num_heads)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    seed = new_dropout_seed(x.device, x.detach(), "self_attention") if dropout_p > 0.0 else None
    with torch.autocast(x.device.type, enabled=False):
        out, _ = _self_attention_op(
            x, qkv_weight, qkv_bias, num_heads, attn_mask, key_padding_mask, seed,
            float(dropout_p), bool(is_causal), scale, dtype, _check_deterministic(deterministic),
        )  # fmt: skip
    return rearrange(out, "b h s d -> b s (h d)")
