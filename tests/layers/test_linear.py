"""Linear8bit / Linear16bit against the float nn.Linear they were built from."""

import pytest
import torch
from torch import nn

from slimformer.kernels import matmul
from slimformer.kernels.matmul import int8_linear
from slimformer.layers.linear import Linear8bit, Linear16bit, state_dict_mode
from slimformer.quantize import sqnr_db

MODES = ["int8", "int8-weight-only", "fp16", "bf16"]
# nn.Linear's uniform init and Gaussian inputs measure about 43 dB (int8), 48 dB
# (int8-weight-only, bf16) and 68 dB (fp16).
MIN_SQNR_DB = {"int8": 35, "int8-weight-only": 40, "fp16": 60, "bf16": 40}
EXPECTED_STATE = {
    "int8": {"weight": torch.int8, "weight_scale": torch.bfloat16, "smooth": torch.float32, "bias": torch.float32},
    "int8-weight-only": {"weight": torch.int8, "weight_scale": torch.bfloat16, "bias": torch.float32},
    "fp16": {"weight": torch.float16, "bias": torch.float16},
    "bf16": {"weight": torch.bfloat16, "bias": torch.bfloat16},
}


def _float_linear(in_features=33, out_features=17, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _from_float(linear, mode, **kwargs):
    if mode in ("fp16", "bf16"):
        return Linear16bit.from_float(linear, torch.float16 if mode == "fp16" else torch.bfloat16)
    return Linear8bit.from_float(linear, mode, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_from_float_follows_the_float_layer(backend, mode):
    linear = _float_linear()
    layer = _from_float(linear, mode)
    x = torch.randn(2, 7, 33)
    with torch.no_grad():
        expected = linear(x)
    y = layer(x)
    assert y.shape == expected.shape and y.dtype == x.dtype
    assert sqnr_db(y, expected) > MIN_SQNR_DB[mode]


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_holds_plain_tensors_of_the_mode(mode):
    layer = _from_float(_float_linear(), mode)
    state = layer.state_dict()
    assert {k: v.dtype for k, v in state.items()} == EXPECTED_STATE[mode]
    assert state_dict_mode(state) == mode
    assert f"mode={mode!r}" in repr(layer)


def test_int8_weight_takes_a_quarter_of_fp32_bytes():
    linear = _float_linear(384, 1536)
    layer = Linear8bit.from_float(linear, "int8-weight-only")
    assert layer.weight.nbytes * 4 == linear.weight.nbytes
    assert layer.state_dict()["weight_scale"].nbytes == 2 * 1536


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip_into_a_new_layer(mode, bias):
    layer = _from_float(_float_linear(bias=bias), mode)
    if mode in ("int8", "int8-weight-only"):
        fresh = Linear8bit(33, 17, bias=bias, mode=mode)
    else:
        fresh = Linear16bit(33, 17, bias=bias, dtype=layer.weight.dtype)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(5, 33)
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize(
    "saved, loaded",
    [("int8", "int8-weight-only"), ("int8-weight-only", "int8"), ("fp16", "int8"), ("int8", "fp16"), ("float", "int8")],
)
def test_loading_another_modes_state_dict_raises(saved, loaded):
    linear = _float_linear()
    source = linear if saved == "float" else _from_float(linear, saved)
    target = _from_float(_float_linear(seed=1), loaded)
    with pytest.raises(RuntimeError, match=f"saved from a '{saved}' layer, but this layer is '{loaded}'"):
        target.load_state_dict(source.state_dict())


def test_state_dict_stores_no_smoothing_vector_and_two_byte_scales_without_loss():
    layer = Linear8bit.from_float(_float_linear(), "int8")
    state = layer.state_dict()
    assert state["smooth"].shape == (0,) and layer.weight_scale.dtype == torch.float32
    assert torch.equal(state["weight_scale"].float(), layer.weight_scale)
    smoothed = Linear8bit.from_float(_float_linear(), "int8", smooth=torch.rand(33) + 0.5)
    assert smoothed.state_dict()["smooth"].shape == (33,)
    # a smoothed state loads into an unsmoothed layer and the other way round
    fresh = Linear8bit(33, 17, mode="int8")
    x = torch.randn(4, 33)
    for source in (smoothed, layer):
        fresh.load_state_dict(source.state_dict())
        assert torch.equal(fresh(x), source(x))


def test_state_dict_of_the_first_format_loads(backend):
    # fp32 scales (any value) and an all-ones (K,) smooth, as written before the scales were
    # bfloat16 values: loaded as they are, and saved again in fp32 where bfloat16 would lose bits.
    layer = Linear8bit.from_float(_float_linear(), "int8")
    state = layer.state_dict()
    state["weight_scale"] = state["weight_scale"].float() * (1 + 2**-20)
    state["smooth"] = torch.ones(33)
    fresh = Linear8bit(33, 17, mode="int8")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weight_scale, state["weight_scale"])
    assert fresh.state_dict()["weight_scale"].dtype == torch.float32
    x = torch.randn(4, 33)
    assert torch.equal(fresh(x), int8_linear(x, fresh.weight, state["weight_scale"], fresh.bias))


def test_smooth_moves_into_the_weight_and_keeps_the_product(backend):
    linear = _float_linear()
    smooth = torch.rand(33) + 0.5
    layer = Linear8bit.from_float(linear, "int8", smooth=smooth)
    assert torch.equal(layer.smooth, smooth)
    assert sqnr_db(layer.dequantized_weight(), linear.weight) > 30
    x = torch.randn(9, 33)
    with torch.no_grad():
        assert sqnr_db(layer(x), linear(x)) > 30


def test_dtype_casts_keep_scales_fp32_and_16bit_weights():
    layer8 = Linear8bit.from_float(_float_linear(), "int8").half()
    assert layer8.weight_scale.dtype == torch.float32 and layer8.smooth.dtype == torch.float32
    assert layer8.weight.dtype == torch.int8 and layer8.bias.dtype == torch.float16
    y = layer8(torch.randn(3, 33).half())
    assert y.dtype == torch.float16
    layer16 = Linear16bit.from_float(_float_linear(), torch.bfloat16).float()
    assert layer16.weight.dtype == torch.bfloat16 and layer16.bias.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_backward_raises(backend, mode):
    layer = _from_float(_float_linear(), mode)
    x = torch.randn(3, 33, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        layer(x).sum().backward()


def test_zero_weight_rows_and_zero_inputs_give_the_bias(backend):
    linear = _float_linear()
    with torch.no_grad():
        linear.weight[4] = 0
    for mode in ("int8", "int8-weight-only"):
        layer = Linear8bit.from_float(linear, mode)
        y = layer(torch.cat([torch.zeros(1, 33), torch.randn(2, 33)]))
        torch.testing.assert_close(y[0], linear.bias.detach(), rtol=0, atol=0)
        torch.testing.assert_close(y[:, 4], linear.bias.detach()[4].expand(3), rtol=0, atol=0)


def test_bad_arguments_raise():
    linear = _float_linear()
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear, got Conv1d"):
        Linear8bit.from_float(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="mode must be one of"):
        Linear8bit.from_float(linear, "int4")
    with pytest.raises(ValueError, match="mode must be one of"):
        Linear8bit(4, 4, mode="fp16")
    with pytest.raises(TypeError, match="dtype must be torch.float16 or torch.bfloat16"):
        Linear16bit(4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"smooth must have shape \[33\], got \[4\]"):
        Linear8bit.from_float(linear, "int8", smooth=torch.ones(4))
    with pytest.raises(ValueError, match="smooth must be finite and positive"):
        Linear8bit.from_float(linear, "int8", smooth=torch.zeros(33))
    with pytest.raises(ValueError, match="smooth applies to mode 'int8' only"):
        Linear8bit.from_float(linear, "int8-weight-only", smooth=torch.ones(33))
    with pytest.raises(TypeError, match="input must be a float32, float16 or bfloat16 tensor, got torch.int64"):
        Linear16bit.from_float(linear)(torch.ones(2, 33, dtype=torch.long))
    with torch.no_grad():
        linear.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match="linear.weight must be finite in torch.float16"):
        Linear16bit.from_float(linear)
    with torch.no_grad():
        linear.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="weight must be finite to quantize"):
        Linear8bit.from_float(linear)


def test_int8_layers_reading_one_input_share_its_quantization(backend, monkeypatch):
    # Q, K and V of an attention block read one tensor: it is quantized once, and again
    # after an in-place write (its version counter moves) or for another tensor.
    torch.manual_seed(0)
    layers = [Linear8bit.from_float(nn.Linear(33, n), "int8") for n in (5, 7, 9)]
    x = torch.randn(2, 4, 33)

    def expected(layer, x):
        return int8_linear(x, layer.weight, layer.weight_scale, layer.bias)

    before = [expected(layer, x) for layer in layers]
    after = expected(layers[0], x * -3)
    calls = []
    quantize = matmul._run_quantize_rows
    monkeypatch.setattr(matmul, "_run_quantize_rows", lambda rows, smooth: calls.append(1) or quantize(rows, smooth))
    with torch.no_grad():
        assert all(torch.equal(layer(x), y) for layer, y in zip(layers, before))
        assert len(calls) == 1
        x.mul_(-3)
        assert torch.equal(layers[0](x), after)
        assert len(calls) == 2
        layers[1](x.clone())
        assert len(calls) == 3


def test_int8_layer_follows_its_smooth_buffer(backend):
    # Empty or all ones is skipped (no multiplication); a buffer replaced, written in place
    # or loaded is applied.
    torch.manual_seed(1)
    layer = Linear8bit.from_float(nn.Linear(33, 5), "int8")
    x = torch.randn(4, 33)
    args = (layer.weight, layer.weight_scale, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), int8_linear(x, *args))
        layer.smooth = torch.ones(33)
        assert torch.equal(layer(x), int8_linear(x, *args))
        layer.smooth.copy_(torch.rand(33) + 0.5)
        assert torch.equal(layer(x), int8_linear(x, *args, smooth=layer.smooth))
        fresh = Linear8bit(33, 5, mode="int8")
        fresh(x)
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(fresh(x), layer(x))
