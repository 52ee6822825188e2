"""GEMM and int8 quantization kernels vs PyTorch at awkward shapes.

CPU tests run through the ``backend`` fixture: the interpreted Triton kernel and the
PyTorch reference. Float GEMMs are bounded by PyTorch's own error against float64;
int8 GEMMs are checked against the exact integer product, dequantized in float64.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from slimformer.kernels import int8_cpu, matmul
from slimformer.kernels.matmul import (
    int8_linear,
    int8_matmul,
    int8_weight_only_linear,
    linear,
    quantize_per_channel,
    quantize_per_token,
)
from tests.helpers import assert_within_reference_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, K, N): M = 1, a prime, one past two blocks; K, N off every block size.
SHAPES = [(1, 5, 3), (7, 33, 17), (33, 100, 70)]
EPILOGUES = [(None, False), (None, True), ("gelu", True), ("relu", True)]


def _activation(y, activation):
    if activation == "gelu":
        return F.gelu(y)
    return F.relu(y) if activation == "relu" else y


def _inputs(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    return x, weight, bias


def sqnr_db(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """10 log10(|exact|² / |actual - exact|²)."""
    exact = exact.double()
    noise = (actual.double() - exact).square().sum()
    return (10 * torch.log10(exact.square().sum() / noise)).item()


@pytest.mark.parametrize("activation, with_bias", EPILOGUES, ids=["plain", "bias", "bias-gelu", "bias-relu"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_matches_torch(backend, dtype, shape, activation, with_bias):
    x, weight, bias = _inputs(*shape, dtype)
    bias = bias.to(dtype) if with_bias else None
    ours = linear(x, weight, bias, activation=activation)
    torch_same_dtype = _activation(F.linear(x, weight, bias), activation)
    exact = _activation(F.linear(x.double(), weight.double(), None if bias is None else bias.double()), activation)
    assert ours.dtype == dtype
    assert_within_reference_error("linear", ours, torch_same_dtype, exact)


def test_linear_keeps_leading_dimensions_and_empty_batches(backend):
    x, weight, bias = _inputs(6, 40, 9, torch.float32)
    y = linear(x.view(2, 3, 40), weight, bias)
    assert y.shape == (2, 3, 9)
    torch.testing.assert_close(y.view(6, 9), F.linear(x, weight, bias))
    empty = linear(torch.empty(0, 4, 40), weight, bias)
    assert empty.shape == (0, 4, 9)


def test_linear_with_no_input_features_gives_the_bias(backend):
    bias = torch.randn(5)
    y = linear(torch.empty(3, 0), torch.empty(5, 0), bias, activation="relu")
    torch.testing.assert_close(y, bias.relu().expand(3, 5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [1, 100, 5000])
def test_quantize_per_token_round_trip(backend, dtype, n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    rows = 3 if n_cols == 5000 else 37
    x = (torch.randn(rows, n_cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 10).to(dtype)
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (rows,)
    absmax = x.float().abs().amax(dim=1)
    torch.testing.assert_close(scale, absmax / 127, rtol=2**-23, atol=0)
    # Each row's largest entry maps to ±127; every entry is within half a step (+ rounding).
    assert torch.equal(q.abs().amax(dim=1), torch.full((rows,), 127, dtype=torch.int8))
    error = (q.double() * scale.double()[:, None] - x.double()).abs()
    assert (error <= scale.double()[:, None] * (0.5 + 1e-5)).all()


def test_quantize_per_token_kernel_is_bit_exact_with_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 100, generator=gen, dtype=torch.float16) * 3
    smooth = torch.rand(100, generator=gen) + 0.5
    for s in (None, smooth):
        q, scale = matmul._quantize_rows(x, s)
        q_ref, scale_ref = matmul._quantize_rows_reference(x, s)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def _adversarial_rows(seed: int = 0) -> torch.Tensor:
    """Rows whose quotients x / scale fall on, one ulp below and one ulp above half-integers
    (0.49999997, 0.5, 0.50000006, 2.5, ...), for scales 1 (max 127) and random ones."""
    gen = torch.Generator().manual_seed(seed)
    halves = torch.arange(-126, 127, dtype=torch.float32) + 0.5
    rows = []
    for scale in [1.0, *(torch.rand(7, generator=gen) * 3 + 0.01).tolist()]:
        scale = torch.tensor(scale)
        near = torch.cat([halves, torch.nextafter(halves, halves.new_tensor(0.0)), torch.nextafter(halves, halves * 2)])
        # Inputs whose quotient by the row's scale rounds (IEEE) to those values, or next to them.
        x = near * scale
        x = torch.cat([x, torch.nextafter(x, x.new_tensor(0.0)), torch.nextafter(x, x * 2)])
        rows.append(torch.cat([x, (127 * scale).view(1)]))  # the row's max sets its scale
    return torch.stack(rows)


def test_quantize_per_token_rounds_each_quotient_once_half_to_even(monkeypatch):
    # Rounding floor(fma(x, 1/scale, 0.5)) and rounding twice disagree where x / scale lands
    # just below a half: the kernel and torch both divide (IEEE), then round half to even once.
    x = _adversarial_rows()
    q_ref, scale_ref = matmul._quantize_rows_reference(x, None)
    expected = torch.round(torch.div(x, scale_ref[:, None])).to(torch.int8)
    assert torch.equal(q_ref, expected)
    assert float(scale_ref[0]) == 1.0
    below_half = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))
    row = torch.tensor([below_half, 0.5, 1.5, 2.5, -0.5, -2.5, -below_half, 126.5, 127.0])
    q, _ = matmul._quantize_rows_reference(row.view(1, -1), None)
    assert q.view(-1).tolist() == [0, 0, 2, 2, 0, -2, 0, 126, 127]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q_kernel, scale_kernel = matmul._quantize_rows(x, None)
    assert torch.equal(q_kernel, q_ref) and torch.equal(scale_kernel, scale_ref)


def _fused_cpu_int8():
    fused = int8_cpu.extension()
    if fused is None:
        pytest.skip("no C++ compiler here: the fused CPU int8 path is not built (the reference runs instead)")
    return fused


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("k", [0, 1, 1024, 1025, 3000])
def test_int8_mm_without_vnni_is_exact(monkeypatch, k, precision):
    # Off VNNI CPUs the int32 product is summed by sgemm in slices of K: exact while every
    # partial sum stays below 2^24, which -128 · -128 products over 1025+ terms would pass.
    monkeypatch.setenv(int8_cpu.PRODUCT_ENV, "sgemm")
    monkeypatch.setattr(int8_cpu, "_CHOICES", {})
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
    gen = torch.Generator().manual_seed(k)
    a = torch.randint(-128, 128, (7, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (k, 5), generator=gen, dtype=torch.int8)
    # 2^14·(K - 1) + 127²: odd and past 2^24 from K = 1025, so one fp32 sum would round it
    a[0], b[:, 0] = -128, -128
    if k:
        a[0, -1], b[-1, 0] = 127, 127
    ours = int8_cpu.int8_mm(a, b)
    assert ours.dtype == torch.int32 and torch.equal(ours, (a.long() @ b.long()).int())


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def cpu_threads(request):
    """torch's intra-op threads for the test: the compiled loops split rows over that many
    OpenMP threads above ``int8_cpu._GRAIN`` elements (130 x 384 is)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=list(int8_cpu.PRODUCTS))
def int8_product(request, monkeypatch):
    """The fused path's int8 GEMM, forced: oneDNN's packed int8 GEMM, torch._int_mm (each
    exact only where oneDNN runs VNNI or AMX code) or exact sgemm slices."""
    if request.param not in int8_cpu.exact_products():
        pytest.skip(f"{request.param} does not sum exactly on this CPU ({int8_cpu.cpu_isa()})")
    monkeypatch.setenv(int8_cpu.PRODUCT_ENV, request.param)
    monkeypatch.setattr(int8_cpu, "_CHOICES", {})  # the variable is read when a choice is made
    return request.param


@pytest.mark.parametrize("shape", [(0, 5, 3), (1, 0, 3), *SHAPES, (130, 384, 97)], ids=str)
def test_fused_cpu_int8_is_bit_exact_with_reference(shape, cpu_threads, int8_product):
    # The compiled CPU loops are the reference's arithmetic in fewer passes: the same bits
    # for zero, tiny (below MIN_ROW_ABSMAX), NaN and infinite rows, with and without smooth
    # and bias, at the adversarial half-way quotients, and at sizes off every vector width.
    fused = _fused_cpu_int8()
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * 3
    if m > 5 and k > 3:
        x[1] = 0
        x[2] = 1e-35
        x[3, 2] = float("nan")
        x[4, 1] = float("-inf")
    for rows in (x, _adversarial_rows()) if k == 100 else (x,):
        for smooth in (None, torch.rand(rows.shape[1], generator=gen) + 0.5):
            q, scale = fused.quantize_rows(rows, smooth, matmul.MIN_ROW_ABSMAX)
            q_ref, scale_ref = matmul._quantize_rows_reference(rows, smooth)
            assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, generator=gen), torch.rand(n, generator=gen)
    for bias in (None, torch.randn(n, generator=gen)):
        ours = fused.int8_gemm(q, wq, x_scale, w_scale, bias)
        assert torch.equal(ours, matmul._gemm_reference(q, wq, x_scale, w_scale, bias, None, torch.float32))
        # W8A16, twice: the second call reuses the converted-weight buffer
        for _ in range(2):
            ours = fused.weight_only_gemm(x, wq, w_scale, bias)
            expected = matmul._gemm_reference(x, wq, None, w_scale, bias, None, torch.float32)
            torch.testing.assert_close(ours, expected, rtol=0, atol=0, equal_nan=True)  # x has NaN rows


def _split_adversarial_rows(seed: int = 0) -> torch.Tensor:
    """Rows of 1536 whose quotients x / (max / 32639) fall on, one ulp below and one ulp above
    half-integers across the 16-bit range, including ±127.5·256 and the hi/lo carries (±128, ±384)."""
    gen = torch.Generator().manual_seed(seed)
    halves = torch.cat([torch.arange(-600, 600, 1.0), torch.tensor([-32639.0, -32512, -32385, 32384, 32511, 32638])])
    halves = halves + 0.5
    rows = []
    for scale in [1.0, *(torch.rand(3, generator=gen) * 3e-3 + 1e-5).tolist()]:
        near = torch.cat([halves, torch.nextafter(halves, halves.new_tensor(0.0)), torch.nextafter(halves, halves * 2)])
        x = near * scale
        x = torch.cat([x, torch.nextafter(x, x.new_tensor(0.0)), torch.nextafter(x, x * 2)])
        x = torch.cat([x[: 1536 - 1], (32639 * torch.tensor(scale)).view(1)])  # the row's max sets its scale
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("shape", [(0, 5, 3), (1, 0, 3), *SHAPES, (130, 384, 97), (9, 1536, 384)], ids=str)
def test_fused_cpu_weight_only_split_is_bit_exact_with_reference(shape, cpu_threads, int8_product):
    # CPU W8A16 multiplies the 16-bit fixed point v = round(x / s), s = max|row| / 32639, as
    # v = 256·hi + lo in one int8 GEMM: the compiled loops and the PyTorch statement give the
    # same bits for zero, tiny, NaN and infinite rows, adversarial half-way quotients, K = 1536.
    fused = _fused_cpu_int8()
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + 1)
    x = torch.randn(m, k, generator=gen) * 3
    if m > 5 and k > 3:
        x[1] = 0
        x[2] = 1e-35  # below MIN_ROW_ABSMAX: scale 1, all zero
        x[3, 2] = float("nan")
        x[4, 1] = float("-inf")
        x[5] *= 1e-28  # tiny but above MIN_ROW_ABSMAX
    for rows in (x, _split_adversarial_rows()) if k == 1536 else (x,):
        q, scale = fused.quantize_rows_split(rows, matmul.MIN_ROW_ABSMAX)
        q_ref, scale_ref = matmul._quantize_rows_split_reference(rows)
        assert torch.equal(q, q_ref)
        torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
        # the halves: hi in [-127, 127], lo in [-128, 127], 256·hi + lo = round-half-even(x / s)
        r = rows.shape[0]
        hi, lo = q[:r].int(), q[r:].int()
        assert hi.abs().max() <= 127 if r * k else True
        finite = torch.isfinite(rows).all(1)
        v = 256 * hi + lo
        expected = torch.round(torch.div(rows, scale[:, None])).int()
        assert torch.equal(v[finite], expected[finite]) and not v[~finite].any()
        assert torch.isnan(scale[~finite]).all()
        wq = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w_scale = torch.rand(n, generator=gen)
        for bias in (None, torch.randn(n, generator=gen)):
            for _ in range(2):
                ours = fused.split_gemm(q, wq, scale, w_scale, bias)
                expected_y = matmul._split_gemm_reference(q_ref, wq, scale_ref, w_scale, bias)
                torch.testing.assert_close(ours, expected_y, rtol=0, atol=0, equal_nan=True)
                assert torch.isnan(ours[~finite]).all()


def test_onednn_packing_follows_an_in_place_change_of_the_weight(int8_product):
    # the packed weight is made once per weight and again after an in-place change of it
    fused = _fused_cpu_int8()
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8)
    wq = torch.randint(-100, 100, (24, 64), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(40, generator=gen), torch.rand(24, generator=gen)
    for _ in range(2):
        fused.int8_gemm(q, wq, x_scale, w_scale, None)
        wq.add_(1)
        ours = fused.int8_gemm(q, wq, x_scale, w_scale, None)
        assert torch.equal(ours, matmul._gemm_reference(q, wq, x_scale, w_scale, None, None, torch.float32))


@pytest.mark.parametrize("reason", ["past-the-split-depth", "no-fast-int8"])
def test_weight_only_runs_the_fp32_gemm_past_the_split_depth_or_without_fast_int8(monkeypatch, reason):
    # Past MAX_SPLIT_IN_FEATURES the int32 sums of lo · w could overflow; without VNNI or AMX
    # the split's int8 GEMM is no faster than two fp32 ones: the fp32 GEMM there.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if reason == "no-fast-int8":
        monkeypatch.setattr(int8_cpu, "int8_gemm_is_fast", lambda: False)
    else:
        monkeypatch.setattr(matmul, "MAX_SPLIT_IN_FEATURES", 50)
    x, weight, bias = _inputs(7, 100, 20, torch.float32)
    wq, w_scale = quantize_per_channel(weight)
    expected = matmul._gemm_reference(x, wq, None, w_scale, bias, None, torch.float32)
    torch.testing.assert_close(int8_weight_only_linear(x, wq, w_scale, bias), expected, rtol=0, atol=0)


def test_fused_cpu_int8_builds_into_its_cache_or_warns_without_a_compiler(monkeypatch, tmp_path):
    # A build goes to $SLIMFORMER_CACHE_DIR and later calls load it; with no C compiler
    # the callers get None and one warning that says the PyTorch ops run instead.
    _fused_cpu_int8()
    monkeypatch.setenv("SLIMFORMER_CACHE_DIR", str(tmp_path / "cache"))
    built = int8_cpu.extension.__wrapped__()
    assert built is not None and [p.suffix for p in (tmp_path / "cache").iterdir()] == [".so"]
    x = torch.randn(3, 40)
    assert torch.equal(
        built.quantize_rows(x, None, matmul.MIN_ROW_ABSMAX)[0], matmul._quantize_rows_reference(x, None)[0]
    )
    with pytest.raises(ValueError, match="x must be a contiguous float32 CPU tensor, got torch.float16"):
        built.quantize_rows(x.half(), None, matmul.MIN_ROW_ABSMAX)
    with pytest.raises(ValueError, match="w_scale must have 5 elements, got 4"):
        built.int8_gemm(
            torch.zeros(3, 8, dtype=torch.int8), torch.zeros(5, 8, dtype=torch.int8), torch.ones(3), torch.ones(4), None
        )
    monkeypatch.setenv("SLIMFORMER_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(RuntimeWarning, match="no C compiler .*no-such-cc.* plain PyTorch ops"):
        assert int8_cpu.extension.__wrapped__() is None


def test_int8_layers_run_the_reference_without_the_fused_cpu_path(monkeypatch):
    # Where the extension cannot be built (no compiler), int8_linear and
    # int8_weight_only_linear give the same bits.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _fused_cpu_int8()
    x, weight, bias = _inputs(33, 100, 70, torch.float32)
    wq, w_scale = quantize_per_channel(weight)
    smooth = torch.rand(100) + 0.5
    fused = [int8_linear(x, wq, w_scale, bias, smooth=s, activation="gelu") for s in (None, smooth)]
    weight_only = [int8_weight_only_linear(x.to(dtype), wq, w_scale, bias, activation="gelu") for dtype in DTYPES]
    monkeypatch.setattr(int8_cpu, "extension", lambda: None)
    for s, y in zip((None, smooth), fused):
        assert torch.equal(int8_linear(x, wq, w_scale, bias, smooth=s, activation="gelu"), y)
    for dtype, y in zip(DTYPES, weight_only):
        assert torch.equal(int8_weight_only_linear(x.to(dtype), wq, w_scale, bias, activation="gelu"), y)


def test_quantize_per_token_zero_rows_and_saturation(backend):
    x = torch.zeros(4, 10)
    x[1] = torch.linspace(-3, 3, 10)
    x[3, 4] = -1e-30
    x[2, :3] = torch.tensor([1e-39, -5e-40, 3e-40])  # subnormal: quantizes as a zero row, not 127 / tiny = inf
    q, scale = quantize_per_token(x.view(2, 2, 10))
    assert scale.shape == (2, 2)
    q, scale = q.view(4, 10), scale.view(4)
    assert scale[0] == 1 and scale[2] == 1 and not q[0].any() and not q[2].any()
    assert q[1, 0] == -127 and q[1, -1] == 127
    assert q[3, 4] == -127 and torch.isclose(scale[3], torch.tensor(1e-30 / 127))


def test_quantize_per_token_applies_smooth(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 33, generator=gen)
    smooth = torch.rand(33, generator=gen) + 0.25
    q, scale = quantize_per_token(x, smooth)
    q_ref, scale_ref = quantize_per_token(x * smooth)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_per_token_empty_batch(backend):
    q, scale = quantize_per_token(torch.empty(0, 3, 16))
    assert q.shape == (0, 3, 16) and scale.shape == (0, 3)


def test_quantize_per_channel_round_trip_and_errors():
    weight = torch.randn(17, 33)
    weight[3] = 0
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (17,) and scale[3] == 1 and not q[3].any()
    assert (q.double() * scale.double()[:, None] - weight.double()).abs().max() <= scale.max() * 0.5
    assert sqnr_db(q.float() * scale[:, None], weight) > 35
    weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight must be finite"):
        quantize_per_channel(weight)
    with pytest.raises(TypeError, match="weight must be float32, float16 or bfloat16, got torch.int8"):
        quantize_per_channel(q)


def _exact_int8_product(q, x_scale, wq, w_scale, bias, activation):
    acc = q.long() @ wq.long().t()  # exact
    y = acc.double() * x_scale.double()[:, None] * w_scale.double()
    if bias is not None:
        y = y + bias.double()
    return _activation(y, activation)


@pytest.mark.parametrize("activation, with_bias", EPILOGUES, ids=["plain", "bias", "bias-gelu", "bias-relu"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_matmul_is_the_exact_integer_product(backend, shape, out_dtype, activation, with_bias):
    m, k, n = shape
    gen = torch.Generator().manual_seed(k)
    q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, generator=gen) / 100, torch.rand(n, generator=gen) / 100
    bias = torch.randn(n, generator=gen) if with_bias else None
    ours = int8_matmul(q, x_scale, wq, w_scale, bias, activation=activation, out_dtype=out_dtype)
    exact = _exact_int8_product(q, x_scale, wq, w_scale, bias, activation)
    # The only rounding is fp32's epilogue and the final cast: that of a correctly
    # rounded result in out_dtype.
    assert ours.dtype == out_dtype
    assert_within_reference_error("int8_matmul", ours, exact.to(out_dtype), exact)


def test_int8_matmul_saturated_inputs_sum_exactly_in_int32(backend):
    k = 300  # 127² · 300 ≈ 4.8e6: beyond fp16's exact integers, exact in int32
    q = torch.full((5, k), 127, dtype=torch.int8)
    q[1] = -127
    wq = torch.full((6, k), -127, dtype=torch.int8)
    wq[2, ::2] = 127
    y = int8_matmul(q, torch.ones(5), wq, torch.ones(6))
    exact = (q.long() @ wq.long().t()).float()
    assert torch.equal(y, exact)
    assert y[0, 0] == -127 * 127 * k


def test_int8_matmul_reference_without_int_mm_agrees(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randint(-127, 128, (7, 33), dtype=torch.int8)
    wq = torch.randint(-127, 128, (17, 33), dtype=torch.int8)
    x_scale, w_scale = torch.rand(7), torch.rand(17)
    with_int_mm = int8_matmul(q, x_scale, wq, w_scale)
    monkeypatch.setattr(matmul, "_int_mm_supports", lambda *args: False)
    monkeypatch.setattr(int8_cpu, "extension", lambda: None)  # the fused CPU path calls _int_mm itself
    assert torch.equal(int8_matmul(q, x_scale, wq, w_scale), with_int_mm)


def test_int_mm_shape_rules():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert matmul._int_mm_supports(1, 5, 3, cpu)
    assert matmul._int_mm_supports(17, 16, 8, cuda)
    assert not matmul._int_mm_supports(16, 16, 8, cuda)
    assert not matmul._int_mm_supports(33, 100, 64, cuda)
    assert not matmul._int_mm_supports(33, 64, 70, cuda)


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_linear_is_quantize_then_int8_matmul(backend, shape, dtype, activation):
    x, weight, bias = _inputs(*shape, dtype)
    wq, w_scale = quantize_per_channel(weight)
    ours = int8_linear(x, wq, w_scale, bias, activation=activation)
    q, x_scale = quantize_per_token(x)
    composed = int8_matmul(q, x_scale, wq, w_scale, bias, activation=activation, out_dtype=dtype)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, composed, rtol=0, atol=0)
    exact = _activation(F.linear(x.double(), weight.double(), bias.double()), activation)
    assert sqnr_db(ours, exact) > 25


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_weight_only_linear_matches_dequantized_weight(backend, shape, dtype, activation):
    x, weight, bias = _inputs(*shape, dtype)
    wq, w_scale = quantize_per_channel(weight)
    ours = int8_weight_only_linear(x, wq, w_scale, bias, activation=activation)
    dequantized = wq.double() * w_scale.double()[:, None]
    exact = _activation(F.linear(x.double(), dequantized, bias.double()), activation)
    torch_same_dtype = _activation(F.linear(x, dequantized.to(dtype), bias.to(dtype)), activation)
    assert ours.dtype == dtype
    # The kernel sums exact int8 weights and scales afterwards; torch rounds the
    # dequantized weight to dtype first: bound by its error, plus the weight's rounding.
    scale = (x.double().abs() @ dequantized.abs().t()).max().item()
    if backend == "torch" and 0 not in shape[:2] and int8_cpu.int8_gemm_is_fast():
        # With fast int8 GEMMs the CPU path multiplies the activation's 16-bit fixed point v · s (s = max|row| / 32639)
        # exactly in int32: bound it by the float64 product of that activation, and bound that
        # product's distance from ``exact`` by half a step per element, Σ_k |w[n, k]| · s / 2.
        q, x_scale = matmul._quantize_rows_split_reference(x.float())
        m = x.shape[0]
        x16 = (256 * q[:m].double() + q[m:].double()) * x_scale.double()[:, None]
        exact16 = _activation(F.linear(x16, dequantized, bias.double()), activation)
        torch16 = _activation(F.linear(x16.float(), dequantized.float(), bias.float()), activation).to(dtype)
        assert_within_reference_error("int8_weight_only_linear", ours, torch16, exact16, scale=scale)
        step_bound = (x_scale.double()[:, None] / 2) * dequantized.abs().sum(1)[None, :]
        assert ((exact16 - exact).abs() <= step_bound * (1 + 1e-9)).all()
    else:
        assert_within_reference_error("int8_weight_only_linear", ours, torch_same_dtype, exact, scale=scale)
    float_exact = _activation(F.linear(x.double(), weight.double(), bias.double()), activation)
    assert sqnr_db(ours, float_exact) > 25


def test_non_contiguous_arguments(backend):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 7, generator=gen).t()  # (7, 40), transposed
    weight_t = torch.randn(40, 17, generator=gen)
    bias = torch.randn(34, generator=gen)[::2]
    weight = weight_t.t()
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(linear(x, weight, bias), expected)
    wq, w_scale = quantize_per_channel(weight)
    wq_t = wq.t().contiguous().t()
    for op in (int8_linear, int8_weight_only_linear):
        contiguous = op(x.contiguous(), wq, w_scale, bias.contiguous())
        torch.testing.assert_close(op(x, wq_t, w_scale, bias), contiguous, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(matmul.GPU_CONFIGS))
@pytest.mark.parametrize("rows", [1, 250, 4096])
@pytest.mark.parametrize("k", [768, 770, 776])
def test_autotune_candidates_at_every_shape(kind, rows, k):
    # When K is not a multiple of 16 (rows not provably 16-byte aligned) only tiles that
    # compile without spills on sm_90 remain, for 16-bit and int8 operands; some always remain.
    x_dtype = {"float32": torch.float32, "float": torch.bfloat16, "w8a8": torch.int8, "w8a16": torch.bfloat16}[kind]
    named_args = {"M_BUCKET": matmul._m_bucket(rows), "K": k, "X": torch.empty(0, dtype=x_dtype)}
    kept = matmul._prune_configs(matmul.GPU_CONFIGS[kind], named_args)
    assert kept
    assert all(c.kwargs["BLOCK_M"] <= named_args["M_BUCKET"] for c in kept)
    if k % 16 and kind != "float32":
        assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 32 * 64 for c in kept)


def test_backward_raises_a_clear_error(backend):
    x, weight, bias = _inputs(7, 33, 17, torch.float32)
    wq, w_scale = quantize_per_channel(weight)
    x.requires_grad_(True)
    for y in (
        linear(x, weight, bias),
        int8_linear(x, wq, w_scale, bias),
        int8_weight_only_linear(x, wq, w_scale, bias),
    ):
        with pytest.raises(RuntimeError, match="inference-only op and has no backward"):
            y.sum().backward()


def test_bad_arguments_raise_naming_the_argument():
    x, weight, bias = _inputs(4, 8, 6, torch.float32)
    wq, w_scale = quantize_per_channel(weight)
    with pytest.raises(TypeError, match="weight must be float32, got torch.float16"):
        linear(x, weight.half())
    with pytest.raises(ValueError, match=r"weight must have shape \[out_features, 8\]"):
        linear(x, weight[:, :5])
    with pytest.raises(ValueError, match=r"bias must have shape \[6\], got \[5\]"):
        linear(x, weight, bias[:5])
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(x, weight, activation="tanh")
    with pytest.raises(TypeError, match="input must be float32, float16 or bfloat16, got torch.int32"):
        int8_linear(x.int(), wq, w_scale)
    with pytest.raises(TypeError, match="weight must be int8, got torch.float32"):
        int8_weight_only_linear(x, weight, w_scale)
    with pytest.raises(TypeError, match="weight_scale must be float32, got torch.float16"):
        int8_linear(x, wq, w_scale.half())
    with pytest.raises(ValueError, match=r"smooth must have shape \[8\], got \[7\]"):
        int8_linear(x, wq, w_scale, smooth=torch.ones(7))
    with pytest.raises(ValueError, match=r"input_scale must have shape \[4\], got \[3\]"):
        int8_matmul(wq[:4], torch.ones(3), wq, w_scale)
    with pytest.raises(TypeError, match="out_dtype must be"):
        int8_matmul(wq[:4], torch.ones(4), wq, w_scale, out_dtype=torch.int32)
    deep = torch.zeros(1, matmul.MAX_INT8_IN_FEATURES + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="W8A8 sums at most 133144 in_features in int32"):
        int8_matmul(deep, torch.ones(1), deep, torch.ones(1))
    with pytest.raises(ValueError, match="input must have at least 1 dimension"):
        quantize_per_token(torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 768, 3072), (33, 4096, 4096), (4096, 3072, 768)], ids=str)
def test_compiled_kernels_match_reference_on_gpu(shape, dtype):
    x, weight, bias = (t.cuda() for t in _inputs(*shape, dtype))
    wq, w_scale = quantize_per_channel(weight)
    q, x_scale = quantize_per_token(x)
    q_ref, x_scale_ref = matmul._quantize_rows_reference(x, None)
    assert torch.equal(q, q_ref) and torch.equal(x_scale, x_scale_ref)
    adversarial = _adversarial_rows().cuda()
    for on_gpu, on_cpu in zip(quantize_per_token(adversarial), quantize_per_token(adversarial.cpu())):
        assert torch.equal(on_gpu.cpu(), on_cpu)
    for ours, ref in [
        (
            linear(x, weight, bias, activation="gelu"),
            matmul._gemm_reference(x, weight, None, None, bias, "gelu", dtype),
        ),
        (
            int8_matmul(q, x_scale, wq, w_scale, bias, out_dtype=dtype),
            matmul._gemm_reference(q, wq, x_scale, w_scale, bias, None, dtype),
        ),
        (
            int8_weight_only_linear(x, wq, w_scale, bias),
            matmul._gemm_reference(x, wq, None, w_scale, bias, None, dtype),
        ),
    ]:
        torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)


def test_onednn_products_are_off_where_onednn_would_saturate():
    # ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN (its int8 GEMM and torch._int_mm) to vpmaddubsw's
    # saturating 16-bit pair sums on any x86 CPU: the self-test must leave the sgemm slices only
    code = (
        "import torch; from slimformer.kernels import int8_cpu\n"
        "assert int8_cpu.exact_products() == ('sgemm',), int8_cpu.exact_products()\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_int8_mm_stays_exact_where_onednn_would_saturate():
    # torch._int_mm is oneDNN's GEMM on a VNNI CPU: held to AVX2 it clips too, so int8_mm
    # leaves it for the exact sgemm slices
    code = (
        "import torch; from slimformer.kernels import int8_cpu\n"
        "q = torch.full((3, 64), 127, dtype=torch.int8); w = torch.full((64, 5), 127, dtype=torch.int8)\n"
        "assert torch.equal(int8_cpu.int8_mm(q, w).long(), q.long() @ w.long())\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_onednn_packing_follows_a_replaced_weight_and_weights_made_in_inference_mode(int8_product):
    fused = _fused_cpu_int8()
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (6, 32), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(6, generator=gen), torch.rand(10, generator=gen)
    weight = torch.nn.Parameter(
        torch.randint(-127, 128, (10, 32), generator=gen, dtype=torch.int8), requires_grad=False
    )
    fused.int8_gemm(q, weight, x_scale, w_scale, None)
    weight.data = torch.randint(-127, 128, (10, 32), generator=gen, dtype=torch.int8)  # no version bump
    expected = matmul._gemm_reference(q, weight.data, x_scale, w_scale, None, None, torch.float32)
    assert torch.equal(fused.int8_gemm(q, weight, x_scale, w_scale, None), expected)
    with torch.inference_mode():
        made = torch.randint(-127, 128, (10, 32), generator=gen, dtype=torch.int8)
    expected = matmul._gemm_reference(q, made, x_scale, w_scale, None, None, torch.float32)
    assert torch.equal(fused.int8_gemm(q, made, x_scale, w_scale, None), expected)


def test_fused_cpu_int8_does_not_follow_the_default_dtype(int8_product):
    fused = _fused_cpu_int8()
    q = torch.randint(-127, 128, (4, 16), dtype=torch.int8)
    w = torch.randint(-127, 128, (3, 16), dtype=torch.int8)
    expected = matmul._gemm_reference(q, w, torch.ones(4), torch.ones(3), None, None, torch.float32)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = fused.int8_gemm(q, w, torch.ones(4, dtype=torch.float32), torch.ones(3, dtype=torch.float32), None)
        x_q, x_scale = fused.quantize_rows(torch.randn(4, 16, dtype=torch.float32), None, matmul.MIN_ROW_ABSMAX)
    finally:
        torch.set_default_dtype(before)
    assert torch.equal(got, expected) and x_scale.dtype == torch.float32
