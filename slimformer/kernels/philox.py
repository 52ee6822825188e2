"""Dropout randomness shared by every kernel: seeds, the mask scheme, and its PyTorch twin.

Dropout masks are never stored. Forward draws one int64 seed tensor from torch's
generator (so ``torch.manual_seed`` reproduces it) and backward regenerates the very
same mask from it.

The scheme. Every dropout site views its tensor as a 2-D *dropout matrix* of
``n_cols`` columns (attention: row ``(b · heads + h) · seq_q + i``, ``n_cols = seq_k``;
norms and MLP activations: one row per token, ``n_cols`` features; ``dropout_add``: the
last dimension is the columns). One Philox-4x32-10 call (``tl.randint4x(seed, counter)``:
key = the seed's two 32-bit halves, counter = (counter's low word, high word, 0, 0),
10 rounds) yields 4 words = 16 bytes, which decide ``G = 16`` consecutive elements of a
row with one byte each, as FlashAttention-2 does:

    element (r, c):  counter = r · ceil(n_cols / 16) + c // 16,  s = c % 16,
                     byte    = byte s % 4 (little-endian) of word s // 4,
                     keep    = byte >= t,      t = min(floor(256 · p + 1/2), 255).

So a tile costs one Philox call per 16 elements (FlashAttention-2's rate) instead of one
per element. The effective drop rate is ``p_eff = t / 256`` (p quantised to the nearest
1/256: 0.1 -> 26/256 = 0.1016, 0.25 exact) and kept elements are scaled by
``1 / (1 - p_eff)``, so the expectation is still exactly the input; a p below 1/512 rounds
to no dropout, and t stops at 255 so that some elements are always kept. 8-bit rather
than 16-bit thresholds: 16 decisions per call instead of 8 halve the generator's cost per
element, which the attention hot loops cannot afford twice (the instruction counts are in
the compile report, bench/results/compile-sm90.md).

The Triton helper below produces keep masks for a [rows, columns] tile with one Philox
call per 16 elements; ``dropout_keep_block`` computes the
same bits in PyTorch (the CPU path and the tests), vectorised over rows and 16-column
groups.

Attention uses a second scheme, laid out for the tensor cores' accumulators. Its scores
live in registers in the MMA layout (the same for wgmma and mma.sync): a thread holds,
of every 16 × 16 block, rows ``r, r + 8`` and columns ``2c, 2c + 1, 2c + 8, 2c + 9``;
the dK/dV kernel holds the transposed tile, keys by queries, in the same layout. Each
16 × 16 block of a (batch, head)'s (seq_q, seq_k) matrix is cut into 16 groups of 4 × 4,
rows ``{2a, 2a + 1, 2a + 8, 2a + 9}`` × columns ``{2b, 2b + 1, 2b + 8, 2b + 9}``, one
Philox-4x32 call each (7 rounds, ``ATTENTION_PHILOX_ROUNDS``):

    element (i, j) of stream s = b · heads + h (b: the batch index, or varlen's sequence):
        counter = (c0, c1) = (((i // 16) · ceil(seq_k / 16) + j // 16) · 16 + 4 · ((i % 8) // 2) + (j % 8) // 2,  s)
        word    = 2 · (i % 2 ^ (j // 16) % 2) + (i % 16) // 8,   byte = 2 · (j % 2) + (j % 16) // 8,
        keep    = byte >= t.

A group lies in two threads in either orientation: lanes ``l`` and ``l ^ 4``, which
hold its rows 2a and 2a + 1 (forward, dQ) or its columns (dK/dV), 8 bytes each: the
words of their row (forward), two bytes of every word (dK/dV). So the call is not made
twice: over two neighbouring 16-blocks along the tile's second index (key blocks 2k,
2k + 1 in the forward and dQ, query blocks in dK/dV), each lane computes the group of
the block whose parity is its own (``i % 2``, or ``j % 2`` in dK/dV), keeps its half
and hands the other to its partner with one ``SHFL.BFLY`` per 32-bit register: two
per call. The ``^ (j // 16) % 2`` in the word makes what a forward lane keeps (words 0
and 1) and sends (2 and 3) the same registers in every lane; in dK/dV a lane packs the
bytes it keeps and sends into two registers each (``PRMT``). An element is then decided
by one of the 8 bytes of a pair of words (its lane's own and the swapped ones): the
byte index (``dropout_mma_words``) is a constant of its register, or a per-lane one.
Tiles of a single 16-block along that index (masked launches' 64 × 16 forward and
16-query dK/dV tiles) compute each call in both lanes, as do launches whose lane
swap is not proven (below). Words and bytes are built in registers from the tile's own
index bits (``tl.join`` and a reshape that Triton maps onto the accumulator layout), so
no random byte goes through shared memory. ``dropout_mma_words`` gives a tile's words and
byte indices, ``dropout_mma_apply`` zeroes the dropped elements,
``dropout_keep_mma_block`` is the PyTorch half.

Compiled, they run a little inline PTX that the interpreter cannot: each Philox product
is one ``mul.wide.u32`` (IMAD.WIDE.U32, both halves) rather than a high and a low
multiply; a word's four decisions are made at once (a byte-wise compare in three
instructions) and applied with a byte permute and an ``and`` per 32-bit register, which
holds two elements of the 16-bit P; and the lane swap is ``shfl.sync.bfly``. The swap is
right only where Triton keeps the swapped dimension on lane bit 2:
``tests/kernels/test_philox_layout.py`` compiles every sm_90 config that a 16-bit
dropout launch takes and checks it in the TTGIR. On sm_80 Triton computes the words in
a blocked layout where lane bit 2 walks another dimension (that test found it), and fp32
dots run on CUDA cores in other layouts, so those launches do not swap
(``attention.launch.kernel_flags``). The ``tl`` twins that the interpreter runs give the same
bits (the swap exchanges the tensor's halves); ``tests/kernels/test_philox.py`` executes
the apply's and the packing's PTX instruction by instruction against them. Per call,
sm_90: about 26 instructions of Philox-4x32-7, made once instead of twice, plus two
shuffles, and ~2 per element to decide and apply.
"""

import ctypes
import functools
import math

import torch
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels import c_loops
from slimformer.kernels.dispatch import plain_eager

DECISIONS_PER_CALL = 16  # G: bytes of one Philox-4x32 output
THRESHOLD_LEVELS = 256  # 8-bit thresholds

_G: tl.constexpr = tl.constexpr(DECISIONS_PER_CALL)
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
# Attention's Philox-4x32 runs 7 rounds, as FlashAttention-2's dropout does
# (csrc/flash_attn/src/philox.cuh): 7 is the fewest rounds with which Philox-4x32 passes
# TestU01's BigCrush (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
# 10 is their default margin).
ATTENTION_PHILOX_ROUNDS = 7
_ROUND_A: tl.constexpr = tl.constexpr(_PHILOX_ROUND_A)
_ROUND_B: tl.constexpr = tl.constexpr(_PHILOX_ROUND_B)
_KEY_A: tl.constexpr = tl.constexpr(_PHILOX_KEY_A)
_KEY_B: tl.constexpr = tl.constexpr(_PHILOX_KEY_B)
_ATTENTION_ROUNDS: tl.constexpr = tl.constexpr(ATTENTION_PHILOX_ROUNDS)
_LOW32 = 0xFFFFFFFF
# Compiled attention tiles use inline PTX (``mul.wide.u32``: one IMAD.WIDE.U32 gives both
# halves of a Philox product, where ``tl.umulhi`` and ``*`` emit IMAD.HI and IMAD); the
# interpreter cannot run PTX, so it takes the ``tl`` twin, which gives the same words.
# Read at import, as Triton's JIT decides at decoration time whether it interprets.
_INLINE_PTX: tl.constexpr = tl.constexpr(not triton.knobs.runtime.interpret)
_MUL_WIDE_A: tl.constexpr = tl.constexpr("{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }")
_MUL_WIDE_B: tl.constexpr = tl.constexpr("{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }")


@triton.jit
def dropout_threshold_and_scale(dropout_p):
    """(t, 1 / (1 - t / 256)) for an fp32 ``dropout_p``: see the module docstring."""
    threshold = tl.minimum(tl.cast(dropout_p * 256.0 + 0.5, tl.int32), 255)
    return threshold.to(tl.uint32), 256.0 / (256 - threshold).to(tl.float32)


@triton.jit
def _join4(a0, a1, a2, a3):
    """[..., 4] with [..., i] = a_i (two trailing dims of 2, i = 2 · outer + inner)."""
    return tl.join(tl.join(a0, a2), tl.join(a1, a3))


@triton.jit
def _keep_bytes(seed, counters, threshold):
    """Keep decisions [*counters.shape, 2, 2, 2, 2] (flattened trailing index s = 4 · word + byte)."""
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    words = _join4(w0, w1, w2, w3)
    # byte b of w is >= t  <=>  w << (24 - 8b) >= t << 24 as unsigned 32-bit words.
    t = threshold << 24
    return _join4(words << 24 >= t, words << 16 >= t, words << 8 >= t, words >= t)


@triton.jit
def dropout_keep_tile(seed, rows, col_start, n_cols, threshold, BLOCK_N: tl.constexpr):
    """Keep mask [BLOCK_M, BLOCK_N] of dropout-matrix rows ``rows`` ([BLOCK_M] ints) and
    columns ``col_start + arange(BLOCK_N)``; col_start and BLOCK_N multiples of 16.

    seed: int64 scalar; threshold: from ``dropout_threshold_and_scale``. Columns past
    n_cols get decisions too (they belong to the row's last Philox call or to calls no
    element uses); callers mask them.
    """
    calls_per_row = (n_cols + (_G - 1)) // _G
    groups = col_start // _G + tl.arange(0, BLOCK_N // _G)
    counters = rows.to(tl.int64)[:, None] * calls_per_row + groups[None, :]
    keep = _keep_bytes(seed, counters, threshold)
    return tl.reshape(keep, (rows.shape[0], BLOCK_N))


@triton.jit
def _mul_hi_lo(a, B_ROUND: tl.constexpr):
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 ``a`` and Philox's round
    multiplier (A, or B with B_ROUND)."""
    if _INLINE_PTX:
        asm: tl.constexpr = _MUL_WIDE_B if B_ROUND else _MUL_WIDE_A
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        multiplier: tl.constexpr = _ROUND_B if B_ROUND else _ROUND_A
        return tl.umulhi(a, multiplier), a * multiplier


@triton.jit
def _philox_zero_high(seed, c0, c1):
    """``tl.philox(seed, c0, c1, 0, 0, ATTENTION_PHILOX_ROUNDS)`` for uint32 c0 and a scalar uint32 c1,
    with round 1 specialised to c2 = c3 = 0 and c1 kept scalar until it mixes with c0."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c2, c3 = _mul_hi_lo(c0, False)
    c2 = c2 ^ k1
    c0 = c1 ^ k0
    c1 = tl.zeros_like(c2)
    for _ in tl.static_range(_ATTENTION_ROUNDS - 1):
        k0 += _KEY_A
        k1 += _KEY_B
        hi_b, lo_b = _mul_hi_lo(c2, True)
        hi_a, lo_a = _mul_hi_lo(c0, False)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
    return c0, c1, c2, c3


@triton.jit
def _copies22(word):
    """[..., 2, 2] copies of ``word``."""
    pair = tl.join(word, word)
    return tl.join(pair, pair)


@triton.jit
def _copies222(word):
    """[..., 2, 2, 2] copies of ``word``."""
    quad = _copies22(word)
    return tl.join(quad, quad)


# Compiled, the words a lane hands its partner (lane ^ 4: the one holding the other row,
# or key, parity of the same 4 × 4 groups) move with one SHFL each. Right only where the
# exchanged dimension is lane bit 2, which ``tests/kernels/test_philox_layout.py`` checks
# in the compiled attention kernels' TTGIR; the interpreter swaps the dimension instead.
_SWAP_LANE4: tl.constexpr = tl.constexpr("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;")
_PERMUTE: tl.constexpr = tl.constexpr("prmt.b32 $0, $1, $2, $3;")


@triton.jit
def _swap_pairs(x):
    """x [A, B, 2, C, D] with its dimension 2 swapped: the partner's values."""
    if _INLINE_PTX:
        return tl.inline_asm_elementwise(_SWAP_LANE4, "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        low, high = tl.split(tl.permute(x, (0, 1, 3, 4, 2)))
        return tl.permute(tl.join(high, low), (0, 1, 4, 2, 3))


@triton.jit
def _byte_pairs(low, high, half):
    """Bytes 2 · half and 2 · half + 1 of ``low`` then of ``high``, as one word."""
    if _INLINE_PTX:
        selector = tl.where(half == 0, 0x5410, 0x7632).to(tl.uint32)
        return tl.inline_asm_elementwise(
            _PERMUTE, "=r,r,r,r", [low, high, selector], dtype=tl.uint32, is_pure=True, pack=1
        )
    else:
        shift = (16 * half).to(tl.uint32)
        return ((low >> shift) & 0xFFFF) | (((high >> shift) & 0xFFFF) << 16)


@triton.jit
def dropout_mma_words(
    seed,
    stream,
    row_start,
    col_start,
    n_cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    LANE_PAIRS: tl.constexpr,
):
    """(words0, words1, byte), uint32 [BLOCK_R, BLOCK_C]: what decides each element of rows
    ``row_start + arange(BLOCK_R)`` and columns ``col_start + arange(BLOCK_C)`` of stream
    ``stream``'s dropout matrix (``n_cols`` columns): byte ``byte`` (0..7) of the 8 bytes of
    (words0, words1); with TRANSPOSED all three are [BLOCK_C, BLOCK_R], the transpose. The
    attention scheme of the module docstring; ``dropout_mma_apply`` drops with them.
    row_start, col_start, BLOCK_R, BLOCK_C: multiples of 16, and row_start (col_start) a
    multiple of 32 where BLOCK_R (BLOCK_C) is. LANE_PAIRS: the tile is a
    tensor-core accumulator (wgmma or mma.sync), the only layout the lane swap is right in.
    In every orientation the words of columns 2c and 2c + 1 (of the [BLOCK_X, BLOCK_Y]
    tile) are equal, as ``dropout_mma_apply`` needs for 16-bit tiles.

    x, y: the tile's first and second index. Each lane pair (lane, lane ^ 4: x % 2 = 0, 1)
    holds half of the same 4 × 4 group in each 16 × 16 block; over two blocks along y
    (when BLOCK_Y >= 32) each lane computes one of the two groups, keeps its own half and
    swaps the other with its partner. Everything is built on [x // 16, x % 8 // 2, x % 2,
    y // 32, y % 8 // 2]-shaped tensors and reshaped, which is the order of the accumulator
    layout's lanes and registers; the bytes come from the tile's own index bits.
    """
    BLOCK_X: tl.constexpr = BLOCK_C if TRANSPOSED else BLOCK_R
    BLOCK_Y: tl.constexpr = BLOCK_R if TRANSPOSED else BLOCK_C
    PAIRED: tl.constexpr = LANE_PAIRS and BLOCK_Y >= 32
    HALVES: tl.constexpr = 2 if PAIRED else 1  # the y blocks one lane pair shares out
    x_blocks = tl.arange(0, BLOCK_X // 16)[:, None, None, None, None]
    x_pairs = tl.arange(0, 4)[None, :, None, None, None]
    half = tl.arange(0, HALVES)[None, None, :, None, None]  # = x % 2 of the lane that computes it
    if PAIRED:
        y_blocks = 2 * tl.arange(0, BLOCK_Y // 32)[None, None, None, :, None] + half
    else:
        y_blocks = tl.arange(0, BLOCK_Y // 16)[None, None, None, :, None]
    y_pairs = tl.arange(0, 4)[None, None, None, None, :]
    col_blocks = (n_cols + 15) // 16
    if TRANSPOSED:
        block = (row_start // 16 + y_blocks) * col_blocks + col_start // 16 + x_blocks
        group = 4 * y_pairs + x_pairs
    else:
        block = (row_start // 16 + x_blocks) * col_blocks + col_start // 16 + y_blocks
        group = 4 * x_pairs + y_pairs
    counters = (block * 16 + group).to(tl.uint32)
    w0, w1, w2, w3 = _philox_zero_high(seed, counters, stream.to(tl.uint32))
    x = tl.arange(0, BLOCK_X)[:, None]
    y = tl.arange(0, BLOCK_Y)[None, :]
    # The key block's parity: from the tile's own index bits where it holds two key blocks
    # (so that the byte indices are constants of the registers), else the tile's.
    BLOCK_KEYS: tl.constexpr = BLOCK_X if TRANSPOSED else BLOCK_Y
    if BLOCK_KEYS >= 32:
        key_parity = (x if TRANSPOSED else y) // 16 % 2
    else:
        key_parity = (col_start // 16) % 2
    if not PAIRED:
        # both lanes of a pair compute the group; each element's word is picked here
        if TRANSPOSED:
            # x: keys (byte 2 · (x % 2) + x % 16 // 8); y: queries (word 2 · (y % 2 ^ key block % 2) + y % 16 // 8).
            # Queries 2c and 2c + 1 read different words, but the 16-bit apply decides both
            # from one pair: words0 holds the even query's word, words1 the odd one's, and
            # the query's parity goes into the byte index.
            # x % 2 (lane bit 2) as a broadcast dimension: a joined one would be registers
            key_odd = tl.zeros([1, 1, 2, 1, 1], tl.int32) + (x_blocks % 2 if BLOCK_KEYS >= 32 else key_parity)
            even = key_odd == 0
            even_query_words = tl.join(tl.where(even, w0, w2), tl.where(even, w1, w3))
            odd_query_words = tl.join(tl.where(even, w2, w0), tl.where(even, w3, w1))
            # [x // 16, x % 8 // 2, x % 2, y // 16, y % 8 // 2, y % 16 // 8, x % 16 // 8, y % 2]
            words0 = tl.permute(_copies22(even_query_words), (0, 6, 1, 2, 3, 5, 4, 7))
            words1 = tl.permute(_copies22(odd_query_words), (0, 6, 1, 2, 3, 5, 4, 7))
            byte = 4 * (y % 2) + 2 * (x % 2) + x % 16 // 8
        else:
            # x: queries (word 2 · (x % 2 ^ key block % 2) + x % 16 // 8); y: keys (byte 2 · (y % 2) + y % 16 // 8)
            low = (tl.arange(0, 2)[None, None, :, None, None] ^ (y_blocks % 2 if BLOCK_KEYS >= 32 else key_parity)) == 0
            words = tl.join(tl.where(low, w0, w2), tl.where(low, w1, w3))
            # [x // 16, x % 8 // 2, x % 2, y // 16, y % 8 // 2, x % 16 // 8, y % 16 // 8, y % 2]
            words = tl.permute(_copies22(words), (0, 5, 1, 2, 3, 6, 4, 7))
            byte = 2 * (y % 2) + y % 16 // 8
            words0 = words
            words1 = words
    elif TRANSPOSED:
        if BLOCK_KEYS < 32:  # one key block: its words relabelled
            odd = key_parity == 1
            w0, w1, w2, w3 = tl.where(odd, w2, w0), tl.where(odd, w3, w1), tl.where(odd, w0, w2), tl.where(odd, w1, w3)
            key_parity = 0
        # x: keys (byte 2 · (x % 2) + x % 16 // 8); y: queries (word 2 · (y % 2 ^ key block % 2) + y % 16 // 8).
        # The lane of key parity `half` uses bytes 2 · half, 2 · half + 1 of every word: packed.
        a0, a1 = _byte_pairs(w0, w2, half), _byte_pairs(w1, w3, half)
        b0, b1 = _swap_pairs(_byte_pairs(w0, w2, 1 - half)), _swap_pairs(_byte_pairs(w1, w3, 1 - half))
        partners = y // 16 % 2 ^ x % 2  # the query block the partner computed
        byte = 2 * (y % 2 ^ key_parity) + x % 16 // 8 + 4 * partners
        # [x // 16, x % 8 // 2, x % 2, y // 32, y % 8 // 2, y % 16 // 8, y % 32 // 16, x % 16 // 8, y % 2]
        words0 = tl.permute(_copies222(tl.join(a0, a1)), (0, 7, 1, 2, 3, 6, 5, 4, 8))
        words1 = tl.permute(_copies222(tl.join(b0, b1)), (0, 7, 1, 2, 3, 6, 5, 4, 8))
    else:
        # x: queries, y: keys; the lane of query parity `half` computes the group of key block
        # 2 · (y // 32) + half and keeps its words 0, 1 (its rows'), the partner's 2, 3 swapped in
        byte = 4 * (x % 2 ^ key_parity) + 2 * (y % 2) + y % 16 // 8
        # [x // 16, x % 8 // 2, x % 2, y // 32, y % 8 // 2, x % 16 // 8, y % 32 // 16, y % 16 // 8, y % 2]
        words0 = tl.permute(_copies222(tl.join(w0, w1)), (0, 5, 1, 2, 3, 6, 7, 4, 8))
        words1 = tl.permute(_copies222(tl.join(_swap_pairs(w2), _swap_pairs(w3))), (0, 5, 1, 2, 3, 6, 7, 4, 8))
    byte = tl.broadcast_to(byte, (BLOCK_X, BLOCK_Y)).to(tl.uint32)
    return tl.reshape(words0, (BLOCK_X, BLOCK_Y)), tl.reshape(words1, (BLOCK_X, BLOCK_Y)), byte


# Inline PTX of ``dropout_mma_apply``, one element per 32-bit lane of x or two per 16-bit
# pair (which share their two words: adjacent columns of one group, or of the two groups
# of a lane pair). f = the byte-wise w >= t of a word w, t4 = t in every byte, in bit 7
# of each byte: d = (w | 0x80808080) − (t4 & 0x7F7F7F7F) carries no borrow between bytes
# and its bit 7 is (low 7 bits of w's byte) >= (t's), so w >= t is (w7 & ~t7) |
# (~(w7 ^ t7) & d7), one lop3 (0xB2); prmt with sign-replicating selector nibbles (8 |
# byte) copies each element's bit 7, from f of words0 or of words1, to all its bytes: the
# mask that x is and-ed with. The selectors and t4 & 0x7F7F7F7F come in as operands: they
# do not change in the loops, and outside the asm the compiler hoists them.
_APPLY_16: tl.constexpr = tl.constexpr("""{
.reg .b32 d, m, f0, f1;
or.b32 d, $2, 0x80808080;
sub.u32 d, d, $10;
lop3.b32 f0, $2, $8, d, 0xB2;
or.b32 d, $4, 0x80808080;
sub.u32 d, d, $10;
lop3.b32 f1, $4, $8, d, 0xB2;
prmt.b32 m, f0, f1, $6;
and.b32 $0, $1, m;
}""")
_APPLY_32: tl.constexpr = tl.constexpr("""{
.reg .b32 d, m, f0, f1;
or.b32 d, $2, 0x80808080;
sub.u32 d, d, $6;
lop3.b32 f0, $2, $5, d, 0xB2;
or.b32 d, $3, 0x80808080;
sub.u32 d, d, $6;
lop3.b32 f1, $3, $5, d, 0xB2;
prmt.b32 m, f0, f1, $4;
and.b32 $0, $1, m;
}""")


@triton.jit
def dropout_mma_apply(x, words0, words1, byte, threshold):
    """``x`` where byte ``byte`` of (``words0``, ``words1``) (``dropout_mma_words``: bytes 0..3
    of words0, then of words1) is >= ``threshold`` (``dropout_threshold_and_scale``), else 0;
    x: 16- or 32-bit floats of the words' shape [M, N].

    Compiled, a word's four decisions are made by three instructions and applied with a
    byte permute and an and per element (16-bit: per pair of columns 2c, 2c + 1, one
    register, decided by column 2c's words, which ``dropout_mma_words`` makes column
    2c + 1's too); the interpreter (and other element sizes) compares byte by byte, with
    the same result, reading a 16-bit pair's words from column 2c as compiled code does.
    """
    BITS: tl.constexpr = x.dtype.primitive_bitwidth
    if _INLINE_PTX and (BITS == 16 or BITS == 32):
        t4 = threshold * 0x01010101
        t4_low = t4 & 0x7F7F7F7F
        nibble = byte | 8
        if BITS == 16:
            # the pair's selector: element 0's mask in bytes 0-1, element 1's in bytes 2-3
            even, odd = tl.split(tl.reshape(nibble, (x.shape[0], x.shape[1] // 2, 2)))
            selector = even * 0x11 | odd * 0x1100
            selector = tl.reshape(tl.join(selector, selector), (x.shape[0], x.shape[1]))
            bits = tl.inline_asm_elementwise(
                _APPLY_16,
                "=r,r,r,r,r,r,r,r,r,r,r,r",
                [x.to(tl.uint16, bitcast=True), words0, words1, selector, t4, t4_low],
                dtype=tl.uint16,
                is_pure=True,
                pack=2,
            )
            return bits.to(x.dtype, bitcast=True)
        else:
            bits = tl.inline_asm_elementwise(
                _APPLY_32,
                "=r,r,r,r,r,r,r",
                [x.to(tl.uint32, bitcast=True), words0, words1, nibble * 0x1111, t4, t4_low],
                dtype=tl.uint32,
                is_pure=True,
                pack=1,
            )
            return bits.to(x.dtype, bitcast=True)
    else:
        if BITS == 16:
            # as compiled: a pair of columns is one register, decided by the first one's words
            words0 = _first_of_column_pairs(words0)
            words1 = _first_of_column_pairs(words1)
        words = tl.where(byte < 4, words0, words1)
        return tl.where((words >> (8 * (byte % 4))) & 0xFF >= threshold, x, 0.0)


@triton.jit
def _first_of_column_pairs(words):
    """[M, N] ``words`` with column 2c + 1 replaced by column 2c."""
    first, _ = tl.split(tl.reshape(words, (words.shape[0], words.shape[1] // 2, 2)))
    return tl.reshape(tl.join(first, first), (words.shape[0], words.shape[1]))


# An opaque op, so that torch.compile draws the seed from torch's generator exactly as
# eager mode does (inductor would lower a traced randint to its own RNG, giving other
# masks). AOTAutograd's CSE merges calls with equal arguments (it spares only aten's own
# random ops), so each call names the tensor it is drawn for and the kind of op.
@torch.library.custom_op("slimformer::dropout_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropout_seed(device: torch.device, drawn_for: torch.Tensor | None, site: str) -> torch.Tensor:
    return _draw_seed(device)


def _draw_seed(device: torch.device) -> torch.Tensor:
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


@_dropout_seed.register_fake
def _(device, drawn_for, site):
    return torch.empty((), dtype=torch.int64, device=device)


def new_dropout_seed(device: torch.device, drawn_for: torch.Tensor | None = None, site: str = "") -> torch.Tensor:
    """A fresh int64 seed (shape ()) from torch's generator on ``device``, no host sync.

    ``drawn_for`` (the tensor dropped out) and ``site`` (the op's name) keep the draws of
    different dropout sites apart in a compiled graph: pass them from every op. In plain
    eager mode (``dispatch.plain_eager``: nothing traces or intercepts the call) the op's
    body is called without the op's dispatch: the same draw from the same generator.
    """
    if plain_eager((drawn_for,)):
        return _draw_seed(device)
    return _dropout_seed(device, drawn_for, site)


def dropout_threshold(p: float) -> tuple[int, float]:
    """(t, scale): drop where the byte is < t; kept elements are multiplied by scale.

    Computed from p rounded to fp32, as the kernels receive it.
    """
    # fp32(p) · 256 + 1/2 is exact in fp32 below 256, so float64 gives the kernels' value.
    mantissa, exponent = math.frexp(p)
    p32 = math.ldexp(round(mantissa * 2**24), exponent - 24)  # p rounded to fp32 (24-bit significand)
    threshold = min(math.floor(p32 * 256 + 0.5), THRESHOLD_LEVELS - 1)
    return threshold, THRESHOLD_LEVELS / (THRESHOLD_LEVELS - threshold)


_C_SOURCE = r"""
#include <stdint.h>

/* Philox4x32 of the counter (c0, c1) = (low, high word of counter), c2 = c3 = 0, into
   words[0 .. 3], as tl.randint4x draws them. */
static inline void philox_one(uint64_t seed, uint64_t counter, int rounds, uint32_t* words) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
  uint32_t key0 = (uint32_t)seed, key1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < rounds; ++r) {
    uint64_t product_a = (uint64_t)0xD2511F53u * c0, product_b = (uint64_t)0xCD9E8D57u * c2;
    c0 = (uint32_t)(product_b >> 32) ^ c1 ^ key0;
    c2 = (uint32_t)(product_a >> 32) ^ c3 ^ key1;
    c1 = (uint32_t)product_b;
    c3 = (uint32_t)product_a;
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  words[0] = c0;
  words[1] = c1;
  words[2] = c2;
  words[3] = c3;
}

/* The words of counters[0 .. n - 1] into out[4i .. 4i + 3]. */
void philox4x32(uint64_t seed, const int64_t* counters, int64_t n, int rounds, uint32_t* out, int threads) {
  #pragma omp parallel for num_threads(threads) if(threads > 1)
  for (int64_t i = 0; i < n; ++i) philox_one(seed, (uint64_t)counters[i], rounds, out + 4 * i);
}

/* Keep decisions (streams, row_stop - row_start, n_block_cols) of the attention scheme
   (dropout_keep_mma_block): one Philox call per (stream, 16-row block ib, row pair a,
   16-column block jb, column pair b), whose 16 bytes decide rows ib·16 + 8·ih + 2·a + io
   and columns jb·16 + 8·jh + 2·b + jo by byte 2·jo + jh of word 2·(io ^ jb % 2) + ih. */
void attention_keep(uint64_t seed, int64_t first_stream, int64_t streams, int64_t row_start, int64_t row_stop,
                    int64_t n_block_cols, int64_t n_cols, int threshold, int rounds, uint8_t* out, int threads) {
  int64_t rows = row_stop - row_start, col_blocks = (n_cols + 15) / 16, used_col_blocks = (n_block_cols + 15) / 16;
  int64_t first_block = row_start / 16, end_block = (row_stop + 15) / 16;
  int64_t tasks = streams * (end_block - first_block);
  #pragma omp parallel for num_threads(threads) if(threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    int64_t s = task / (end_block - first_block), ib = first_block + task % (end_block - first_block);
    uint8_t* plane = out + s * rows * n_block_cols;
    for (int64_t jb = 0; jb < used_col_blocks; ++jb) {
      for (int a = 0; a < 4; ++a) {
        for (int b = 0; b < 4; ++b) {
          uint64_t counter = ((uint64_t)(first_stream + s) << 32) + (uint64_t)((ib * col_blocks + jb) * 16 + 4 * a + b);
          uint32_t words[4];
          philox_one(seed, counter, rounds, words);
          for (int ih = 0; ih < 2; ++ih) {
            for (int io = 0; io < 2; ++io) {
              int64_t i = ib * 16 + 8 * ih + 2 * a + io;
              if (i < row_start || i >= row_stop) continue;
              uint32_t word = words[2 * (io ^ (int)(jb & 1)) + ih];
              for (int jh = 0; jh < 2; ++jh) {
                for (int jo = 0; jo < 2; ++jo) {
                  int64_t j = jb * 16 + 8 * jh + 2 * b + jo;
                  if (j >= n_block_cols) continue;
                  plane[(i - row_start) * n_block_cols + j] = ((word >> (8 * (2 * jo + jh))) & 0xFF) >= (uint32_t)threshold;
                }
              }
            }
          }
        }
      }
    }
  }
}
"""
# Counters below which the rounds run on the calling thread.
_C_GRAIN = 16384


@functools.cache
def _c_philox():
    """The C loop of ``_philox4x32`` (``c_loops``), or None without a C compiler."""
    i64, pointer, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "philox4x32": [ctypes.c_uint64, pointer, i64, c_int, pointer, c_int],
        "attention_keep": [ctypes.c_uint64, i64, i64, i64, i64, i64, i64, c_int, c_int, pointer, c_int],
    }
    return c_loops.load(
        "philox",
        _C_SOURCE,
        signatures,
        "the CPU Philox loop",
        "dropout masks on the CPU path are drawn by PyTorch ops (slower, same bits)",
    )


def _runs_c_loops(tensor: torch.Tensor) -> bool:
    """Whether a CPU draw on ``tensor`` may take the C loops: a plain CPU tensor (not a fake
    or traced one), outside torch.compile's tracing."""
    return tensor.device.type == "cpu" and type(tensor) is torch.Tensor and not torch.compiler.is_compiling()


def _seed_bits(seed: torch.Tensor) -> int:
    """The seed's 64 bits as an unsigned int (a CPU tensor: no device sync)."""
    return int(seed) & 0xFFFFFFFFFFFFFFFF


def _philox4x32(seed: torch.Tensor, counters: torch.Tensor, rounds: int = _PHILOX_ROUNDS) -> torch.Tensor:
    """``tl.randint4x(seed, counters, rounds)`` for int64 counters >= 0: int32 (*counters.shape, 4).
    On the CPU, outside torch.compile's tracing, one C loop (``_C_SOURCE``) when it builds;
    else the PyTorch statement below, which gives the same bits.

    Words are held in int64 with only their low 32 bits meaningful ("dirty" high bits),
    and cleaned only where a product needs them: a uint32 · uint32 product fits 64 bits,
    int64 wraps with the same bit pattern, and its high word is (product >> 32)'s low half.
    """
    library = _c_philox() if _runs_c_loops(counters) else None
    if library is not None:
        counters = counters.contiguous()
        words = torch.empty((*counters.shape, 4), dtype=torch.int32)
        threads = 1 if counters.numel() < _C_GRAIN else torch.get_num_threads()
        library.philox4x32(_seed_bits(seed), counters.data_ptr(), counters.numel(), rounds, words.data_ptr(), threads)
        return words
    # the keys stay tensors (no host sync, and torch.compile traces them)
    seed = seed.to(torch.int64)
    key0 = seed & _LOW32
    key1 = (seed >> 32) & _LOW32
    c1 = counters >> 32
    c0 = counters & _LOW32
    # Round 1 with c2 = c3 = 0: c0' = c1 ^ k0, c1' = 0, c2' = hi(A·c0) ^ k1, c3' = lo(A·c0).
    c3 = c0.mul_(_PHILOX_ROUND_A)
    c2 = c3 >> 32
    c2 &= _LOW32
    c2 ^= key1
    c0 = c1.bitwise_xor_(key0)
    c1 = torch.zeros_like(c0)
    spare = torch.empty_like(c0)
    for _ in range(rounds - 1):
        key0 = (key0 + _PHILOX_KEY_A) & _LOW32
        key1 = (key1 + _PHILOX_KEY_B) & _LOW32
        # c0' = hi(B·c2) ^ c1 ^ k0, c1' = lo(B·c2), c2' = hi(A·c0) ^ c3 ^ k1, c3' = lo(A·c0)
        product_a = torch.mul(c0.bitwise_and_(_LOW32), _PHILOX_ROUND_A, out=spare)
        product_b = c2.mul_(_PHILOX_ROUND_B)
        new_c0 = torch.bitwise_right_shift(product_b, 32, out=c0).bitwise_xor_(c1).bitwise_xor_(key0)
        new_c2 = torch.bitwise_right_shift(product_a, 32, out=c1).bitwise_xor_(c3).bitwise_xor_(key1)
        spare = c3
        c0, c1, c2, c3 = new_c0, product_b, new_c2.bitwise_and_(_LOW32), product_a
    words = torch.empty((*counters.shape, 4), dtype=torch.int32, device=counters.device)
    for i, word in enumerate((c0, c1, c2, c3)):
        words[..., i] = word  # int64 -> int32 keeps the low 32 bits
    return words


def dropout_keep_block(
    seed: torch.Tensor, rows: torch.Tensor, col_start: int, n_block_cols: int, n_cols: int, p: float
) -> torch.Tensor:
    """Keep mask (len(rows), n_block_cols) of a dropout-matrix block, as the kernels draw it.

    seed: int64 tensor, shape (); rows: 1-D integer tensor of row indices (any order);
    columns col_start .. col_start + n_block_cols - 1 of a matrix with n_cols columns.
    Only ceil(n_block_cols / 16) + 1 Philox counters per row are computed.
    """
    rows = rows.reshape(-1).to(torch.int64)
    if rows.numel() == 0 or n_block_cols <= 0:
        return torch.ones((rows.numel(), max(n_block_cols, 0)), dtype=torch.bool, device=rows.device)
    threshold, _ = dropout_threshold(p)
    first_group = col_start // DECISIONS_PER_CALL
    end_group = (col_start + n_block_cols - 1) // DECISIONS_PER_CALL + 1
    calls_per_row = -(-n_cols // DECISIONS_PER_CALL)
    counters = torch.arange(first_group, end_group, dtype=torch.int64, device=rows.device).expand(rows.numel(), -1)
    counters = torch.addcmul(counters, rows[:, None], torch.tensor(calls_per_row, device=rows.device))
    decision_bytes = _philox4x32(seed, counters).view(torch.uint8).view(rows.numel(), -1)
    start = col_start - first_group * DECISIONS_PER_CALL
    return decision_bytes[:, start : start + n_block_cols] >= threshold


def dropout_keep_mma_block(
    seed: torch.Tensor,
    streams: int,
    row_start: int,
    row_stop: int,
    n_block_cols: int,
    n_cols: int,
    p: float,
    first_stream: int = 0,
) -> torch.Tensor:
    """Keep mask (streams, row_stop − row_start, n_block_cols) of rows row_start:row_stop and
    columns 0:n_block_cols of the dropout matrices (n_cols columns) of streams first_stream ..
    first_stream + streams − 1, as ``dropout_mma_words`` and ``dropout_mma_apply`` draw it (the
    attention scheme of the module docstring)."""
    device = seed.device
    if streams == 0 or row_stop <= row_start or n_block_cols <= 0:
        return torch.ones(
            (streams, max(row_stop - row_start, 0), max(n_block_cols, 0)), dtype=torch.bool, device=device
        )
    threshold, _ = dropout_threshold(p)
    library = _c_philox() if _runs_c_loops(seed) else None
    if library is not None:
        keep = torch.empty((streams, row_stop - row_start, n_block_cols), dtype=torch.bool)
        threads = 1 if keep.numel() < 16 * _C_GRAIN else torch.get_num_threads()
        library.attention_keep(
            _seed_bits(seed), first_stream, streams, row_start, row_stop, n_block_cols, n_cols, threshold,
            ATTENTION_PHILOX_ROUNDS, keep.data_ptr(), threads,
        )  # fmt: skip
        return keep
    first_block, end_block = row_start // 16, -(-row_stop // 16)
    col_blocks = -(-n_block_cols // 16)
    row_blocks = torch.arange(first_block, end_block, device=device)[:, None, None, None]
    pairs = torch.arange(4, device=device)
    blocks = row_blocks * (-(-n_cols // 16)) + torch.arange(col_blocks, device=device)[None, None, :, None]
    groups = blocks * 16 + 4 * pairs[None, :, None, None] + pairs[None, None, None, :]
    counters = groups + (torch.arange(first_stream, first_stream + streams, device=device) << 32).view(-1, 1, 1, 1, 1)
    # [stream, i // 16, i % 8 // 2, j // 16, j % 8 // 2, word // 2, i % 16 // 8, j % 2, j % 16 // 8]
    decision_bytes = _philox4x32(seed, counters, ATTENTION_PHILOX_ROUNDS).view(torch.uint8)
    decision_bytes = decision_bytes.view(*counters.shape, 2, 2, 2, 2)
    # word // 2 = i % 2 ^ (j // 16) % 2
    odd_blocks = (torch.arange(col_blocks, device=device) % 2 == 1).view(1, 1, 1, -1, 1, 1, 1, 1)
    low, high = decision_bytes[..., 0, :, :, :], decision_bytes[..., 1, :, :, :]
    by_row_parity = torch.stack((torch.where(odd_blocks, high, low), torch.where(odd_blocks, low, high)), dim=-1)
    # -> [stream, i // 16, i % 16 // 8, i % 8 // 2, i % 2, j // 16, j % 16 // 8, j % 8 // 2, j % 2]
    rows = rearrange(by_row_parity, "s ib ip jb jp ih jo jh io -> s (ib ih ip io) (jb jh jp jo)")
    start = row_start - first_block * 16
    return rows[:, start : start + row_stop - row_start, :n_block_cols] >= threshold
