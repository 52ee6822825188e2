"""LayerNorm/RMSNorm kernels vs eager PyTorch, bounded by PyTorch's own error.

Every CPU test runs twice through the ``backend`` fixture: the interpreted Triton
kernel and the PyTorch reference path. The exact answer is eager PyTorch in float64
on the same inputs, with the same dropout mask (regenerated from the op's seed).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from slimformer.kernels import dispatch, norm as norm_kernels
from slimformer.kernels.norm import layer_norm, output_rebuilds_input, rms_norm
from slimformer.kernels.philox import dropout_keep_block, dropout_threshold, new_dropout_seed
from tests.aot_compile import ROOT
from tests.helpers import assert_within_reference_error, norm_rebuild_error_scales

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN_SIZES = [1, 17, 97, 768, 1000, 4096]
DROPOUT_P = 0.1
SEED = 1234


def _params(n_cols, dtype, bias=True, seed=0):
    """Weights the memory-efficient rebuild can trust: 0.5 <= |w| <= 1.5, |b| <= 3."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n_cols, generator=gen) < 0.2, -1.0, 1.0)
    weight = (0.5 + torch.rand(n_cols, generator=gen)) * sign
    b = (0.5 * torch.randn(n_cols, generator=gen)).clamp(-3, 3) if bias else None
    return weight.to(dtype), None if b is None else b.to(dtype)


def _eager(x, residual, weight, bias, keep, is_rms, eps, n_cols):
    """Unfused PyTorch: dropout with the given mask, residual add, F.layer_norm/F.rms_norm."""
    h = x if keep is None else torch.where(keep, x * dropout_threshold(DROPOUT_P)[1], torch.zeros_like(x))
    if residual is not None:
        h = h + residual
    if is_rms:
        return F.rms_norm(h, (n_cols,), weight, eps), h
    return F.layer_norm(h, (n_cols,), weight, bias, eps), h


def _run_and_grads(fn, leaves, dy, dh):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in leaves]
    y, h = fn(*leaves)
    loss = (y.double() * dy.double()).sum()
    if dh is not None:
        loss = loss + (h.double() * dh.double()).sum()
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present)
    return y, h, grads


def _check_norm(
    is_rms,
    dtype,
    n_cols,
    with_residual,
    with_dropout,
    memory_efficient,
    return_residual=False,
    device="cpu",
    dropout_after=False,
):
    torch.manual_seed(0)
    shape = (2, 3, n_cols)
    x = torch.randn(shape).to(device, dtype)
    residual = torch.randn(shape).to(device, dtype) if with_residual else None
    weight, bias = (None if t is None else t.to(device) for t in _params(n_cols, dtype, bias=not is_rms))
    eps = 1e-5
    dy = torch.randn(shape).to(device, dtype)
    dh = torch.randn(shape).to(device, dtype) if return_residual else None
    p = DROPOUT_P if with_dropout else 0.0
    keep = None
    if with_dropout:
        torch.manual_seed(SEED)
        rows = torch.arange(x.numel() // n_cols, device=device)
        keep = dropout_keep_block(new_dropout_seed(x.device), rows, 0, n_cols, n_cols, p).view(shape)

    def ours(x, residual, weight, bias):
        torch.manual_seed(SEED)
        if dropout_after:
            rebuilds = norm_kernels._checked_memory_mode(memory_efficient, weight, bias)
            out = norm_kernels.fused_norm(
                x,
                (n_cols,),
                weight,
                bias,
                eps,
                is_rms=is_rms,
                residual=residual,
                dropout_p=p,
                memory_efficient=rebuilds,
                return_residual=return_residual,
                dropout_after=True,
            )
            return out if return_residual else (out, None)
        kwargs = dict(residual=residual, dropout_p=p, memory_efficient=memory_efficient)
        if is_rms:
            out = rms_norm(x, (n_cols,), weight, eps, return_residual=return_residual, **kwargs)
        else:
            out = layer_norm(x, (n_cols,), weight, bias, eps, return_residual=return_residual, **kwargs)
        return out if return_residual else (out, None)

    def eager(x, residual, weight, bias):
        if not dropout_after:
            return _eager(x, residual, weight, bias, keep, is_rms, eps, n_cols)
        y, h = _eager(x, residual, weight, bias, None, is_rms, eps, n_cols)
        return y if keep is None else torch.where(keep, y * dropout_threshold(p)[1], torch.zeros_like(y)), h

    leaves = [x, residual, weight, None if is_rms else bias]
    y, h, grads = _run_and_grads(ours, leaves, dy, dh)
    y_torch, h_torch, grads_torch = _run_and_grads(eager, leaves, dy, dh)
    exact_leaves = [t.double() if t is not None else None for t in leaves]
    y_exact, h_exact, grads_exact = _run_and_grads(eager, exact_leaves, dy, dh)

    assert y.dtype == dtype
    assert_within_reference_error("y", y, y_torch, y_exact)
    if return_residual:
        assert_within_reference_error("h", h, h_torch, h_exact)
    dx_scale, dw_scale = 1.0, 1.0
    if memory_efficient and not (dropout_after and with_dropout):  # dropout after the norm: x is saved
        dx_scale, dw_scale = norm_rebuild_error_scales(h_exact.detach(), dy, weight, bias, is_rms, eps)
    scales = {"dx": dx_scale, "dresidual": dx_scale, "dweight": dw_scale, "dbias": 1.0}
    names = [n for n, t in zip(["dx", "dresidual", "dweight", "dbias"], leaves) if t is not None]
    for name, g, g_torch, g_exact in zip(names, grads, grads_torch, grads_exact):
        assert_within_reference_error(name, g, g_torch, g_exact, scale=scales[name])


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("fusion", ["plain", "residual", "dropout", "dropout+residual"])
@pytest.mark.parametrize("n_cols", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_matches_eager(backend, is_rms, dtype, n_cols, fusion, memory_efficient):
    _check_norm(is_rms, dtype, n_cols, "residual" in fusion, "dropout" in fusion, memory_efficient)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("n_cols", [97, 768])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_returned_residual_and_its_gradient(backend, is_rms, dtype, n_cols, memory_efficient):
    _check_norm(is_rms, dtype, n_cols, True, True, memory_efficient, return_residual=True)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_reference_in_small_row_blocks(monkeypatch, is_rms, memory_efficient):
    # The PyTorch reference works in blocks of rows (here 2 rows of 97 out of 6): the
    # dropout rows, the statistics and the summed dW/db must not depend on the blocks.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "REFERENCE_BLOCK_ELEMENTS", 2 * 97)
    _check_norm(is_rms, torch.float32, 97, True, True, memory_efficient, return_residual=True)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("with_dropout", [False, True], ids=["p0", "p0.1"])
@pytest.mark.parametrize("n_cols", [1, 97, 768, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_dropout_after_the_norm(backend, is_rms, dtype, n_cols, with_dropout, memory_efficient):
    # out = dropout(norm(x)), as BERT's embeddings end: dy is masked before the norm's backward.
    _check_norm(is_rms, dtype, n_cols, False, with_dropout, memory_efficient, dropout_after=True)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
def test_dropout_after_the_norm_in_column_blocks_and_row_blocks(backend, monkeypatch, memory_efficient):
    monkeypatch.setattr(norm_kernels, "_MAX_WHOLE_ROW", 64)
    monkeypatch.setattr(norm_kernels, "_WIDE_BLOCK_N", 32)
    monkeypatch.setattr(dispatch, "REFERENCE_BLOCK_ELEMENTS", 2 * 100)
    _check_norm(False, torch.float32, 100, False, True, memory_efficient, dropout_after=True)


@pytest.mark.parametrize("with_dropout", [False, True], ids=["p0", "p0.1"])
def test_dropout_after_the_norm_saves_the_input_unless_the_output_rebuilds_it(backend, with_dropout):
    # With p > 0 the output has zeros where y has not, so x is saved; with p = 0 the
    # memory-efficient mode saves the output, which the next layer keeps anyway.
    x = torch.randn(4, 97, requires_grad=True)
    weight, bias = _params(97, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm_kernels.fused_norm(
            x,
            97,
            weight,
            bias,
            1e-5,
            is_rms=False,
            dropout_p=0.1 * with_dropout,
            memory_efficient=True,
            dropout_after=True,
        )
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == (x if with_dropout else y).data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hidden_size_65536(backend, dtype):
    _check_norm(False, dtype, 65536, True, False, True)


@pytest.mark.parametrize("multiprocessors", [4, 18], ids=["whole-rows", "row-segments"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_rows_in_column_blocks(backend, monkeypatch, is_rms, memory_efficient, multiprocessors):
    # The kernels for rows wider than registers hold (here: > 64 columns, in blocks of 32,
    # the last one partial), with dropout, residual and the returned h. With 18 SMs for 6
    # rows, the forward splits each row into segments of 64 and 36 columns.
    monkeypatch.setattr(norm_kernels, "_MAX_WHOLE_ROW", 64)
    monkeypatch.setattr(norm_kernels, "_MAX_WHOLE_ROW_FORWARD", 64)
    monkeypatch.setattr(norm_kernels, "_WIDE_BLOCK_N", 32)
    monkeypatch.setattr(norm_kernels, "multiprocessor_count", lambda device: multiprocessors)
    _check_norm(is_rms, torch.float32, 100, True, True, memory_efficient, return_residual=True)


@pytest.mark.parametrize("multiprocessors", [1, 2, 7, 16])
@pytest.mark.parametrize("affine", ["weight", "bias", "weight+bias"])
def test_weight_grads_summed_over_programs(backend, monkeypatch, affine, multiprocessors):
    # dw and db: one partial row per program (here 1, 2, 7 or 13 of them: 200 rows of 16),
    # summed by the backward kernel over a binary tree of the programs, where odd counts
    # leave nodes without a sibling; weight-only and bias-only sums use the same tree.
    monkeypatch.setattr(norm_kernels, "multiprocessor_count", lambda device: multiprocessors)
    torch.manual_seed(0)
    x = torch.randn(200, 48, requires_grad=True)
    weight = torch.rand(48, requires_grad=True) + 0.5 if "weight" in affine else None
    bias = torch.randn(48, requires_grad=True) if "bias" in affine else None
    params = [t for t in (weight, bias) if t is not None]
    dy = torch.randn(200, 48)
    grads = torch.autograd.grad(layer_norm(x, 48, weight, bias), [x, *params], dy)
    exact = [t.detach().double().requires_grad_() for t in (x, *params)]
    exact_weight = exact[1] if weight is not None else None
    exact_bias = exact[-1] if bias is not None else None
    grads_ref = torch.autograd.grad(F.layer_norm(exact[0], (48,), exact_weight, exact_bias), exact, dy.double())
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
def test_without_affine_parameters(backend, affine):
    torch.manual_seed(0)
    x = torch.randn(5, 33, requires_grad=True)
    weight = torch.rand(33, requires_grad=True) + 0.5 if affine != "none" else None
    bias = torch.randn(33, requires_grad=True) if affine == "weight+bias" else None
    for memory_efficient in (False, True):
        y = layer_norm(x, 33, weight, bias, memory_efficient=memory_efficient)
        y_ref = F.layer_norm(x, (33,), weight, bias)
        torch.testing.assert_close(y, y_ref)
        leaves = [t for t in (x, weight, bias) if t is not None]
        grads = torch.autograd.grad(y.square().sum(), leaves)
        grads_ref = torch.autograd.grad(y_ref.square().sum(), leaves)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_multi_dimensional_normalized_shape(backend):
    x = torch.randn(3, 4, 5, 6, requires_grad=True)
    weight = torch.rand(5, 6, requires_grad=True) + 0.5
    bias = torch.randn(5, 6, requires_grad=True)
    y = layer_norm(x, (5, 6), weight, bias)
    y_ref = F.layer_norm(x, (5, 6), weight, bias)
    torch.testing.assert_close(y, y_ref)
    grads = torch.autograd.grad((y * y_ref.detach()).sum(), (x, weight, bias))
    grads_ref = torch.autograd.grad((y_ref * y_ref.detach()).sum(), (x, weight, bias))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_rms_norm_default_eps_is_dtype_eps(backend):
    x = torch.full((2, 8), 1e-4, dtype=torch.float16)
    torch.testing.assert_close(rms_norm(x, 8), F.rms_norm(x, (8,)))


def test_rms_norm_default_eps_of_float64_is_float64s(backend):
    # torch takes the eps of the accumulation type: float64's (float32's would give 3e-6 here)
    x = torch.full((2, 8), 1e-9, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, 8), F.rms_norm(x, (8,)), rtol=1e-12, atol=0)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("dropout_after", [False, True], ids=["dropout+residual", "dropout-after"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float64_matches_eager_float64_and_passes_gradcheck(backend, is_rms, dropout_after, memory_efficient):
    # float64 takes the PyTorch reference in float64 on every device (with "triton", the
    # branch CUDA tensors take), the output rebuilt from in memory-efficient mode included
    n_cols, eps, shape = 7, 1e-5, (2, 3, 7)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    residual = None if dropout_after else torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    weight, bias = (None if t is None else t.requires_grad_() for t in _params(n_cols, torch.float64, not is_rms))

    def ours(x, residual, weight, bias):
        torch.manual_seed(SEED)
        rebuilds = norm_kernels._checked_memory_mode(memory_efficient, weight, bias)
        return norm_kernels.fused_norm(
            x,
            (n_cols,),
            weight,
            bias,
            eps,
            is_rms=is_rms,
            residual=residual,
            dropout_p=DROPOUT_P,
            memory_efficient=rebuilds,
            dropout_after=dropout_after,
        )

    torch.manual_seed(SEED)
    keep = dropout_keep_block(new_dropout_seed(x.device), torch.arange(6), 0, n_cols, n_cols, DROPOUT_P).view(shape)
    scale = dropout_threshold(DROPOUT_P)[1]
    h = x if dropout_after else torch.where(keep, x * scale, 0.0) + residual
    expected = F.rms_norm(h, (n_cols,), weight, eps) if is_rms else F.layer_norm(h, (n_cols,), weight, bias, eps)
    if dropout_after:
        expected = torch.where(keep, expected * scale, 0.0)
    inputs = (x, residual, weight, bias)
    y = ours(*inputs)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    leaves = [t for t in inputs if t is not None]
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    for g, g_ref in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(expected, leaves, dy)):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(ours, inputs, fast_mode=True)


def test_non_contiguous_input_and_stride_zero_gradient(backend):
    torch.manual_seed(0)
    base = torch.randn(40, 6, requires_grad=True)
    x = base.t()  # (6, 40), non-contiguous
    weight, bias = _params(40, torch.float32)
    residual = torch.randn(40, 6).t()
    y = layer_norm(x, 40, weight, bias, residual=residual, memory_efficient=True)
    y.sum().backward()  # the incoming gradient has stride 0
    grad = base.grad.clone()
    base.grad = None
    F.layer_norm(x + residual, (40,), weight, bias).sum().backward()
    torch.testing.assert_close(grad, base.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0)])
def test_empty_inputs(backend, shape):
    x = torch.randn(shape, requires_grad=True)
    n_cols = shape[-1]
    weight = torch.ones(n_cols, requires_grad=True)
    bias = torch.zeros(n_cols, requires_grad=True)
    y, h = layer_norm(x, n_cols, weight, bias, residual=torch.zeros(shape), dropout_p=0.1, return_residual=True)
    assert y.shape == shape and h.shape == shape
    (y.sum() + h.sum()).backward()
    assert x.grad.shape == shape
    assert torch.equal(weight.grad, torch.zeros(n_cols)) and torch.equal(bias.grad, torch.zeros(n_cols))


def test_nan_and_inf_propagate_like_torch(backend):
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    weight, bias = _params(16, torch.float32)
    y = layer_norm(x, 16, weight, bias)
    y_ref = F.layer_norm(x, (16,), weight, bias)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    torch.testing.assert_close(y[[0, 3]], y_ref[[0, 3]])


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_gradients_accumulate_over_steps_into_leaf_input_and_residual(backend, is_rms):
    # dx and dresidual are one tensor here; they must not become two .grad sharing storage
    norm, eager = (rms_norm, F.rms_norm) if is_rms else (layer_norm, F.layer_norm)
    weight, _ = _params(16, torch.float32)
    x, residual = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16, requires_grad=True)
    x_ref, residual_ref = (t.detach().clone().requires_grad_(True) for t in (x, residual))
    dy = torch.randn(2, 3, 16)
    for _ in range(2):
        (norm(x, (16,), weight, residual=residual) * dy).sum().backward()
        (eager(x_ref + residual_ref, (16,), weight) * dy).sum().backward()
    assert x.grad.data_ptr() != residual.grad.data_ptr()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual.grad, residual_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fusion", ["plain", "residual"])
def test_output_can_be_modified_in_place(backend, fusion):
    # as F.layer_norm's can; the saved-output mode then fails loudly, as torch does for saved tensors
    x = torch.randn(2, 3, 16, requires_grad=True)
    weight, bias = (p.requires_grad_(True) for p in _params(16, torch.float32))
    residual = torch.randn(2, 3, 16) if fusion == "residual" else None
    y = layer_norm(x, (16,), weight, bias, residual=residual)
    F.relu(y, inplace=True)
    y.sum().backward()
    h = x.detach() if residual is None else x.detach() + residual
    expected = F.layer_norm(h.requires_grad_(True), (16,), weight.detach(), bias.detach())
    F.relu(expected).sum().backward()
    torch.testing.assert_close(x.grad, h.grad, rtol=1e-5, atol=1e-5)
    y = layer_norm(x, (16,), weight, bias, memory_efficient=True)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place.*use memory_efficient=False"):
        y.sum().backward()


def test_nan_propagates_through_dropped_elements_like_torch(backend):
    # torch's dropout multiplies by the scaled mask, so a dropped NaN stays NaN
    x = torch.full((4, 64), float("nan"), requires_grad=True)
    y, h = layer_norm(x, 64, residual=torch.zeros(4, 64), dropout_p=0.5, return_residual=True)
    assert torch.isnan(h).all() and torch.isnan(y).all()
    y.sum().backward()
    assert torch.isnan(x.grad).all()


class TestDropout:
    def _dropped(self, shape, p, seed):
        """h = dropout(ones) through the fused op (residual 0), and the op's output."""
        torch.manual_seed(seed)
        x = torch.ones(shape, requires_grad=True)
        y, h = layer_norm(x, shape[-1], residual=torch.zeros(shape), dropout_p=p, return_residual=True)
        return x, y, h

    def test_same_seed_same_mask_and_new_seed_new_mask(self, backend):
        _, y1, h1 = self._dropped((8, 256), 0.3, seed=7)
        _, y2, h2 = self._dropped((8, 256), 0.3, seed=7)
        _, _, h3 = self._dropped((8, 256), 0.3, seed=8)
        assert torch.equal(h1, h2) and torch.equal(y1, y2)
        assert not torch.equal(h1 == 0, h3 == 0)

    @pytest.mark.parametrize("p", [0.1, 0.5])
    def test_keep_fraction(self, backend, p):
        # 2^18 draws: the keep fraction's standard deviation is <= 0.001, a tenth of the tolerance
        _, _, h = self._dropped((64, 4096), p, seed=0)
        keep_fraction = (h != 0).float().mean().item()
        threshold, scale = dropout_threshold(p)
        assert abs(keep_fraction - (1 - threshold / 256)) < 0.01
        kept = h[h != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, scale))

    def test_backward_uses_the_forward_mask(self, backend):
        x, y, h = self._dropped((16, 97), 0.4, seed=3)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
        dropped = h == 0
        assert dropped.any() and (~dropped).any()
        assert torch.equal(x.grad[dropped], torch.zeros_like(x.grad[dropped]))
        assert (x.grad[~dropped] != 0).all()

    def test_kernel_and_reference_draw_the_same_mask(self, monkeypatch):
        masks = []
        for interpret in ("1", "0"):
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
            masks.append(self._dropped((8, 300), 0.25, seed=11)[2] == 0)
        assert torch.equal(masks[0], masks[1])


def test_output_rebuilds_input():
    ones = torch.ones(4)
    assert output_rebuilds_input(None, None)
    assert output_rebuilds_input(ones, torch.full((4,), 6.9))
    assert not output_rebuilds_input(ones, torch.full((4,), 7.5))
    assert not output_rebuilds_input(torch.tensor([1.0, 0.0, 1.0, 1.0]), None)
    assert not output_rebuilds_input(torch.tensor([1.0, float("nan"), 1.0, 1.0]), None)


def test_float64_op_passes_opcheck(monkeypatch):
    # float64 statistics in the fake (meta) function too, as torch.compile traces them
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' branch: float64 must leave it
    x, residual = (torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight, bias = (t.requires_grad_() for t in _params(7, torch.float64))
    seed = new_dropout_seed(x.device)
    args = (x, residual, weight, bias, seed, False, 1, 1e-5, DROPOUT_P, True, True, torch.float64, False)
    torch.library.opcheck(norm_kernels._norm_op, args, test_utils="test_faketensor")


class TestBadInput:
    def test_wrong_normalized_shape(self):
        with pytest.raises(ValueError, match="normalized_shape"):
            layer_norm(torch.randn(2, 8), (7,))
        with pytest.raises(ValueError, match="normalized_shape"):
            layer_norm(torch.randn(8), (2, 8))

    def test_too_many_features(self):
        with pytest.raises(ValueError, match="65536"):
            layer_norm(torch.randn(1, 65537), 65537)

    def test_weight_and_bias_shape_and_device(self):
        with pytest.raises(ValueError, match="weight must have shape"):
            layer_norm(torch.randn(2, 8), 8, torch.ones(7))
        with pytest.raises(ValueError, match="bias must have shape"):
            layer_norm(torch.randn(2, 8), 8, torch.ones(8), torch.zeros(9))
        with pytest.raises(ValueError, match="weight must be on the input's device"):
            layer_norm(torch.randn(2, 8), 8, torch.ones(8, device="meta"))
        with pytest.raises(ValueError, match="residual must have shape"):
            layer_norm(torch.randn(2, 8), 8, residual=torch.randn(2, 7))

    def test_dtypes(self):
        with pytest.raises(TypeError, match="input must be float32, float16, bfloat16 or float64, got torch.int64"):
            layer_norm(torch.ones(2, 8, dtype=torch.int64), 8)
        with pytest.raises(TypeError, match="weight dtype must match input dtype torch.float64"):
            layer_norm(torch.randn(2, 8, dtype=torch.float64), 8, torch.ones(8))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts no float64 tensor: no mixing there either
            with pytest.raises(TypeError, match="bias dtype must match input dtype torch.float32 when either is"):
                layer_norm(torch.randn(2, 8), 8, torch.ones(8), torch.zeros(8, dtype=torch.float64))
        with pytest.raises(TypeError, match="weight dtype must match input dtype"):
            layer_norm(torch.randn(2, 8, dtype=torch.float16), 8, torch.ones(8))
        with pytest.raises(TypeError, match="residual dtype must match"):
            rms_norm(torch.randn(2, 8), 8, residual=torch.randn(2, 8, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            layer_norm([1.0, 2.0], 2)

    def test_dropout_and_return_residual(self):
        with pytest.raises(ValueError, match="dropout_p"):
            layer_norm(torch.randn(2, 8), 8, dropout_p=1.0)
        with pytest.raises(ValueError, match="return_residual"):
            layer_norm(torch.randn(2, 8), 8, return_residual=True)


def test_mixed_dtypes_allowed_under_autocast(backend):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    weight = torch.rand(32) + 0.5
    bias = torch.randn(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer_norm(x, 32, weight, bias)
        y_ref = F.layer_norm(x, (32,), weight, bias)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save-input", "save-output"])
@pytest.mark.parametrize("fusion", ["plain", "dropout+residual"])
@pytest.mark.parametrize("n_cols", [1, 97, 768, 1000, 4096, 8192, 65536])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_compiled_kernel_on_gpu(is_rms, dtype, n_cols, fusion, memory_efficient):
    _check_norm(is_rms, dtype, n_cols, "residual" in fusion, "dropout" in fusion, memory_efficient, device="cuda")


def compiled_backward_rounded_products() -> dict[str, int]:
    """{kernel (columns): PTX mul.rn instructions (never contracted) in its sm_90 PTX} of the norm backward kernels,
    whole-row (1 column) and wide (65536), specialised as the JIT would (run without
    TRITON_INTERPRET)."""
    from tools.compile_report.capture import H100, capture, compile_launch

    counts = {}
    for n_cols in (1, 65536):

        def forward():
            x, w, b = (torch.randn(shape, requires_grad=True) for shape in ((3, n_cols), (n_cols,), (n_cols,)))
            y = layer_norm(x, n_cols, w, b)
            return lambda: torch.autograd.grad(y, [x, w, b], torch.ones_like(y))

        for launch in capture(H100, forward).launches:
            if launch.phase == "bwd" and launch.kernel.startswith("_norm_bwd"):
                counts[f"{launch.kernel} ({n_cols})"] = compile_launch(launch).asm["ptx"].count("mul.rn.f32")
    return counts


def test_compiled_backward_rounds_g_once():
    # On an H200, a one-column fp32 LayerNorm's dx came out ~1e-5 where it is 0: the
    # compiler had contracted g = dy · w into g - mean(g) as a fused multiply-add, so g
    # entered unrounded there and rounded in mean(g), and rstd = 1 / sqrt(eps) amplified
    # the difference. Compiled for sm_90, the backward kernels compute g with mul.rn, which
    # is never contracted (the rest keeps its fused multiply-adds).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_norm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    counts = json.loads(result.stdout.splitlines()[-1])
    assert set(counts) == {"_norm_bwd_kernel (1)", "_norm_bwd_wide_kernel (65536)"}, counts
    assert all(n >= 1 for n in counts.values()), counts


if __name__ == "__main__":
    print(json.dumps(compiled_backward_rounded_products()))
