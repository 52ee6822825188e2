"""The tiles every attention kernel is built from: block ids, masked loads and stores of
head rows, the masked score tile and the dropout words, shared by the forward and the
backward, dense (batch, heads, seq) and packed varlen (token, heads) layouts alike.

Two helpers are varlen's own: ``sequence`` (where a packed sequence starts and how long
it is) and ``load_sequence_rows``. Every other one takes a pointer already offset to one
(batch, head) or one (sequence, head), so it does not know which layout it serves.
"""

import triton
import triton.language as tl

from slimformer.kernels.philox import dropout_mma_words

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# An additive mask value at or below this masks its key, like −inf: finfo.min of every
# float dtype and −1e9 do. A row masked only by such values would have an lse too large
# for fp32 to hold log Σ exp (at |lse| = 1e9 the ulp is 64), so backward could not
# rebuild p from it; masks of −1e4 (older HF models) still weigh their keys, as in SDPA.
MASKED_BIAS = -(2.0**15)
_MASKED_BIAS = tl.constexpr(MASKED_BIAS)
# attn_mask kinds, the kernels' MASK_KIND
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32 (the tensor cores add into ``acc`` in place)."""
    if UPCAST:
        # Triton 3.6's interpreter multiplies bf16 blocks as their raw uint16 bits; the
        # fp32 product of bf16 values is exact, so upcasting changes no result.
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def tile_ids(num_heads, seq, BLOCK: tl.constexpr, LONGEST_FIRST: tl.constexpr):
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
def load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
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
def load_sequence_rows(
    X, rows, stride, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """Varlen's ``load_rows`` of rows ``rows`` counted from a sequence's first row ``X``: int32
    offsets recomputed for every block, so that no offset tile stays live across the loop
    (the dense kernels' int64 block offset plus a hoisted int32 tile serialized varlen's
    wgmmas on sm_90: compile report)."""
    return load_rows(X + rows[:, None] * stride + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)


@triton.jit
def store_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the first ``n_rows`` rows and HEAD_DIM columns of a (rows, BLOCK_D) tile."""
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def atomic_add_rows(
    ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """Add a (rows, BLOCK_D) fp32 tile into memory with atomics, as ``store_rows`` masks."""
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
def load_row_stat(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    """One fp32 statistic (lse, delta) per row, ``other`` past ``n_rows`` when CHECK_ROWS."""
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def key_padding(KPM, off_b, stride_kpb, stride_kpn, start_n, cols, seq_k):
    """Nonzero where key ``cols`` (counted from ``start_n``) is padding or past seq_k."""
    kpm_row = KPM + off_b * stride_kpb + tl.cast(start_n, tl.int64) * stride_kpn
    return tl.load(kpm_row + (cols - start_n) * stride_kpn, mask=cols < seq_k, other=1)


@triton.jit
def without_padding(x, padding):
    """A (keys, BLOCK_D) tile with the rows of padding keys zeroed: such a key is never
    read, so a NaN or inf in its k or v reaches no output and no gradient (a 0 · NaN in
    a dot would carry it to every row of the tile)."""
    return tl.where(padding[:, None] == 0, x, 0.0)


@triton.jit
def masked_scores(
    qk,
    rows,
    cols,
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
    MASK_KIND: tl.constexpr,  # 0: no attn_mask, 1: bool, 2: additive
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EDGE: tl.constexpr,
    window,
    HAS_WINDOW: tl.constexpr,
):
    """Scores of one tile in log2 units, −inf where a key is not allowed.

    ``rows`` (query indices) and ``cols`` (key indices) broadcast to the tile's shape,
    so the same code serves (query, key) tiles and the transposed (key, query) tiles;
    they start at ``start_m`` and ``start_n``. The masks' tiles are addressed by a scalar
    int64 offset plus int32 offsets inside the tile (the launcher checks they fit).
    Only an EDGE tile may hold keys past seq_k, (causal) keys after a query or (HAS_WINDOW)
    keys more than ``window`` from a query, so only it pays for those compares.
    """
    s = qk * qk_scale
    if HAS_KPM:
        s = tl.where(key_padding(KPM, off_b, stride_kpb, stride_kpn, start_n, cols, seq_k) == 0, s, float("-inf"))
    if MASK_KIND != 0:
        mask_tile = (
            MASK
            + off_b * stride_mb
            + off_h * stride_mh
            + tl.cast(start_m, tl.int64) * stride_mm
            + tl.cast(start_n, tl.int64) * stride_mn
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
            s = tl.where(weighs, s + bias * LOG2E, float("-inf"))
    if EDGE:
        allowed = cols < seq_k
        if IS_CAUSAL:
            allowed &= cols <= rows
        if HAS_WINDOW:  # a sliding window: |j − i| <= window (every windowed tile is an edge tile)
            allowed &= (cols - rows <= window) & (rows - cols <= window)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def dropout_words(
    seed,
    off_bh,
    start_m,
    start_n,
    seq_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS_FIRST: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """The words and bytes that decide z for queries start_m .. start_m + BLOCK_M and keys
    start_n .. start_n + BLOCK_N ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when KEYS_FIRST):
    stream ``off_bh`` = batch · heads + head of ``philox.py``'s attention scheme, drawn in
    the tile's register layout, for ``dropout_mma_apply``; lane pairs share out their
    Philox calls where HAS_DROPOUT is 2 (``launch.kernel_flags``). The kernels apply
    r = 1 / (1 − p) outside the loops where it is linear, else in an existing multiply-add."""
    return dropout_mma_words(seed, off_bh, start_m, start_n, seq_k, BLOCK_M, BLOCK_N, KEYS_FIRST, HAS_DROPOUT == 2)


@triton.jit
def load_head_rows(
    X,
    off_b,
    off_h,
    start,
    first,
    row_offsets,
    rows,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """A (BLOCK, BLOCK_D) tile, rows start .. start + BLOCK of head (off_b, off_h): through
    ``X``'s TMA descriptor when TMA (the copy engine zero-fills past seq and HEAD_DIM and
    needs no address per element), else ``load_rows`` at ``X + first + row_offsets +
    offs_d``, in that order: the scalar int64 offset ``first`` goes into the pointer before
    the int32 offsets of the tile, so no 64-bit index tile is made."""
    if TMA:
        x = X.load([off_b.to(tl.int32), off_h.to(tl.int32), start, 0]).reshape(BLOCK, BLOCK_D)
    else:
        x = load_rows(X + first + row_offsets + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return x


@triton.jit
def sequence(CU_SEQLENS, off_b):
    """(first packed row, length) of varlen sequence ``off_b``; the row as int64."""
    start = tl.load(CU_SEQLENS + off_b)
    return start.to(tl.int64), tl.load(CU_SEQLENS + off_b + 1) - start
