"""DeBERTa's disentangled attention, fused: FlashAttention-2 with two more score terms.

For query i and key j of one (batch, head), ``δ = index[i − j + seq_k − 1]`` the bucketed
relative position (``relative_position_index``: DeBERTa-v2's log buckets, shifted by the
span and clamped to the 2 · span rows of the position projections), pk and pq the head's
position key and position query rows ((2 · span, head_dim)):

    s_ij = scale · (q_i·k_j  +  q_i·pk_δ  +  k_j·pq_δ)        (content→position "c2p",
    p = softmax_j(s),   o_i = Σ_j r z_ij p_ij v_j               position→content "p2c")

The kernels never form a (seq_q, seq_k) tensor. A (BLOCK_M × BLOCK_N) tile sees only the
BLOCK_M + BLOCK_N − 1 distances i − j = start_m − start_n + (m − n); they gather those rows
of pk and pq (G_k, G_q: (R, head_dim), row r at distance start_m − start_n + r − BLOCK_N + 1),
multiply C = Q G_kᵀ (M × R) and Pᵀ = G_q Kᵀ (R × N) and read the tile's terms off their
skewed diagonals, r = m − n + BLOCK_N − 1:

    c2p[m, n] = C[m, r],   p2c[m, n] = Pᵀ[r, n]

Each is one more GEMM of (M + N − 1)/N ≈ 2 times a score tile's work, so a tile costs about
3× plain attention's score GEMM in the forward (one QKᵀ, two position GEMMs, then PV:
about 2.5× the forward's FLOPs) and the backward adds four such GEMMs to plain attention's
five. The forward saves q, k, v, the position rows, o, the fp32 ``lse`` and the dropout seed,
as ``slimformer.attention`` does; the backward rebuilds p tile by tile (dropout mask from the
seed, Philox streams b · heads + h as in ``slimformer.attention``) and with
dS = scale · P ∘ (dP − delta) reads the transposes of the skews off dS:

    dC[m, r] = dS[m, m − r + N − 1],   dPᵀ[r, n] = dS[r + n − N + 1, n]     (0 where outside)
    dQ += dS K + dC G_k,   dK += dSᵀ Q + dPᵀᵀ G_q,
    d pk[δ_r] += (dCᵀ Q)_r,   d pq[δ_r] += (dPᵀ K)_r

in two passes: one program per key block (dK, dV, d pq) and one per query block (dQ, d pk).
The position gradients are added with fp32 atomics into a (batch, heads, seq_q + seq_k − 1,
head_dim) buffer by distance, which the host sums over the batch and into the buckets (their
last bits vary from run to run, as the relative bias's of ``slimformer.attention`` do).

Key padding masks keys (True = padding); a row with no allowed key gets o = 0 and
lse = +inf (no gradient), as in ``slimformer.attention``. The PyTorch reference (the CPU
path) works on one batch entry's heads at a time and in blocks of query rows, so its
largest temporaries are (heads, rows, seq_k) and the keys' p2c table (heads, 2 · span, seq_k).
"""

import functools
import math
import numbers
import warnings

import torch
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels import dispatch
from slimformer.kernels.attention.interface import checked_int
from slimformer.kernels.attention.launch import empty_forward, empty_output, head_strides, reference_dtype
from slimformer.kernels.attention.ops import check_cu_seqlens, last_dim_contiguous, runs_kernels
from slimformer.kernels.attention.reference import as_batch_of_one, sequences
from slimformer.kernels.attention.tiles import (
    LN2,
    LOG2E,
    dot,
    dropout_words,
    load_rows,
    sequence,
    store_rows,
    tile_ids,
)
from slimformer.kernels.dispatch import (
    capturing_graph,
    cdiv,
    direct,
    eager_autograd,
    next_power_of_2,
    reference_row_blocks,
)
from slimformer.kernels.philox import (
    dropout_keep_mma_block,
    dropout_mma_apply,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

__all__ = ["disentangled_attention", "relative_position_index", "varlen_disentangled_attention"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The reference's (heads, 2 · span, seq_k) p2c table per group of heads: at most this many elements.
_REFERENCE_TABLE_ELEMENTS = 2**22


# ----------------------------------------------------------------------------- positions


def relative_position_index(
    seq_q: int, seq_k: int, span: int, position_buckets: int, max_relative_positions: int, device
) -> torch.Tensor:
    """(seq_q + seq_k − 1,) int32: at ``i − j + seq_k − 1``, the row of the (2 · span)-row
    position projections that query i and key j read, ``clamp(bucket(i − j) + span, 0,
    2 · span − 1)``. ``bucket`` is DeBERTa-v2's: the identity when ``position_buckets`` or
    ``max_relative_positions`` is not positive, else exact within ±position_buckets / 2 and
    logarithmic beyond, up to ``max_relative_positions`` (the same float ops in the same order
    as transformers' ``make_log_bucket_position``, so the same buckets bit for bit). The
    bucket is odd in i − j, so c2p (``bucket(i − j)``) and p2c (``−bucket(j − i)``) read one index."""
    distance = torch.arange(-(seq_k - 1), max(seq_q, 1 - seq_k), device=device)
    if position_buckets > 0 and max_relative_positions > 0:
        distance = _log_bucket(distance, position_buckets, max_relative_positions).to(torch.long)
    return (distance + span).clamp_(0, 2 * span - 1).to(torch.int32)


def _shared_index(
    seq_q: int, seq_k: int, span: int, position_buckets: int, max_relative_positions: int, device
) -> torch.Tensor:
    """``relative_position_index``, made once per arguments and shared by every call (every
    layer of a model): read-only. A DeBERTa layer's index costs about 20 small ops, each a
    launch on a GPU. Under torch.compile it is made in the graph."""
    device = torch.device(device)
    if torch.compiler.is_compiling() or capturing_graph(device) or torch._guards.detect_fake_mode() is not None:
        # a graph's or a fake tensor mode's own tensor: never one to share with later calls
        return relative_position_index(seq_q, seq_k, span, position_buckets, max_relative_positions, device)
    return _cached_index(seq_q, seq_k, span, position_buckets, max_relative_positions, device)


@functools.lru_cache(maxsize=64)
def _cached_index(seq_q, seq_k, span, position_buckets, max_relative_positions, device) -> torch.Tensor:
    with torch.inference_mode(False):  # an inference tensor could not be saved for a later backward
        index = relative_position_index(seq_q, seq_k, span, position_buckets, max_relative_positions, device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # once: later calls may run on other streams
    return index


def _log_bucket(distance: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    mid = buckets // 2
    near = (distance < mid) & (distance > -mid)
    magnitude = torch.where(near, mid - 1, distance.abs())  # a scalar: no copy to the device, no host sync
    ratio = torch.log(magnitude / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
    log_position = torch.ceil(ratio) + mid
    return torch.where(magnitude <= mid, distance.type_as(log_position), log_position * distance.sign())


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _position_rows(
    P,  # (2 · span, head_dim) one head's position rows, last dim contiguous
    stride_pp,
    IDX,  # (n_index,) int32 row of each distance (relative_position_index)
    first,  # index of the tile's row 0: start_m − start_n − (BLOCK_N − 1) + seq_k − 1
    n_index,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """(BLOCK_R, BLOCK_D) rows of P at the tile's distances, zero outside the index."""
    at = first + offs_r
    inside = (at >= 0) & (at < n_index)
    row = tl.load(IDX + at, mask=inside, other=0)
    return tl.load(
        P + row[:, None] * stride_pp + offs_d[None, :],
        mask=inside[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )


@triton.jit
def _uniform_rows(QPM_b, offs_m, seq_q, HAS_QPM: tl.constexpr):
    """[BLOCK_M] bool: the rows of this batch entry's query padding mask (none without one)."""
    if HAS_QPM:
        rows = tl.load(QPM_b + offs_m, mask=offs_m < seq_q, other=0) != 0
    else:
        rows = offs_m < 0
    return rows


@triton.jit
def _tile_scores(
    q,
    k,
    gk,
    gq,
    offs_n,
    seq_k,
    qk_scale,
    KPM_b,  # this batch entry's (seq_k,) uint8 key padding, nonzero = padding
    uniform,  # [BLOCK_M] bool: rows that weigh every key alike (query padding)
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_QPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scores of one (BLOCK_M, BLOCK_N) tile in log2 units, −inf where a key is not allowed;
    0 for every key of a ``uniform`` row (HF DeBERTa fills all scores of a padded query with
    finfo.min, so its softmax weighs all keys alike, padding included)."""
    s = dot(q, tl.trans(k), None, PRECISION, UPCAST)
    skew = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :] + (BLOCK_N - 1)
    if HAS_C2P:
        s += tl.gather(dot(q, tl.trans(gk), None, PRECISION, UPCAST), skew, axis=1)
    if HAS_P2C:
        s += tl.gather(dot(gq, tl.trans(k), None, PRECISION, UPCAST), skew, axis=0)
    s = s * qk_scale
    allowed = offs_n[None, :] < seq_k
    if HAS_KPM:
        padding = tl.load(KPM_b + offs_n, mask=offs_n < seq_k, other=1)
        allowed &= padding[None, :] == 0
    s = tl.where(allowed, s, float("-inf"))
    if HAS_QPM:
        s = tl.where(uniform[:, None], tl.where(offs_n[None, :] < seq_k, 0.0, float("-inf")), s)
    return s


@triton.jit
def _disentangled_fwd_kernel(
    Q,  # (batch, heads, seq_q, head_dim), last dim contiguous
    K,  # (batch, heads, seq_k, head_dim), likewise
    V,  # like K
    PK,  # (heads, 2 · span, head_dim) position keys (c2p), last dim contiguous
    PQ,  # (heads, 2 · span, head_dim) position queries (p2c), likewise
    IDX,  # (seq_q + seq_k − 1,) int32
    O,  # like Q, output
    LSE,  # (batch, heads, seq_q) fp32 output, natural log, contiguous
    KPM,  # (batch, seq_k) uint8, nonzero = padding
    QPM,  # (batch, seq_q) uint8, nonzero = a row weighing every key alike
    SEED,  # () int64 dropout seed
    CU,  # varlen: (batch + 1,) int32 first packed row of each sequence, then the total
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
    stride_pkh,
    stride_pkp,
    stride_pqh,
    stride_pqp,
    stride_kpb,
    stride_qpb,
    heads,
    seq_q,  # varlen: the longest sequence
    seq_k,  # likewise
    index_center,  # IDX's entry of i − j = 0
    n_index,
    total,  # varlen: packed rows
    qk_scale,  # scale · log2(e)
    dropout_p,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_QPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences found by CU instead of a batch dim
):
    block, off_h, off_b = tile_ids(heads, seq_q, BLOCK_M, False)
    start_m = block * BLOCK_M
    if VARLEN:
        first_row, seq_q = sequence(CU, off_b)
        seq_k = seq_q
        if start_m >= seq_q:  # a block past the end of a shorter sequence
            return
        Q += first_row * stride_qs
        K += first_row * stride_ks
        V += first_row * stride_vs
        O += first_row * stride_os
        LSE += off_h * total + first_row
    else:
        LSE += (off_b * heads + off_h) * seq_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_M + BLOCK_N)
    K_bh = K + off_b * stride_kb + off_h * stride_kh
    V_bh = V + off_b * stride_vb + off_h * stride_vh
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = load_rows(q_ptrs, offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    uniform = _uniform_rows(QPM + off_b * stride_qpb, offs_m, seq_q, HAS_QPM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    for start_n in range(0, seq_k, BLOCK_N):
        offs_n = start_n + tile_n
        k = load_rows(
            K_bh + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True
        )
        first = start_m - start_n - (BLOCK_N - 1) + index_center
        gk = k
        gq = k
        if HAS_C2P:
            gk = _position_rows(
                PK + off_h * stride_pkh, stride_pkp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        if HAS_P2C:
            gq = _position_rows(
                PQ + off_h * stride_pqh, stride_pqp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        s = _tile_scores(
            q, k, gk, gq, offs_n, seq_k, qk_scale, KPM + off_b * stride_kpb, uniform,
            HAS_C2P, HAS_P2C, HAS_KPM, HAS_QPM, BLOCK_M, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key so far has m = −inf; shifting by 0 keeps its p at 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_rows(
            V_bh + offs_n[:, None] * stride_vs + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True
        )
        p = p.to(v.dtype)
        if HAS_DROPOUT:
            words0, words1, byte = dropout_words(
                seed, off_b * heads + off_h, start_m, start_n, seq_k, BLOCK_M, BLOCK_N, False, 1
            )
            p = dropout_mma_apply(p, words0, words1, byte, dropout_threshold_and_scale(dropout_p)[0])
        acc = dot(p, v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    no_key = m_i == float("-inf")
    keep_scale = 1.0
    if HAS_DROPOUT:
        keep_scale = dropout_threshold_and_scale(dropout_p)[1]
    l_safe = tl.where(no_key, 1.0, l_i)  # no 0 / 0 in the branch tl.where drops
    acc = acc * tl.where(no_key, 0.0, keep_scale / l_safe)[:, None]
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    store_rows(o_ptrs, acc.to(O.dtype.element_ty), offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D)
    lse = tl.where(no_key, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(LSE + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _add_position_grad(
    DP,  # (n_index, head_dim) fp32 gradient by distance of one (batch, head)
    grad,  # (BLOCK_R, BLOCK_D) fp32, row r at index first + r
    first,
    n_index,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    at = first + offs_r
    rows = (offs_r < BLOCK_M + BLOCK_N - 1) & (at >= 0) & (at < n_index)
    tl.atomic_add(
        DP + at[:, None] * HEAD_DIM + offs_d[None, :],
        grad,
        mask=rows[:, None] & (offs_d[None, :] < HEAD_DIM),
        sem="relaxed",
    )


@triton.jit
def _tile_ds(
    s,
    lse,
    delta,
    do,
    v,
    seed,
    off_bh,
    start_m,
    start_n,
    seq_k,
    dropout_p,
    scale,
    uniform,
    HAS_DROPOUT: tl.constexpr,
    HAS_QPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(r z ∘ P, or P without dropout; dS = scale · P ∘ (dP − delta)) of one tile, fp32. A
    ``uniform`` row's scores are constants: its dS is 0 (its p still weighs dV)."""
    p = tl.exp2(s - lse[:, None] * LOG2E)
    dp = dot(do, tl.trans(v), None, PRECISION, UPCAST)
    kept = p
    if HAS_DROPOUT:
        threshold, keep_scale = dropout_threshold_and_scale(dropout_p)
        words0, words1, byte = dropout_words(seed, off_bh, start_m, start_n, seq_k, BLOCK_M, BLOCK_N, False, 1)
        dp = dropout_mma_apply(dp, words0, words1, byte, threshold) * keep_scale
        kept = dropout_mma_apply(p, words0, words1, byte, threshold) * keep_scale
    ds = p * (dp - delta[:, None]) * scale
    if HAS_QPM:
        ds = tl.where(uniform[:, None], 0.0, ds)
    return kept, ds


@triton.jit
def _disentangled_bwd_dkdv_kernel(
    Q,
    K,
    V,
    PK,
    PQ,
    IDX,
    DO,  # like Q, last dim contiguous
    LSE,  # (batch, heads, seq_q) fp32
    DELTA,  # (batch, heads, seq_q) fp32: Σ_d dO O
    KPM,
    QPM,
    SEED,
    CU,
    DK,  # like K, output, strided as stride_g*
    DV,  # likewise
    DPQ,  # (batch, heads, seq_q + seq_k − 1, head_dim) fp32, zeroed: p2c gradient by distance
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
    stride_gb,  # the output gradients' (dk and dv, or dq) strides
    stride_gh,
    stride_gs,
    stride_pkh,
    stride_pkp,
    stride_pqh,
    stride_pqp,
    stride_kpb,
    stride_qpb,
    heads,
    seq_q,
    seq_k,
    index_center,
    n_index,
    total,
    qk_scale,
    scale,
    dropout_p,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_QPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences found by CU instead of a batch dim
):
    block, off_h, off_b = tile_ids(heads, seq_k, BLOCK_N, False)
    start_n = block * BLOCK_N
    off_bh = off_b * heads + off_h
    if VARLEN:
        first_row, seq_k = sequence(CU, off_b)
        seq_q = seq_k
        if start_n >= seq_k:
            return
        Q += first_row * stride_qs
        K += first_row * stride_ks
        V += first_row * stride_vs
        DO += first_row * stride_dos
        DK += first_row * stride_gs
        DV += first_row * stride_gs
        LSE += off_h * total + first_row
        DELTA += off_h * total + first_row
    else:
        LSE += off_bh * seq_q
        DELTA += off_bh * seq_q
    offs_n = start_n + tl.arange(0, BLOCK_N)
    tile_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_M + BLOCK_N)
    k_rows = offs_n[:, None] * stride_ks + offs_d[None, :]
    k = load_rows(K + off_b * stride_kb + off_h * stride_kh + k_rows, offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v_rows = offs_n[:, None] * stride_vs + offs_d[None, :]
    v = load_rows(V + off_b * stride_vb + off_h * stride_vh + v_rows, offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    Q_bh = Q + off_b * stride_qb + off_h * stride_qh
    DO_bh = DO + off_b * stride_dob + off_h * stride_doh
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # dPᵀ[r, n] = dS[r + n − N + 1, n]
    rows_of_r = offs_r[:, None] + tl.arange(0, BLOCK_N)[None, :] - (BLOCK_N - 1)
    skew_valid = (rows_of_r >= 0) & (rows_of_r < BLOCK_M)
    skew_rows = tl.minimum(tl.maximum(rows_of_r, 0), BLOCK_M - 1)
    for start_m in range(0, seq_q, BLOCK_M):
        offs_m = start_m + tile_m
        uniform = _uniform_rows(QPM + off_b * stride_qpb, offs_m, seq_q, HAS_QPM)
        q = load_rows(
            Q_bh + offs_m[:, None] * stride_qs + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True
        )
        do = load_rows(
            DO_bh + offs_m[:, None] * stride_dos + offs_d[None, :], offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True
        )
        lse = tl.load(LSE + offs_m, mask=offs_m < seq_q, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=offs_m < seq_q, other=0.0)
        first = start_m - start_n - (BLOCK_N - 1) + index_center
        gk = k
        gq = k
        if HAS_C2P:
            gk = _position_rows(
                PK + off_h * stride_pkh, stride_pkp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        if HAS_P2C:
            gq = _position_rows(
                PQ + off_h * stride_pqh, stride_pqp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        s = _tile_scores(
            q, k, gk, gq, offs_n, seq_k, qk_scale, KPM + off_b * stride_kpb, uniform,
            HAS_C2P, HAS_P2C, HAS_KPM, HAS_QPM, BLOCK_M, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        kept, ds = _tile_ds(
            s, lse, delta, do, v, seed, off_bh, start_m, start_n, seq_k, dropout_p, scale, uniform,
            HAS_DROPOUT, HAS_QPM, BLOCK_M, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        dv = dot(tl.trans(kept.to(do.dtype)), do, dv, PRECISION, UPCAST)
        ds_in = ds.to(q.dtype)
        dk = dot(tl.trans(ds_in), q, dk, PRECISION, UPCAST)
        if HAS_P2C:
            dpt = tl.where(skew_valid, tl.gather(ds, skew_rows, axis=0), 0.0).to(q.dtype)
            dk = dot(tl.trans(dpt), gq, dk, PRECISION, UPCAST)
            grad = dot(dpt, k, None, PRECISION, UPCAST)
            _add_position_grad(
                DPQ + off_bh * n_index * HEAD_DIM, grad, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N
            )
    g_rows = off_b * stride_gb + off_h * stride_gh + offs_n[:, None] * stride_gs + offs_d[None, :]
    store_rows(DK + g_rows, dk.to(DK.dtype.element_ty), offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D)
    dv_ptrs = DV + g_rows
    store_rows(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _disentangled_bwd_dq_kernel(
    Q,
    K,
    V,
    PK,
    PQ,
    IDX,
    DO,
    LSE,
    DELTA,
    KPM,
    QPM,
    SEED,
    CU,
    DQ,  # like Q, output, strided as stride_g*
    DPK,  # (batch, heads, seq_q + seq_k − 1, head_dim) fp32, zeroed: c2p gradient by distance
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
    stride_gb,  # the output gradients' (dk and dv, or dq) strides
    stride_gh,
    stride_gs,
    stride_pkh,
    stride_pkp,
    stride_pqh,
    stride_pqp,
    stride_kpb,
    stride_qpb,
    heads,
    seq_q,
    seq_k,
    index_center,
    n_index,
    total,
    qk_scale,
    scale,
    dropout_p,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_QPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences found by CU instead of a batch dim
):
    block, off_h, off_b = tile_ids(heads, seq_q, BLOCK_M, False)
    start_m = block * BLOCK_M
    off_bh = off_b * heads + off_h
    if VARLEN:
        first_row, seq_q = sequence(CU, off_b)
        seq_k = seq_q
        if start_m >= seq_q:
            return
        Q += first_row * stride_qs
        K += first_row * stride_ks
        V += first_row * stride_vs
        DO += first_row * stride_dos
        DQ += first_row * stride_gs
        LSE += off_h * total + first_row
        DELTA += off_h * total + first_row
    else:
        LSE += off_bh * seq_q
        DELTA += off_bh * seq_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_M + BLOCK_N)
    q_rows = offs_m[:, None] * stride_qs + offs_d[None, :]
    q = load_rows(Q + off_b * stride_qb + off_h * stride_qh + q_rows, offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do_rows = offs_m[:, None] * stride_dos + offs_d[None, :]
    do = load_rows(
        DO + off_b * stride_dob + off_h * stride_doh + do_rows, offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True
    )
    lse = tl.load(LSE + offs_m, mask=offs_m < seq_q, other=float("inf"))
    delta = tl.load(DELTA + offs_m, mask=offs_m < seq_q, other=0.0)
    uniform = _uniform_rows(QPM + off_b * stride_qpb, offs_m, seq_q, HAS_QPM)
    K_bh = K + off_b * stride_kb + off_h * stride_kh
    V_bh = V + off_b * stride_vb + off_h * stride_vh
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # dC[m, r] = dS[m, m − r + N − 1]
    cols_of_r = tl.arange(0, BLOCK_M)[:, None] - offs_r[None, :] + (BLOCK_N - 1)
    skew_valid = (cols_of_r >= 0) & (cols_of_r < BLOCK_N)
    skew_cols = tl.minimum(tl.maximum(cols_of_r, 0), BLOCK_N - 1)
    for start_n in range(0, seq_k, BLOCK_N):
        offs_n = start_n + tile_n
        k = load_rows(
            K_bh + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True
        )
        v = load_rows(
            V_bh + offs_n[:, None] * stride_vs + offs_d[None, :], offs_n, seq_k, offs_d, HEAD_DIM, BLOCK_D, True
        )
        first = start_m - start_n - (BLOCK_N - 1) + index_center
        gk = k
        gq = k
        if HAS_C2P:
            gk = _position_rows(
                PK + off_h * stride_pkh, stride_pkp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        if HAS_P2C:
            gq = _position_rows(
                PQ + off_h * stride_pqh, stride_pqp, IDX, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_D
            )
        s = _tile_scores(
            q, k, gk, gq, offs_n, seq_k, qk_scale, KPM + off_b * stride_kpb, uniform,
            HAS_C2P, HAS_P2C, HAS_KPM, HAS_QPM, BLOCK_M, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        _, ds = _tile_ds(
            s, lse, delta, do, v, seed, off_bh, start_m, start_n, seq_k, dropout_p, scale, uniform,
            HAS_DROPOUT, HAS_QPM, BLOCK_M, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        dq = dot(ds.to(k.dtype), k, dq, PRECISION, UPCAST)
        if HAS_C2P:
            dc = tl.where(skew_valid, tl.gather(ds, skew_cols, axis=1), 0.0).to(q.dtype)
            dq = dot(dc, gk, dq, PRECISION, UPCAST)
            grad = dot(tl.trans(dc), q, None, PRECISION, UPCAST)
            _add_position_grad(
                DPK + off_bh * n_index * HEAD_DIM, grad, first, n_index, offs_r, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N
            )
    dq_ptrs = DQ + off_b * stride_gb + off_h * stride_gh + offs_m[:, None] * stride_gs + offs_d[None, :]
    store_rows(dq_ptrs, dq.to(DQ.dtype.element_ty), offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D)


# ----------------------------------------------------------------------------- launchers


def _blocks(q: torch.Tensor, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_M = BLOCK_N, num_warps, num_stages). A tile also holds the two (tile × 2 · tile)
    position products and their skews, so tiles are a quarter of FlashAttention-2's: the
    largest that compile without spills on sm_90 and sm_80 (compile report)."""
    if q.dtype == torch.float32 or q.shape[-1] > 64:
        return 16, 4, 1
    if backward and dispatch.device_target(q).arch < 90:
        return 16, 4, 1
    return 32, 8 if backward else 4, 1


def _flags(q, pos_key, pos_query, key_padding_mask, query_padding_mask, dropout_p) -> dict:
    return dict(
        HAS_C2P=pos_key is not None,
        HAS_P2C=pos_query is not None,
        HAS_KPM=key_padding_mask is not None,
        HAS_QPM=query_padding_mask is not None,
        HAS_DROPOUT=dropout_p > 0.0,
        HEAD_DIM=q.shape[-1],
        BLOCK_D=max(16, next_power_of_2(q.shape[-1])),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )


def _pointer_args(q, pos_key, pos_query, key_padding_mask, query_padding_mask) -> tuple[list, list]:
    """(position and padding tensors, their strides): stand-ins where absent (never read)."""
    pk = q if pos_key is None else pos_key
    pq = q if pos_query is None else pos_query
    kpm, qpm = (q if mask is None else mask.view(torch.uint8) for mask in (key_padding_mask, query_padding_mask))
    masks = [0 if mask is None else mask.stride(0) for mask in (key_padding_mask, query_padding_mask)]
    return [pk, pq, kpm, qpm], [pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), *masks]


def _geometry(q, k, cu_seqlens, max_seqlen) -> tuple[int, int, int, int, int]:
    """(batch, heads, seq_q, seq_k, total) of a launch: varlen's seq_q and seq_k are the
    longest sequence's, its total the packed rows."""
    if cu_seqlens is not None:
        return cu_seqlens.numel() - 1, q.shape[1], max_seqlen, max_seqlen, q.shape[0]
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2], 0


def disentangled_forward(
    q, k, v, pos_key, pos_query, index, key_padding_mask, query_padding_mask, dropout_p, scale, seed,
    cu_seqlens=None, max_seqlen=0,
):  # fmt: skip
    """(out, lse) by the Triton kernel: out (batch, heads, seq_q, head_dim) in ``empty_output``'s
    layout and lse (batch, heads, seq_q) fp32; varlen (``cu_seqlens``): out (total, heads,
    head_dim) and lse (heads, total)."""
    varlen = cu_seqlens is not None
    batch, heads, seq_q, seq_k, total = _geometry(q, k, cu_seqlens, max_seqlen)
    if q.numel() == 0 or k.numel() == 0:
        return (
            (torch.zeros_like(q), q.new_full((heads, total), math.inf, dtype=torch.float32))
            if varlen
            else empty_forward(q)
        )
    out = torch.empty_like(q) if varlen else empty_output(q)
    lse_shape = (heads, total) if varlen else (batch, heads, seq_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    block, warps, stages = _blocks(q, backward=False)
    (pk, pq, kpm, qpm), strides = _pointer_args(q, pos_key, pos_query, key_padding_mask, query_padding_mask)
    grid = (cdiv(seq_q, block) * heads * batch,)
    _disentangled_fwd_kernel[grid](
        q, k, v, pk, pq, index, out, lse, kpm, qpm, q if seed is None else seed, q if cu_seqlens is None else cu_seqlens,
        *head_strides(1, q, k, v, out), *strides,
        heads, seq_q, seq_k, seq_k - 1, index.numel(), total, scale * math.log2(math.e), dropout_p,
        **_flags(q, pos_key, pos_query, key_padding_mask, query_padding_mask, dropout_p),
        BLOCK_M=block, BLOCK_N=block, VARLEN=varlen, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


def disentangled_backward(
    grad_out, q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, dropout_p, scale, seed,
    cu_seqlens=None, max_seqlen=0,
):  # fmt: skip
    """(dq, dk, dv, d pos_key by distance, d pos_query by distance) by the Triton kernels; the
    position gradients (batch, heads, len(index), head_dim) fp32, or None."""
    varlen = cu_seqlens is not None
    batch, heads, seq_q, seq_k, total = _geometry(q, k, cu_seqlens, max_seqlen)
    head_dim = q.shape[-1]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dpk, dpq = (
        None
        if pos is None
        else torch.zeros((batch, heads, index.numel(), head_dim), dtype=torch.float32, device=q.device)
        for pos in (pos_key, pos_query)
    )
    delta = torch.linalg.vecdot(grad_out.float(), out.float())
    delta = delta.T.contiguous() if varlen else delta  # lse's layout: (heads, total) or (batch, heads, seq_q)
    block, warps, stages = _blocks(q, backward=True)
    (pk, pq, kpm, qpm), strides = _pointer_args(q, pos_key, pos_query, key_padding_mask, query_padding_mask)
    inputs = (q, k, v, grad_out)

    def launch(kernel, rows, grads, position_grad):
        kernel[(cdiv(rows, block) * heads * batch,)](
            q, k, v, pk, pq, index, grad_out, lse, delta, kpm, qpm, q if seed is None else seed,
            q if cu_seqlens is None else cu_seqlens, *grads, q if position_grad is None else position_grad,
            *head_strides(1, *inputs, grads[0]),
            *strides, heads, seq_q, seq_k, seq_k - 1, index.numel(), total, scale * math.log2(math.e), scale,
            dropout_p, **_flags(q, pos_key, pos_query, key_padding_mask, query_padding_mask, dropout_p),
            BLOCK_M=block, BLOCK_N=block, VARLEN=varlen, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    launch(_disentangled_bwd_dkdv_kernel, seq_k, (dk, dv), dpq)
    launch(_disentangled_bwd_dq_kernel, seq_q, (dq,), dpk)
    return dq, dk, dv, dpk, dpq


# ----------------------------------------------------------------------------- reference


def _head_groups(batch: int, heads: int, span_rows: int, seq_k: int) -> list[tuple[int, int, int]]:
    """(batch entry, first head, end head) of the reference's groups: one batch entry's heads,
    in groups whose (heads, 2 · span, seq_k) p2c table stays under _REFERENCE_TABLE_ELEMENTS."""
    step = max(1, _REFERENCE_TABLE_ELEMENTS // max(1, span_rows * seq_k))
    return [(b, h, min(heads, h + step)) for b in range(batch) for h in range(0, heads, step)]


class _Group:
    """One batch entry's heads h0:h1 in the reference's dtype: their keys, values, position rows
    and the keys' p2c table ``K pqᵀ`` (heads, seq_k, 2 · span), and the scores of any query rows.
    The table is gathered and scattered along its last dim, as HF's p2c is (several times
    faster on a CPU than along the middle one)."""

    def __init__(self, q, k, v, pos_key, pos_query, index, masks, scale, b, h0, h1, first_stream):
        dtype = reference_dtype(q)
        self.q_all, self.b, self.h0, self.h1, self.scale = q, b, h0, h1, scale
        self.k, self.v = k[b, h0:h1].to(dtype), v[b, h0:h1].to(dtype)
        self.pk = None if pos_key is None else pos_key[h0:h1].to(dtype)
        self.pq = None if pos_query is None else pos_query[h0:h1].to(dtype)
        self.kpq = None if pos_query is None else torch.bmm(self.k, self.pq.mT)
        key_padding_mask, query_padding_mask = masks
        self.padding = None if key_padding_mask is None else key_padding_mask[b]
        self.uniform = None if query_padding_mask is None else query_padding_mask[b]
        self.first_stream = first_stream + b * q.shape[1] + h0
        self.index, self.seq_k = index.long(), k.shape[2]

    def rows(self, x, start, stop):
        return x[self.b, self.h0 : self.h1, start:stop].to(reference_dtype(self.q_all))

    def positions(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 position rows of query rows start:stop and every key, (heads, rows, seq_k),
        and the same by key, (heads, seq_k, rows) (expanded views of contiguous matrices)."""
        i = torch.arange(start, stop, device=self.index.device)[:, None]
        j = torch.arange(self.seq_k, device=self.index.device)
        by_row = self.index[i - j + self.seq_k - 1]
        heads = self.h1 - self.h0
        return by_row.expand(heads, -1, -1), by_row.T.contiguous().expand(heads, -1, -1)

    def scores(self, q_rows, positions, start, stop):
        """(heads, rows, seq_k) scaled scores of query rows start:stop, −inf at padding keys;
        0 at every key of a row the query padding mask makes uniform."""
        by_row, by_key = positions
        s = torch.bmm(q_rows, self.k.mT)
        if self.pk is not None:
            s.add_(torch.bmm(q_rows, self.pk.mT).gather(-1, by_row))
        if self.kpq is not None:
            s.add_(self.kpq.gather(-1, by_key).mT)
        s.mul_(self.scale)
        if self.padding is not None:
            s.masked_fill_(self.padding, -math.inf)
        if self.uniform is not None:
            s.masked_fill_(self.uniform[start:stop, None], 0.0)
        return s

    def keep(self, seed, dropout_p, start, stop):
        """The kernels' dropout keep mask of these heads' query rows start:stop (heads, rows, seq_k)."""
        streams = self.h1 - self.h0
        first = self.first_stream
        return dropout_keep_mma_block(seed, streams, start, stop, self.seq_k, self.seq_k, dropout_p, first)


def disentangled_forward_reference(
    q, k, v, pos_key, pos_query, index, key_padding_mask, query_padding_mask, dropout_p, scale, seed, first_stream=0
):
    """What ``disentangled_forward`` computes, in fp32 PyTorch (fp64 for fp64 inputs); the dropout
    streams of batch entry b start at first_stream + b · heads."""
    batch, heads, seq_q, _ = q.shape
    masks = key_padding_mask, query_padding_mask
    if q.numel() == 0 or k.numel() == 0:
        return empty_forward(q)
    out = empty_output(q)
    lse = torch.empty((batch, heads, seq_q), dtype=reference_dtype(q), device=q.device)
    span_rows = 0 if pos_query is None else pos_query.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        for b, h0, h1 in _head_groups(batch, heads, span_rows, k.shape[2]):
            group = _Group(q, k, v, pos_key, pos_query, index, masks, scale, b, h0, h1, first_stream)
            for start, stop in reference_row_blocks(seq_q, (h1 - h0) * k.shape[2]):
                p = group.scores(group.rows(q, start, stop), group.positions(start, stop), start, stop)
                best = p.amax(-1, keepdim=True)
                no_key = best == -math.inf
                p.sub_(best.masked_fill(no_key, 0.0)).exp_()
                total = p.sum(-1, keepdim=True)
                row_scale = total.reciprocal().masked_fill_(no_key, 0.0)
                if seed is not None:
                    p.mul_(group.keep(seed, dropout_p, start, stop))
                    row_scale.mul_(dropout_threshold(dropout_p)[1])
                out[b, h0:h1, start:stop] = torch.bmm(p.mul_(row_scale), group.v)
                lse[b, h0:h1, start:stop] = best.add_(total.log_()).masked_fill_(no_key, math.inf).squeeze(-1)
    return out, lse


def disentangled_backward_reference(
    grad_out, q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, dropout_p, scale, seed,
    first_stream=0,
):  # fmt: skip
    """What ``disentangled_backward`` computes, with the position gradients already in buckets:
    (dq, dk, dv, d pos_key, d pos_query) in the reference's dtype (None for an absent position)."""
    batch, heads, seq_q, _ = q.shape
    masks = key_padding_mask, query_padding_mask
    dtype = reference_dtype(q)
    dq, dk, dv = (torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))
    dpk = None if pos_key is None else torch.zeros(pos_key.shape, dtype=dtype, device=q.device)
    dpq = None if pos_query is None else torch.zeros(pos_query.shape, dtype=dtype, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq, dk, dv, dpk, dpq
    span_rows = 0 if pos_query is None else pos_query.shape[1]
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    with torch.autocast(q.device.type, enabled=False):
        for b, h0, h1 in _head_groups(batch, heads, span_rows, k.shape[2]):
            group = _Group(q, k, v, pos_key, pos_query, index, masks, scale, b, h0, h1, first_stream)
            dk_g, dv_g = dk[b, h0:h1], dv[b, h0:h1]
            dkpq = None if pos_query is None else torch.zeros_like(group.kpq)
            for start, stop in reference_row_blocks(seq_q, (h1 - h0) * k.shape[2]):
                q_rows, do_rows = group.rows(q, start, stop), group.rows(grad_out, start, stop)
                positions = group.positions(start, stop)
                p = group.scores(q_rows, positions, start, stop)
                p.sub_(lse[b, h0:h1, start:stop, None]).exp_()
                dp = torch.bmm(do_rows, group.v.mT)
                if seed is None:
                    dv_g.baddbmm_(p.mT, do_rows)
                else:
                    keep = group.keep(seed, dropout_p, start, stop)
                    dv_g.baddbmm_((p * keep).mT, do_rows, alpha=keep_scale)
                    dp.mul_(keep).mul_(keep_scale)
                # Σ_j P dP over whole rows: each row of dS sums to ~0, as torch's softmax backward
                ds = dp.sub_(torch.linalg.vecdot(p, dp).unsqueeze(-1)).mul_(p).mul_(scale)
                if group.uniform is not None:  # constant scores
                    ds.masked_fill_(group.uniform[start:stop, None], 0.0)
                dq_rows = torch.bmm(ds, group.k)
                if pos_key is not None:
                    dc = torch.zeros((h1 - h0, stop - start, pos_key.shape[1]), dtype=dtype, device=q.device)
                    dc.scatter_add_(-1, positions[0], ds)
                    dq_rows.baddbmm_(dc, group.pk)
                    dpk[h0:h1].baddbmm_(dc.mT, q_rows)
                if dkpq is not None:
                    dkpq.scatter_add_(-1, positions[1], ds.mT.contiguous())
                dk_g.baddbmm_(ds.mT, q_rows)
                dq[b, h0:h1, start:stop] = dq_rows
            if dkpq is not None:
                dk_g.baddbmm_(dkpq, group.pq)
                dpq[h0:h1].baddbmm_(dkpq.mT, group.k)
    return dq, dk, dv, dpk, dpq


def _sequence_index(index: torch.Tensor, max_seqlen: int, length: int) -> torch.Tensor:
    """The dense index of a sequence of ``length`` tokens, a slice of varlen's (2 · max_seqlen − 1)."""
    return index[max_seqlen - length : max_seqlen + length - 1]


def varlen_forward_reference(q, k, v, pos_key, pos_query, index, dropout_p, scale, seed, cu_seqlens, max_seqlen):
    """What ``disentangled_forward`` computes on packed sequences: the dense reference on each
    as a batch of one, its dropout streams b · heads + h; out (total, heads, head_dim), lse
    (heads, total), a sequence's rows zero / +inf where it has no keys."""
    heads = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((heads, q.shape[0]), math.inf, dtype=reference_dtype(q), device=q.device)
    for b, rows, _ in sequences(cu_seqlens, cu_seqlens):
        index_b = _sequence_index(index, max_seqlen, rows.stop - rows.start)
        out_b, lse_b = disentangled_forward_reference(
            as_batch_of_one(q[rows]), as_batch_of_one(k[rows]), as_batch_of_one(v[rows]), pos_key, pos_query, index_b, None, None, dropout_p, scale,
            seed, b * heads,
        )  # fmt: skip
        out[rows] = rearrange(out_b, "1 h l d -> l h d")
        lse[:, rows] = lse_b[0]
    return out, lse


def varlen_backward_reference(
    grad_out, q, k, v, pos_key, pos_query, index, out, lse, dropout_p, scale, seed, cu_seqlens, max_seqlen
):
    """What ``disentangled_backward`` computes on packed sequences, sequence by sequence, with the
    position gradients summed over them and already in buckets."""
    heads, dtype = q.shape[1], reference_dtype(q)
    dq, dk, dv = (torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))
    dpk, dpq = (
        None if pos is None else torch.zeros(pos.shape, dtype=dtype, device=q.device) for pos in (pos_key, pos_query)
    )
    for b, rows, _ in sequences(cu_seqlens, cu_seqlens):
        index_b = _sequence_index(index, max_seqlen, rows.stop - rows.start)
        grads = disentangled_backward_reference(
            as_batch_of_one(grad_out[rows]), as_batch_of_one(q[rows]), as_batch_of_one(k[rows]), as_batch_of_one(v[rows]), pos_key, pos_query, index_b, None,
            lse[None, :, rows], None, None, dropout_p, scale, seed, b * heads,
        )  # fmt: skip
        for total, grad in zip((dq, dk, dv), grads[:3]):
            total[rows] = rearrange(grad, "1 h l d -> l h d")
        for total, grad in zip((dpk, dpq), grads[3:]):
            if total is not None:
                total += grad
    return dq, dk, dv, dpk, dpq


# ----------------------------------------------------------------------------- ops


def _optional(x: torch.Tensor | None, device) -> torch.Tensor:
    return torch.empty(0, device=device) if x is None else x


def _fake_lse(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    shape = q.shape[:3] if cu_seqlens is None else (q.shape[1], q.shape[0])
    return q.new_empty(shape, dtype=reference_dtype(q))


@torch.library.custom_op("slimformer::disentangled_attention", mutates_args=())
def disentangled_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_key: torch.Tensor | None,
    pos_query: torch.Tensor | None,
    index: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of checked inputs (``disentangled_attention``; with ``cu_seqlens``, packed
    (total, heads, head_dim) sequences of ``varlen_disentangled_attention``)."""
    masks = key_padding_mask, query_padding_mask
    if cu_seqlens is not None:  # inside the op, so that torch.compile keeps the check
        check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0], max_seqlen, "query")
    if runs_kernels(q):
        return disentangled_forward(
            q, k, v, pos_key, pos_query, index, *masks, dropout_p, scale, seed, cu_seqlens, max_seqlen
        )
    if cu_seqlens is not None:
        return varlen_forward_reference(
            q, k, v, pos_key, pos_query, index, dropout_p, scale, seed, cu_seqlens, max_seqlen
        )
    return disentangled_forward_reference(q, k, v, pos_key, pos_query, index, *masks, dropout_p, scale, seed)


@disentangled_attention_op.register_fake
def _(
    q,
    k,
    v,
    pos_key,
    pos_query,
    index,
    key_padding_mask,
    query_padding_mask,
    seed,
    dropout_p,
    scale,
    cu_seqlens=None,
    max_seqlen=0,
):
    return (empty_output(q) if cu_seqlens is None else torch.empty_like(q)), _fake_lse(q, cu_seqlens)


@torch.library.custom_op("slimformer::disentangled_attention_backward", mutates_args=())
def disentangled_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_key: torch.Tensor | None,
    pos_query: torch.Tensor | None,
    index: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d pos_key, d pos_query) in the inputs' dtypes; an absent position's is empty."""
    grad_out = last_dim_contiguous(grad_out)
    positions = pos_key, pos_query
    common = (grad_out, q, k, v, *positions, index, out, lse)
    masks = key_padding_mask, query_padding_mask
    if runs_kernels(q) and q.numel() and k.numel():  # the reference gives empty inputs' zeros
        dq, dk, dv, *by_distance = disentangled_backward(
            *common, *masks, dropout_p, scale, seed, cu_seqlens, max_seqlen
        )
        long_index = index.long()
        dpk, dpq = (
            None if grad is None else grad.new_zeros(pos.shape).index_add_(1, long_index, grad.sum(0))
            for grad, pos in zip(by_distance, positions)
        )
    elif cu_seqlens is not None:
        dq, dk, dv, dpk, dpq = varlen_backward_reference(*common, dropout_p, scale, seed, cu_seqlens, max_seqlen)
    else:
        dq, dk, dv, dpk, dpq = disentangled_backward_reference(*common, *masks, dropout_p, scale, seed)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dpk = _optional(None if dpk is None else dpk.to(pos_key.dtype), q.device)
    dpq = _optional(None if dpq is None else dpq.to(pos_query.dtype), q.device)
    return dq, dk, dv, dpk, dpq


@disentangled_attention_backward_op.register_fake
def _(
    grad_out, q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, seed, dropout_p, scale,
    cu_seqlens=None, max_seqlen=0,
):  # fmt: skip
    # contiguous, as the real op allocates them, whatever the inputs' strides (head views)
    positions = (
        torch.empty(0, device=q.device) if pos is None else pos.new_empty(pos.shape) for pos in (pos_key, pos_query)
    )
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *positions


def _setup_context(ctx, inputs, output):
    q, k, v, pos_key, pos_query, index, key_padding_mask, query_padding_mask, seed, dropout_p, scale, *varlen = inputs
    cu_seqlens, max_seqlen = (*varlen, None, 0)[:2]
    out, lse = output
    ctx.save_for_backward(
        q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, seed, cu_seqlens
    )
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.dropout_p, ctx.scale, ctx.max_seqlen = dropout_p, scale, max_seqlen


def _grad(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None,) * 13
    q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, seed, cu_seqlens = (
        ctx.saved_tensors
    )
    dq, dk, dv, dpk, dpq = direct(disentangled_attention_backward_op)(
        grad_out, q, k, v, pos_key, pos_query, index, out, lse, key_padding_mask, query_padding_mask, seed,
        ctx.dropout_p, ctx.scale, cu_seqlens, ctx.max_seqlen,
    )  # fmt: skip
    return dq, dk, dv, None if pos_key is None else dpk, None if pos_query is None else dpq, *(None,) * 8


_run = eager_autograd(disentangled_attention_op, _grad, _setup_context)


# ----------------------------------------------------------------------------- public


def _check_tensor(name: str, x, dim: int, dtype: torch.dtype | None, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-d, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have query's dtype {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on query's device {device}, got {x.device}")


def _checked_buckets(position_buckets, max_relative_positions) -> tuple[int, int]:
    """The bucket arguments as ints, checked where DeBERTa-v2's log buckets are defined:
    they divide by ``position_buckets // 2`` and by log((max_relative_positions − 1) /
    (position_buckets // 2)) when both are positive."""
    position_buckets = checked_int("position_buckets", position_buckets)
    max_relative_positions = checked_int("max_relative_positions", max_relative_positions)
    if position_buckets == 1:
        raise ValueError("position_buckets must be <= 0 (no buckets) or >= 2, got 1")
    if position_buckets > 0 and max_relative_positions == position_buckets // 2 + 1:
        raise ValueError(
            f"max_relative_positions must differ from position_buckets // 2 + 1 = {position_buckets // 2 + 1} "
            f"when position_buckets={position_buckets} > 0 (its log buckets divide by log(1) = 0), "
            f"got {max_relative_positions}"
        )
    return position_buckets, max_relative_positions


def disentangled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pos_key: torch.Tensor | None = None,
    pos_query: torch.Tensor | None = None,
    *,
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """DeBERTa(-v2/-v3)'s disentangled self-attention, fused (see the module docstring).

    Args:
        query, key, value: (batch, heads, seq_q or seq_k, head_dim), float16, bfloat16,
            float32 or float64 (the PyTorch reference), one dtype and device; any strides.
        pos_key: (heads, 2 · span, head_dim) position keys, ``pos_key_proj(rel_embeddings)``
            per head, for the content→position term; None leaves it out.
        pos_query: likewise the position queries (``pos_query_proj``) of the
            position→content term; None leaves it out.
        position_buckets, max_relative_positions: DeBERTa-v2's config values; the relative
            position i − j is bucketed logarithmically when both are positive
            (``relative_position_index``). span = rows of the position tensors / 2: HF's
            ``position_buckets`` when positive, else ``max_relative_positions``.
        key_padding_mask: (batch, seq_k) bool, True = padding.
        query_padding_mask: (batch, seq_q) bool, True = a row that weighs every key alike,
            padding included (HF DeBERTa's padded queries, whose scores are all finfo.min);
            such a row's scores get no gradient.
        dropout_p: attention dropout, masks regenerated in backward from a Philox seed.
        scale: the scores' factor, default ``1 / sqrt(head_dim · (1 + terms))``, DeBERTa's
            scale with one term per position tensor given.

    Returns:
        (batch, heads, seq_q, head_dim) in query's dtype, stored as (batch, seq_q, heads,
        head_dim) so that merging the heads is a view. Gradients flow to query, key, value
        and both position tensors.

    Raises:
        TypeError: non-tensors, dtypes other than the four or not matching, a non-bool
            key_padding_mask, bucket arguments that are not integers (bools included).
        ValueError: wrong ranks or shapes, head_dim outside [1, 256], positions of an odd or
            different number of rows, a span that does not match ``position_buckets``,
            ``position_buckets`` = 1 or ``max_relative_positions`` = position_buckets // 2 + 1
            with position_buckets > 0 (DeBERTa-v2's log buckets divide by zero there),
            dropout_p outside [0, 1), different devices.
    """
    _check_tensor("query", query, 4, None, getattr(query, "device", None))
    if query.dtype not in _DTYPES:
        raise TypeError(f"query must be float16, bfloat16, float32 or float64, got {query.dtype}")
    batch, heads, seq_q, head_dim = query.shape
    for name, tensor in (("key", key), ("value", value)):
        _check_tensor(name, tensor, 4, query.dtype, query.device)
    if key.shape[:2] != (batch, heads) or key.shape[-1] != head_dim:
        raise ValueError(
            f"key must be (batch, heads, seq_k, head_dim) = ({batch}, {heads}, seq_k, {head_dim}), got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    seq_k = key.shape[2]
    masks = (
        ("key_padding_mask", key_padding_mask, "seq_k", seq_k),
        ("query_padding_mask", query_padding_mask, "seq_q", seq_q),
    )
    for name, mask, seq_name, seq in masks:
        if mask is None:
            continue
        _check_tensor(name, mask, 2, None, query.device)
        if mask.dtype != torch.bool:
            raise TypeError(f"{name} must be bool (True = padding), got {mask.dtype}")
        if mask.shape != (batch, seq):
            raise ValueError(f"{name} must be (batch, {seq_name}) = {(batch, seq)}, got {tuple(mask.shape)}")
    position_buckets, max_relative_positions = _checked_buckets(position_buckets, max_relative_positions)
    span = _check_positions(pos_key, pos_query, query, heads, head_dim, position_buckets)
    scale = _check_dropout_and_scale(dropout_p, scale, head_dim, pos_key, pos_query)
    index = _shared_index(seq_q, seq_k, span, position_buckets, max_relative_positions, query.device)
    query, key, value, pos_key, pos_query = _last_dims_contiguous(query, key, value, pos_key, pos_query)
    seed = new_dropout_seed(query.device, query.detach(), "attention") if dropout_p > 0.0 else None
    masks = key_padding_mask, query_padding_mask
    dtype = query.dtype
    query, key, value, pos_key, pos_query = _in_verified_dtype(dropout_p, query, key, value, pos_key, pos_query)
    out, _ = _run(query, key, value, pos_key, pos_query, index, *masks, seed, float(dropout_p), scale, None, 0)
    return out.to(dtype)


def _in_verified_dtype(dropout_p: float, query, *tensors) -> list:
    """The tensors, in fp32 where the compiled kernels are known wrong: with dropout, 16-bit
    inputs of head_dim > 64 (16-row 16-bit tiles) gave outputs far off the oracle on an H200
    (GPU check bench/results/gpu/2026-11-28-h200-gpu-check-2159db4) while fp32 tiles of the same
    size, 16-bit ones without dropout and 32-row 16-bit ones with it agreed."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout_p > 0.0):
        return [query, *tensors]
    if _blocks(query, backward=False)[0] >= 32:
        return [query, *tensors]
    warnings.warn(
        f"disentangled attention with dropout at head_dim {query.shape[-1]} runs in float32: its "
        f"{query.dtype} kernels gave wrong outputs there on an H200 (docs/deberta.md)",
        stacklevel=3,
    )
    return [None if x is None else x.float() for x in (query, *tensors)]


def _check_positions(pos_key, pos_query, query, heads: int, head_dim: int, position_buckets: int) -> int:
    """The span (rows / 2) of the position tensors, checked; 1 without them."""
    rows = None
    for name, pos in (("pos_key", pos_key), ("pos_query", pos_query)):
        if pos is None:
            continue
        _check_tensor(name, pos, 3, query.dtype, query.device)
        if pos.shape[0] != heads or pos.shape[2] != head_dim or pos.shape[1] % 2 or pos.shape[1] == 0:
            raise ValueError(
                f"{name} must be (heads, 2 · span, head_dim) = ({heads}, 2 · span, {head_dim}), got {tuple(pos.shape)}"
            )
        if rows is not None and pos.shape[1] != rows:
            raise ValueError(f"pos_key and pos_query must have the same rows, got {rows} and {pos.shape[1]}")
        rows = pos.shape[1]
    if rows is not None and position_buckets > 0 and rows != 2 * position_buckets:
        raise ValueError(f"position tensors must have 2 · position_buckets = {2 * position_buckets} rows, got {rows}")
    return (rows or 2) // 2


def _check_dropout_and_scale(dropout_p, scale, head_dim: int, pos_key, pos_query) -> float:
    """The scale, DeBERTa's by default (one term per position tensor given), checked with dropout_p."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p}")
    if scale is None:
        return 1.0 / math.sqrt(head_dim * (1 + (pos_key is not None) + (pos_query is not None)))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    return float(scale)


def _last_dims_contiguous(*tensors):
    return tuple(None if x is None else last_dim_contiguous(x) for x in tensors)


def varlen_disentangled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    pos_key: torch.Tensor | None = None,
    pos_query: torch.Tensor | None = None,
    *,
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """``disentangled_attention`` of packed sequences (self-attention, as ``sf.varlen_attention``
    packs them): query, key, value (total, heads, head_dim), sequence b owning rows
    ``cu_seqlens[b] : cu_seqlens[b + 1]`` (int32, (batch + 1,)), each attending to its own
    tokens at its own relative positions; ``max_seqlen`` at least the longest sequence. The
    position tensors and the other arguments as ``disentangled_attention``'s; dropout streams
    b · heads + h, as the padded call's. Returns (total, heads, head_dim) in query's dtype.

    Raises TypeError / ValueError as ``disentangled_attention``, and for a ``cu_seqlens`` that is
    not a 1-d int32 tensor on query's device starting at 0 and ending at total, or a
    ``max_seqlen`` below 1.
    """
    _check_tensor("query", query, 3, None, getattr(query, "device", None))
    if query.dtype not in _DTYPES:
        raise TypeError(f"query must be float16, bfloat16, float32 or float64, got {query.dtype}")
    total, heads, head_dim = query.shape
    for name, tensor in (("key", key), ("value", value)):
        _check_tensor(name, tensor, 3, query.dtype, query.device)
        if tensor.shape != query.shape:
            raise ValueError(f"{name} must have query's shape {tuple(query.shape)}, got {tuple(tensor.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    _check_tensor("cu_seqlens", cu_seqlens, 1, torch.int32, query.device)
    max_seqlen = checked_int("max_seqlen", max_seqlen)
    if max_seqlen < 1:
        raise ValueError(f"max_seqlen must be >= 1, got {max_seqlen}")
    position_buckets, max_relative_positions = _checked_buckets(position_buckets, max_relative_positions)
    span = _check_positions(pos_key, pos_query, query, heads, head_dim, position_buckets)
    scale = _check_dropout_and_scale(dropout_p, scale, head_dim, pos_key, pos_query)
    index = _shared_index(max_seqlen, max_seqlen, span, position_buckets, max_relative_positions, query.device)
    query, key, value, pos_key, pos_query = _last_dims_contiguous(query, key, value, pos_key, pos_query)
    seed = new_dropout_seed(query.device, query.detach(), "attention") if dropout_p > 0.0 else None
    dtype = query.dtype
    query, key, value, pos_key, pos_query = _in_verified_dtype(dropout_p, query, key, value, pos_key, pos_query)
    args = (query, key, value, pos_key, pos_query, index, None, None, seed, float(dropout_p), scale)
    out, _ = _run(*args, cu_seqlens, max_seqlen)
    return out.to(dtype)
