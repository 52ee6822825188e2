"""The dropout mask scheme: Triton tiles vs the PyTorch reference, bit for bit, and its statistics."""

import math

import pytest
import torch
import triton
import triton.language as tl

from slimformer.kernels import philox
from slimformer.kernels.philox import (
    ATTENTION_PHILOX_ROUNDS,
    DECISIONS_PER_CALL,
    _philox4x32,
    dropout_keep_block,
    dropout_keep_mma_block,
    dropout_keep_tile,
    dropout_mma_apply,
    dropout_mma_words,
    dropout_threshold,
    dropout_threshold_and_scale,
)

# Kernels run compiled on a GPU, else interpreted on CPU (conftest sets TRITON_INTERPRET).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _keep_tile_kernel(SEED, OUT, P, first_row, n_rows, col_start, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    threshold, scale = dropout_threshold_and_scale(tl.load(P))
    keep = dropout_keep_tile(tl.load(SEED), first_row + tile_m, col_start, n_cols, threshold, BLOCK_N)
    tl.store(OUT + tile_m[:, None] * BLOCK_N + tile_n[None, :], tl.where(keep, scale, 0.0))


@triton.jit
def _randint4x_kernel(SEED, COUNTERS, OUT, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    words = tl.randint4x(tl.load(SEED), tl.load(COUNTERS + i), ROUNDS)
    for k in tl.static_range(4):
        tl.store(OUT + 4 * i + k, words[k].to(tl.int32, bitcast=True))


def _kernel_tile(seed, p, first_row, block_m, col_start, block_n, n_cols):
    out = torch.empty(block_m, block_n, device=DEVICE)
    p32 = torch.tensor([p], dtype=torch.float32, device=DEVICE)
    _keep_tile_kernel[(1,)](
        seed.to(DEVICE), out, p32, first_row, block_m, col_start, n_cols, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return out.cpu()


@pytest.mark.parametrize("n_cols", [1, 17, 97, 130])
def test_kernel_tiles_equal_the_reference_bit_for_bit(n_cols):
    seed = torch.tensor(0x5EED_1234_ABCD, dtype=torch.int64)
    p = 0.3
    block_m, block_n = 4, 32
    _, scale = dropout_threshold(p)
    for first_row, col_start in [(0, 0), (5, 0), (3, (n_cols - 1) // 16 * 16), (1000003, 96)]:
        got = _kernel_tile(seed, p, first_row, block_m, col_start, block_n, n_cols)
        expected = dropout_keep_block(seed, torch.arange(first_row, first_row + block_m), col_start, block_n, n_cols, p)
        # columns past n_cols are decided too (callers mask them): compare the whole tile
        assert torch.equal(got != 0, expected), (first_row, col_start)
        assert torch.all((got == 0) | (got == torch.tensor(scale, dtype=torch.float32)))


@triton.jit
def _keep_mma_tile_kernel(
    SEED,
    OUT,
    P,
    stream,
    row_start,
    col_start,
    n_cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    LANE_PAIRS: tl.constexpr,
):
    tile_r = tl.arange(0, BLOCK_R)
    tile_c = tl.arange(0, BLOCK_C)
    threshold, _ = dropout_threshold_and_scale(tl.load(P))
    words0, words1, byte = dropout_mma_words(
        tl.load(SEED), stream, row_start, col_start, n_cols, BLOCK_R, BLOCK_C, TRANSPOSED, LANE_PAIRS
    )
    if TRANSPOSED:
        ptrs = OUT + tile_c[:, None] + tile_r[None, :] * BLOCK_C
    else:
        ptrs = OUT + tile_r[:, None] * BLOCK_C + tile_c[None, :]
    ones = tl.full(byte.shape, 1.0, tl.float32).to(OUT.dtype.element_ty)
    tl.store(ptrs, dropout_mma_apply(ones, words0, words1, byte, threshold))


# dropout_mma_apply drops 16-bit elements in pairs and 32-bit ones singly when compiled
DROP_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@pytest.mark.parametrize("lane_pairs", [True, False], ids=["lane-pairs", "no-lane-pairs"])
@pytest.mark.parametrize("transposed", [False, True], ids=["queries-first", "keys-first"])
@pytest.mark.parametrize("block_r, block_c", [(16, 32), (32, 16)])
def test_mma_tiles_equal_the_reference_bit_for_bit(transposed, block_r, block_c, lane_pairs):
    seed = torch.tensor(0x5EED_1234_ABCD, dtype=torch.int64)
    p = 0.3
    n_cols, streams = 97, 3
    whole = dropout_keep_mma_block(seed, streams, 0, 80, 112, n_cols, p)
    # tiles of 32 start at multiples of 32; those of 16 also at odd blocks
    last = (1, 48 if block_r == 16 else 32, 80 if block_c == 16 else 64)
    for (stream, row_start, col_start), dtype in zip([(0, 0, 0), (2, 32, 96), last], DROP_DTYPES):
        out = torch.empty(block_r, block_c, dtype=dtype, device=DEVICE)
        p32 = torch.tensor([p], dtype=torch.float32, device=DEVICE)
        _keep_mma_tile_kernel[(1,)](
            seed.to(DEVICE),
            out,
            p32,
            stream,
            row_start,
            col_start,
            n_cols,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            TRANSPOSED=transposed,
            LANE_PAIRS=lane_pairs,
        )
        expected = whole[stream, row_start : row_start + block_r, col_start : col_start + block_c]
        got = out.cpu()[: expected.shape[0], : expected.shape[1]]
        assert torch.all((got == 0) | (got == 1))
        got = got != 0
        assert torch.equal(got, expected), (stream, row_start, col_start)
    # a block of rows is a slice of the whole matrix, and the bytes of each call decide 4 × 4 elements
    assert torch.equal(dropout_keep_mma_block(seed, streams, 5, 37, 41, n_cols, p), whole[:, 5:37, :41])
    # stream 2, blocks 7 and 8 (= rows 16..31, columns 0..15 and 16..31 at 7 column blocks), group
    # 4 · 1 + 3: word w decides row rows[w], byte b column cols[b]; the words' row parity
    # flips with the column block's
    threshold = dropout_threshold(p)[0]
    for block, rows, cols in [(7, [18, 26, 19, 27], [6, 14, 7, 15]), (8, [19, 27, 18, 26], [22, 30, 23, 31])]:
        counter = torch.tensor([(2 << 32) + 16 * block + 4 * 1 + 3])
        bytes_ = _philox4x32(seed, counter, ATTENTION_PHILOX_ROUNDS).view(torch.uint8).view(4, 4)
        assert torch.equal(whole[2][rows][:, cols], bytes_ >= threshold), block


def test_reference_block_is_a_slice_of_the_whole_matrix():
    seed = torch.tensor(77, dtype=torch.int64)
    whole = dropout_keep_block(seed, torch.arange(9), 0, 130, 130, 0.4)
    for col_start, width in [(0, 130), (1, 17), (15, 2), (16, 16), (113, 17), (129, 1)]:
        block = dropout_keep_block(seed, torch.tensor([8, 2, 5]), col_start, width, 130, 0.4)
        assert torch.equal(block, whole[[8, 2, 5], col_start : col_start + width])
    assert dropout_keep_block(seed, torch.arange(0), 0, 5, 5, 0.4).shape == (0, 5)


@pytest.mark.parametrize("rounds", [10, ATTENTION_PHILOX_ROUNDS])
def test_reference_philox_is_triton_randint4x(rounds):
    # Random123's known-answer vector for Philox-4x32-10 (key 0, counter 0), then
    # tl.randint4x itself on counters that use the high word, under a 64-bit seed.
    assert [w & 0xFFFFFFFF for w in _philox4x32(torch.tensor(0), torch.zeros(1, dtype=torch.int64))[0].tolist()] == [
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    ]
    seed = torch.tensor(0x0123_4567_89AB_CDEF, dtype=torch.int64)
    counters = torch.tensor([0, 1, 2**31, 2**32 + 5, 2**40 + 123456789, 2**62 - 1, 7, 8], dtype=torch.int64)
    words = torch.empty(8, 4, dtype=torch.int32, device=DEVICE)
    _randint4x_kernel[(1,)](seed.to(DEVICE), counters.to(DEVICE), words, BLOCK=8, ROUNDS=rounds)
    assert torch.equal(words.cpu(), _philox4x32(seed, counters.clone(), rounds))


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.9])
def test_drop_rate_is_the_quantised_p_within_binomial_bounds(p):
    threshold, scale = dropout_threshold(p)
    p_eff = threshold / 256
    assert abs(p_eff - p) <= 1 / 512 and scale == pytest.approx(1 / (1 - p_eff), rel=1e-12)
    n = 512 * 512
    keep = dropout_keep_block(torch.tensor(2024), torch.arange(512), 0, 512, 512, p)
    dropped = n - keep.sum().item()
    assert abs(dropped - n * p_eff) < 5 * math.sqrt(n * p_eff * (1 - p_eff))
    # every byte of a Philox call is used: each of the 16 positions drops at the same rate
    per_position = (~keep).view(512, -1, DECISIONS_PER_CALL).float().mean((0, 1))
    assert (per_position - p_eff).abs().max() < 5 * math.sqrt(p_eff * (1 - p_eff) / (n / 16))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mma_scheme_drop_rate_is_the_quantised_p_at_every_byte(p):
    threshold, _ = dropout_threshold(p)
    p_eff = threshold / 256
    keep = dropout_keep_mma_block(torch.tensor(99), 2, 0, 256, 512, 512, p)
    n = keep.numel()
    dropped = n - keep.sum().item()
    assert abs(dropped - n * p_eff) < 5 * math.sqrt(n * p_eff * (1 - p_eff))
    # each of the 16 (word, byte) positions: rows i % 16 in {0, 1, 8, 9} and columns j % 16 likewise
    per_position = (~keep).view(2, 16, 16, 32, 16).float().mean((0, 1, 3))
    positions = [0, 1, 8, 9]
    rates = per_position[positions][:, positions]
    assert (rates - p_eff).abs().max() < 5 * math.sqrt(p_eff * (1 - p_eff) / (n / 256))


def test_threshold_edges():
    assert dropout_threshold(0.0) == (0, 1.0)
    assert dropout_threshold(0.001) == (0, 1.0)  # below 1/512: no dropout
    assert dropout_threshold(0.999)[0] == 255  # never drops everything


def _run_ptx(asm: str, operands: list[torch.Tensor]) -> dict:
    """Execute the straight-line PTX of an inline-asm string on int64 tensors holding 32-bit
    values, elementwise: the few instructions the compiled dropout paths use, bit-exactly.
    ``operands`` are $0, $1, ... (outputs may be None); returns every register by name."""
    regs = {f"${i}": v for i, v in enumerate(operands)}
    low = 0xFFFFFFFF

    def value(token):
        token = token.strip()
        return regs[token] if token in regs else torch.tensor(int(token, 0))

    def prmt(a, b, selector):
        a, b, selector = torch.broadcast_tensors(a, b, selector)
        source = torch.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
        out = torch.zeros_like(a)
        for i in range(4):
            nibble = (selector >> (4 * i)) & 0xF
            picked = source.gather(0, (nibble & 7)[None])[0]
            picked = torch.where(nibble & 8 != 0, (picked >> 7) * 0xFF, picked)  # replicate the byte's sign bit
            out |= picked << (8 * i)
        return out

    def lop3(a, b, c, lut):
        out = torch.zeros_like(a)
        for k in range(8):
            if lut >> k & 1:
                out |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
        return out & low

    body = asm.strip()
    body = body[1:-1] if body.startswith("{") else body  # the block's braces, not mov.b64's
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b64":  # mov.b64 {lo, hi}, t
            halves, source = args.rsplit(",", 1)
            lo, hi = (name.strip() for name in halves.strip(" {}").split(","))
            regs[lo], regs[hi] = regs[source.strip()] & low, regs[source.strip()] >> 32
            continue
        dest, *sources = (token.strip() for token in args.split(","))
        xs = [value(s) for s in sources]
        regs[dest] = {
            "and.b32": lambda: xs[0] & xs[1],
            "or.b32": lambda: xs[0] | xs[1],
            "sub.u32": lambda: (xs[0] - xs[1]) & low,
            "mul.lo.u32": lambda: (xs[0] * xs[1]) & low,
            "mul.wide.u32": lambda: xs[0] * xs[1],
            "lop3.b32": lambda: lop3(xs[0], xs[1], xs[2], int(sources[3], 0)),
            "prmt.b32": lambda: prmt(xs[0], xs[1], xs[2]),
        }[op]()
    return regs


def test_compiled_dropout_math_is_the_interpreted_math():
    """The inline PTX that compiled kernels run (the interpreter cannot) gives the ``tl``
    twin's bits: every byte value at every position against every threshold."""
    values = torch.arange(256)
    t, v, position = (g.reshape(-1) for g in torch.meshgrid(values, values, torch.arange(4), indexing="ij"))
    others = torch.randint(0, 2**32, t.shape, generator=torch.Generator().manual_seed(0))
    word = (others & ~(0xFF << (8 * position))) | (v << (8 * position))
    keep = v >= t
    t4 = t * 0x01010101
    x = torch.randint(1, 2**32, t.shape, generator=torch.Generator().manual_seed(1))  # the bits dropped
    # the byte is one of the 8 of (words0, words1): put the decided word on either side
    other_word = torch.randint(0, 2**32, t.shape, generator=torch.Generator().manual_seed(3))
    high = torch.arange(t.numel()) % 2 == 1
    words0, words1 = torch.where(high, other_word, word), torch.where(high, word, other_word)
    byte = position + 4 * high
    t4_low = t4 & 0x7F7F7F7F
    out = _run_ptx(philox._APPLY_32.value, [None, x, words0, words1, (byte | 8) * 0x1111, t4, t4_low])["$0"]
    assert torch.equal(out, torch.where(keep, x, 0))
    # 16-bit pairs: element 0 in the low half, element 1 decided by another byte of the same two words
    byte_1 = torch.roll(byte, 777)
    keep_1 = (torch.where(byte_1 < 4, words0, words1) >> (8 * (byte_1 % 4))) & 0xFF >= t
    selector = (byte | 8) * 0x11 | (byte_1 | 8) * 0x1100
    out = _run_ptx(
        philox._APPLY_16.value, [None, x, words0, words0, words1, words1, selector, selector, t4, t4, t4_low, t4_low]
    )["$0"]
    assert torch.equal(out, torch.where(keep, x & 0xFFFF, 0) | torch.where(keep_1, x & 0xFFFF0000, 0))
    # the lane pair's byte packing (dK/dV): bytes 2 · half, 2 · half + 1 of low, then of high
    for half in (0, 1):
        selector = torch.tensor(0x7632 if half else 0x5410)
        packed = _run_ptx(philox._PERMUTE.value, [None, words0, words1, selector])["$0"]
        expected = ((words0 >> (16 * half)) & 0xFFFF) | (((words1 >> (16 * half)) & 0xFFFF) << 16)
        assert torch.equal(packed, expected)
    a = torch.randint(0, 2**32, (4096,), generator=torch.Generator().manual_seed(2))
    for asm, multiplier in [
        (philox._MUL_WIDE_A.value, philox._PHILOX_ROUND_A),
        (philox._MUL_WIDE_B.value, philox._PHILOX_ROUND_B),
    ]:
        regs = _run_ptx(asm, [None, None, a])
        assert torch.equal(regs["$0"] * 2**32 + regs["$1"], a * multiplier)


def _without_c_loops(monkeypatch, draw):
    """draw() with the C loops, then with the PyTorch statement alone."""
    if philox._c_philox() is None:
        pytest.skip("no C compiler here: the CPU Philox loops are not built (the PyTorch statement runs)")
    fast = draw()
    monkeypatch.setattr(philox, "_c_philox", lambda: None)
    return fast, draw()


@pytest.mark.parametrize("rounds", [philox.ATTENTION_PHILOX_ROUNDS, 10])
def test_the_c_philox_loop_gives_the_pytorch_statements_words(monkeypatch, rounds):
    counters = torch.randint(0, 2**62, (70001,), generator=torch.Generator().manual_seed(0))
    for seed in (torch.tensor(0), torch.tensor(-1), torch.tensor(0x123456789ABCDEF)):
        fast, slow = _without_c_loops(monkeypatch, lambda s=seed: philox._philox4x32(s, counters, rounds))
        monkeypatch.undo()
        assert torch.equal(fast, slow)


@pytest.mark.parametrize(
    "streams, first_stream, row_start, row_stop, n_block_cols, n_cols, p",
    [
        (1, 0, 0, 1, 1, 1, 0.1),
        (3, 5, 7, 61, 33, 40, 0.25),
        (2, 0, 16, 48, 512, 512, 0.5),
        (4, 9, 100, 117, 3, 301, 0.9),
    ],
)
def test_the_c_attention_keep_loop_gives_the_pytorch_statements_mask(
    monkeypatch, streams, first_stream, row_start, row_stop, n_block_cols, n_cols, p
):
    seed = torch.tensor(-0x123456789ABCDEF)
    fast, slow = _without_c_loops(
        monkeypatch,
        lambda: philox.dropout_keep_mma_block(
            seed, streams, row_start, row_stop, n_block_cols, n_cols, p, first_stream
        ),
    )
    assert fast.shape == slow.shape == (streams, row_stop - row_start, n_block_cols)
    assert torch.equal(fast, slow)
