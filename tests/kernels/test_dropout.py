"""Fused dropout + residual add vs eager PyTorch with the same mask."""

import math

import pytest
import torch

from slimformer.kernels.dropout import dropout_add
from slimformer.kernels.philox import dropout_keep_block, dropout_threshold, new_dropout_seed
from slimformer.memory import measure_activation_memory


def _keep(shape, p):
    """The mask drawn from torch's next seed: rows of x's last dimension."""
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    seed = new_dropout_seed(torch.device("cpu"))
    return dropout_keep_block(seed, torch.arange(n_rows), 0, n_cols, n_cols, p).view(shape)


SCALE = dropout_threshold(0.3)[1]  # 1 / (1 - p_eff), p = 0.3 quantised to 77 / 256


@pytest.mark.parametrize("shape", [(1,), (17, 97), (3, 5, 40), (0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_eager_with_the_same_mask(backend, dtype, shape):
    x = torch.randn(shape).to(dtype).requires_grad_(True)
    residual = torch.randn(shape).to(dtype).requires_grad_(True)
    torch.manual_seed(3)
    out = dropout_add(x, residual, 0.3)
    torch.manual_seed(3)
    keep = _keep(shape, 0.3)
    # float32 math, one rounding to the dtype at the end, as the kernel does (torch's
    # default tolerances per dtype allow that one rounding to differ by an ulp)
    expected = (residual.float() + torch.where(keep, x.float() * SCALE, 0.0)).to(dtype)
    torch.testing.assert_close(out, expected)
    dout = torch.randn(shape).to(dtype)
    dx, dres = torch.autograd.grad(out, (x, residual), dout)
    torch.testing.assert_close(dx, torch.where(keep, dout.float() * SCALE, 0.0).to(dtype))
    torch.testing.assert_close(dres, dout, rtol=0, atol=0)


def test_keeps_only_the_seed_and_eval_is_identity(backend):
    x = torch.randn(64, 32, requires_grad=True)
    residual = torch.randn(64, 32, requires_grad=True)
    kept = measure_activation_memory(dropout_add, x, residual, 0.1)
    assert kept.saved_bytes == kept.alive_bytes == 8  # the int64 seed
    torch.testing.assert_close(dropout_add(x, residual, 0.1, training=False), x + residual)


def test_mixed_dtypes_promote_like_torch_add(backend):
    # a bf16 branch (autocast) onto an fp32 residual stream, as in a pre-LN block
    x = torch.randn(6, 40).to(torch.bfloat16).requires_grad_(True)
    residual = torch.randn(6, 40, requires_grad=True)
    torch.manual_seed(2)
    out = dropout_add(x, residual, 0.3)
    torch.manual_seed(2)
    keep = _keep(x.shape, 0.3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, residual + torch.where(keep, x.float() * SCALE, 0.0))
    dout = torch.randn(6, 40)
    dx, dres = torch.autograd.grad(out, (x, residual), dout)
    assert dx.dtype == torch.bfloat16 and dres.dtype == torch.float32
    torch.testing.assert_close(dx, torch.where(keep, dout * SCALE, 0.0).to(torch.bfloat16))
    torch.testing.assert_close(dres, dout, rtol=0, atol=0)


def test_float64_in_float64_and_gradcheck(backend):
    # float64 takes the PyTorch reference in float64 on every device (with "triton", the
    # branch CUDA tensors take); a float32 branch onto a float64 residual promotes like torch's add
    x = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)

    def ours(x, residual):
        torch.manual_seed(2)
        return dropout_add(x, residual, 0.3)

    torch.manual_seed(2)
    keep = _keep(x.shape, 0.3)
    torch.testing.assert_close(ours(x, residual), residual + torch.where(keep, x * SCALE, 0.0), rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(ours, (x, residual), fast_mode=True)
    mixed = ours(x.detach().float(), residual.detach())
    assert mixed.dtype == torch.float64
    torch.testing.assert_close(mixed, residual + torch.where(keep, x.float().double() * SCALE, 0.0), rtol=1e-15, atol=0)


def test_keep_fraction(backend):
    out = dropout_add(torch.ones(512, 512), torch.zeros(512, 512), 0.25)
    assert abs((out != 0).float().mean().item() - 0.75) < 0.01


def test_nan_propagates_through_dropped_elements_like_torch(backend):
    x = torch.full((8, 64), float("nan"), requires_grad=True)
    out = dropout_add(x, torch.zeros(8, 64), 0.5)
    assert torch.isnan(out).all()
    dout = torch.full((8, 64), float("nan"))
    (dx,) = torch.autograd.grad(out, x, dout)
    assert torch.isnan(dx).all()


def test_bad_input():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        dropout_add(x, torch.randn(4, 5), 0.1)
    with pytest.raises(ValueError, match="residual must be on x's device"):
        dropout_add(x, torch.randn(4, 4, device="meta"), 0.1)
    with pytest.raises(TypeError, match="residual must be a float32, float16, bfloat16 or float64 torch.Tensor, got"):
        dropout_add(x, x.int(), 0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_add(x, x, -0.1)
    with pytest.raises(TypeError, match="x must be a float32, float16, bfloat16 or float64 torch.Tensor, got"):
        dropout_add(x.long(), x, 0.1)
