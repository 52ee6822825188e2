"""The CPU int8 product is chosen by measuring the exact candidates on the machine at hand.

The candidates are replaced by fakes with known speeds, so each test shows the choice on any
CPU: a oneDNN that runs its reference implementation (as on AMD Zen 4, VNNI without AMX) is
screened out before it runs a real shape; a fast one is chosen; a forced one runs.
"""

import time
import types

import pytest
import torch

from slimformer.kernels import int8_cpu, matmul
from slimformer.kernels.matmul import int8_weight_only_linear, quantize_per_channel, quantize_per_token
from slimformer.layers.linear import Linear8bit


def _exact(q, weight):
    return q.long().matmul(weight.long().t())


class _Clock:
    """``time.perf_counter`` as ``int8_cpu`` reads it: the real clock, less the real time the fake
    products take, plus the time each declares (seconds per multiply-add): the fp32 GEMMs they
    are measured against run for real."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self):
        return time.perf_counter() + self.offset

    def product(self, name, seconds_per_mac, calls):
        def product(q, weight):
            start = time.perf_counter()
            calls.append((q.shape[0], *weight.shape))
            out = _exact(q, weight).to(torch.float32 if name == "onednn" else torch.int32)
            self.offset += seconds_per_mac * q.shape[0] * weight.numel() - (time.perf_counter() - start)
            return out

        return product


@pytest.fixture
def fake_products(monkeypatch):
    """Installs fake products ``{name: seconds per multiply-add}`` (the exact ones here: all of
    them unless ``exact`` says) with fresh choices; returns each product's calls as (M, N, K)."""

    def install(speeds: dict[str, float], exact=None):
        clock = _Clock()
        calls = {name: [] for name in int8_cpu.PRODUCTS}
        products = {name: clock.product(name, speeds.get(name, 0.0), calls[name]) for name in int8_cpu.PRODUCTS}
        monkeypatch.setattr(int8_cpu, "PRODUCTS", products)
        monkeypatch.setattr(int8_cpu, "time", types.SimpleNamespace(perf_counter=clock))
        monkeypatch.setattr(int8_cpu, "exact_products", lambda: tuple(speeds if exact is None else exact))
        monkeypatch.setattr(int8_cpu, "_SCREENED", {})
        monkeypatch.setattr(int8_cpu, "_CHOICES", {})
        monkeypatch.setattr(int8_cpu, "_FAST", {})
        monkeypatch.delenv(int8_cpu.PRODUCT_ENV, raising=False)
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU path, not the interpreted kernels
        return calls

    return install


def _quantized_linear(k=384, n=384):
    torch.manual_seed(0)
    return Linear8bit.from_float(torch.nn.Linear(k, n)).eval()


def test_a_reference_onednn_is_screened_out_before_it_runs_a_real_shape(fake_products, monkeypatch):
    # 10 µs per thousand multiply-adds, as oneDNN's ref_int8 on Zen 4: 2.6 ms on the screening
    # problem (16 x 128 x 128), some 300 times an fp32 GEMM of it; 0.4 s a run on 256 x 384 x 384
    calls = fake_products({"onednn": 1e-8, "int_mm": 0.0, "sgemm": 0.0})
    layer = _quantized_linear()
    x = torch.randn(2, 128, 384)
    with torch.no_grad():
        out = layer(x)
    m, k, n = int8_cpu._SCREEN_SHAPE
    assert calls["onednn"] == [(m, n, k)] * 2, int8_cpu._SCREENED  # the screen only: a warm-up, a timed run
    assert "onednn" not in int8_cpu.chosen_products().values()
    q, x_scale = quantize_per_token(x.reshape(-1, 384))
    expected = matmul._gemm_reference(q, layer.weight, x_scale, layer.weight_scale, layer.bias, None, torch.float32)
    assert torch.equal(out.reshape(-1, 384), expected)


def test_the_fastest_exact_product_is_chosen(fake_products):
    fake_products({"onednn": 0.0, "int_mm": 2e-10, "sgemm": 1e-9})
    weight = torch.randint(-127, 128, (64, 96), dtype=torch.int8)
    assert int8_cpu.choose_product(300, weight).product == "onednn"
    assert int8_cpu.choose_product(300, weight, int32=True).product == "int_mm"


def test_a_choice_is_made_once_per_shape_class(fake_products):
    calls = fake_products({"int_mm": 0.0, "sgemm": 0.0})
    weight = torch.randint(-127, 128, (32, 48), dtype=torch.int8)
    for m in (200, 300, 4096):
        int8_cpu.choose_product(m, weight)
    raced = [call for call in calls["int_mm"] if call[1:] == (32, 48)]
    assert len(raced) == 1 + int8_cpu._RACE_ROUNDS  # a warm-up and the timed rounds, at the first call's class only
    assert {shape[0] for shape in raced} == {200}
    int8_cpu.choose_product(8, weight)  # another row class: raced again
    assert len([call for call in calls["int_mm"] if call[1:] == (32, 48)]) == 2 * (1 + int8_cpu._RACE_ROUNDS)


def test_the_product_named_in_the_environment_runs(fake_products, monkeypatch):
    calls = fake_products({"onednn": 0.0, "int_mm": 0.0, "sgemm": 1e-9})
    monkeypatch.setenv(int8_cpu.PRODUCT_ENV, "sgemm")
    weight = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    assert int8_cpu.choose_product(10, weight).product == "sgemm"
    assert calls["onednn"] == [] and calls["int_mm"] == []  # nothing raced


@pytest.mark.parametrize("value", ["onednn-fast", "ONEDNN", "int8"])
def test_an_unknown_product_in_the_environment_is_a_clear_error(fake_products, monkeypatch, value):
    fake_products({"int_mm": 0.0, "sgemm": 0.0})
    monkeypatch.setenv(int8_cpu.PRODUCT_ENV, value)
    weight = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    with pytest.raises(ValueError, match=rf"{int8_cpu.PRODUCT_ENV} must be one of .*sgemm.*, got '{value}'"):
        int8_cpu.choose_product(10, weight)


def test_a_product_that_is_not_exact_here_cannot_be_forced(fake_products, monkeypatch):
    fake_products({"sgemm": 0.0}, exact=["sgemm"])  # as under ONEDNN_MAX_CPU_ISA=AVX2
    monkeypatch.setenv(int8_cpu.PRODUCT_ENV, "onednn")
    weight = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"'onednn' does not sum exactly on this CPU"):
        int8_cpu.choose_product(10, weight)


def test_int8_is_not_called_fast_where_every_exact_product_is_as_slow_as_fp32(fake_products):
    # the sgemm slices alone: an fp32 GEMM and two conversions
    fake_products({"sgemm": 2e-9})
    assert not int8_cpu.int8_gemm_is_fast()
    fake_products({"int_mm": 0.0, "sgemm": 2e-9})
    assert int8_cpu.int8_gemm_is_fast(), int8_cpu._CHOICES


@pytest.mark.parametrize("split", [True, False], ids=["split-pays", "fp32-gemm"])
def test_weight_only_takes_the_measured_path(fake_products, monkeypatch, split):
    # W8A16 splits x into two int8 rows per row only where the int8 product runs at under half
    # the fp32 GEMM's time
    fake_products({"int_mm": 0.0 if split else 2e-9, "sgemm": 2e-9})
    x = torch.randn(5, 40)
    wq, w_scale = quantize_per_channel(torch.randn(24, 40))
    q, scale = matmul._quantize_rows_split_reference(x)
    by_split = matmul._split_gemm_reference(q, wq, scale, w_scale, None)
    by_fp32 = matmul._gemm_reference(x, wq, None, w_scale, None, None, torch.float32)
    assert not torch.equal(by_split, by_fp32)
    assert torch.equal(int8_weight_only_linear(x, wq, w_scale), by_split if split else by_fp32)


def test_the_real_products_agree_with_the_choice_on_this_cpu():
    # whatever this CPU chose, the product is exact
    weight = torch.randint(-127, 128, (70, 1100), dtype=torch.int8)
    q = torch.randint(-127, 128, (33, 1100), dtype=torch.int8)
    choice = int8_cpu.choose_product(33, weight)
    assert choice.product in int8_cpu.exact_products()
    got = int8_cpu.PRODUCTS[choice.product](q, weight)
    assert torch.equal(got.long(), _exact(q, weight))


def test_a_race_whose_every_product_is_far_slower_than_fp32_still_chooses_one(fake_products):
    # the cutoff drops products far slower than the fastest product, not than fp32
    fake_products({"sgemm": 2e-9})
    weight = torch.randint(-127, 128, (384, 384), dtype=torch.int8)
    assert int8_cpu.choose_product(128, weight).product == "sgemm"
