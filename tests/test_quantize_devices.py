"""A quantized model saved on one device loads on another bit-exactly (the file format is
device-free: int8 weights, bfloat16 scales, fp32 smoothing factors, the bias in its dtype)."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from slimformer.quantize import CONFIG_FILE, WEIGHTS_FILE, load_quantized, quantize, save_quantized

INT8_DTYPES = {"weight": torch.int8, "weight_scale": torch.bfloat16, "bias": torch.float32}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8))


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key].cpu(), sb[key].cpu()), key


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_cpu_quantized_model_saves_the_int8_format_and_reloads_bit_exactly(tmp_path, mode):
    quantized = quantize(_model(), mode)
    save_quantized(quantized, tmp_path)
    state = load_file(tmp_path / WEIGHTS_FILE)
    for layer in ("0", "2"):
        for name, dtype in INT8_DTYPES.items():
            assert state[f"{layer}.{name}"].dtype == dtype
        assert f"{layer}.smooth" not in state  # unsmoothed: the config gives the mode
        assert state[f"{layer}.weight"].abs().max() <= 127
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["modules"] == {"0": mode, "2": mode}
    loaded = load_quantized(_model(), tmp_path)
    _assert_same_state(loaded, quantized)
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert torch.equal(loaded(x), quantized(x))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_saved_on_cpu_loads_on_gpu_and_back_bit_exactly(tmp_path, mode):
    quantized = quantize(_model(), mode)
    save_quantized(quantized, tmp_path / "cpu")
    on_gpu = load_quantized(_model().cuda(), tmp_path / "cpu")
    assert all(t.is_cuda for t in on_gpu.state_dict().values())
    _assert_same_state(on_gpu, quantized)
    save_quantized(on_gpu, tmp_path / "gpu")
    back = load_quantized(_model(), tmp_path / "gpu")
    _assert_same_state(back, quantized)
    x = torch.randn(33, 24)
    with torch.no_grad():
        # Same integers and scales; the compiled epilogue may fuse a multiply-add.
        atol = _cpu_atol(back, x, mode)
        torch.testing.assert_close(on_gpu(x.cuda()).cpu(), copy.deepcopy(back)(x), rtol=1e-5, atol=atol)


def _cpu_atol(model: nn.Module, x: torch.Tensor, mode: str) -> float:
    """1e-5, plus for CPU W8A16 its rounding of each activation row to steps of max|row| / 32639
    (the GPU multiplies fp32 inputs as they are): half a step per element times the largest
    row sum of |weight|, through both Linears (GELU's slope stays below 1.13)."""
    if mode != "int8-weight-only":
        return 1e-5
    w0, w2 = (model[i].dequantized_weight().abs().sum(1).max().item() for i in (0, 2))
    with torch.no_grad():
        hidden = model[1](model[0](x))
    first = w0 * x.abs().max().item() / 65278
    return 1e-5 + w2 * (1.13 * first + hidden.abs().max().item() / 65278)
