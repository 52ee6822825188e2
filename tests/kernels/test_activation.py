"""Fused bias + activation + dropout and the recomputing MLP vs eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from slimformer.kernels import dispatch
from slimformer.kernels.activation import ACTIVATIONS, fused_mlp
from slimformer.kernels.philox import dropout_keep_block, dropout_threshold, new_dropout_seed
from slimformer.layers.mlp import FusedMLP
from slimformer.memory import measure_activation_memory
from tests.helpers import assert_within_reference_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEED = 99


def _eager_mlp(x, w1, b1, w2, b2, activation, keep, p):
    h = F.linear(x, w1, b1)
    if activation in ("swiglu", "geglu"):  # ModernBERT's GeGLU: input, gate = chunk(2); gelu(input) * gate
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate) if activation == "swiglu" else F.gelu(gate)) * up
    elif activation == "relu":
        a = F.relu(h)
    else:
        a = F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
    if keep is not None:
        a = torch.where(keep, a * dropout_threshold(p)[1], torch.zeros_like(a))
    return F.linear(a, w2, b2)


def _mlp_inputs(rows, d_model, d_ff, activation, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    fc1_rows = 2 * d_ff if activation in ("swiglu", "geglu") else d_ff
    shapes = [(rows, d_model), (fc1_rows, d_model), (fc1_rows,), (d_model, d_ff), (d_model,)]
    scales = [1.0, d_model**-0.5, 0.5, d_ff**-0.5, 0.5]
    return [(torch.randn(s, generator=gen) * c).to(device, dtype) for s, c in zip(shapes, scales)]


def _check_mlp(activation, dtype, rows, d_model, d_ff, dropout_p, recompute_fc1, device="cpu"):
    leaves = _mlp_inputs(rows, d_model, d_ff, activation, dtype, device)
    keep = None
    if dropout_p:
        torch.manual_seed(SEED)
        seed = new_dropout_seed(torch.device(device))
        keep = dropout_keep_block(seed, torch.arange(rows, device=device), 0, d_ff, d_ff, dropout_p)
    dy = torch.randn(rows, d_model).to(device, dtype)

    def run(fn, tensors):
        tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
        out = fn(*tensors)
        return (out, *torch.autograd.grad(out, tensors, dy.to(out.dtype)))

    def ours(*t):
        torch.manual_seed(SEED)
        return fused_mlp(*t, activation, dropout_p, recompute_fc1)

    def eager(*t):
        return _eager_mlp(*t, activation, keep, dropout_p)

    results = run(ours, leaves)
    torch_results = run(eager, leaves)
    exact = run(eager, [t.double() for t in leaves])
    for name, actual, same_dtype, exact_value in zip(
        ["out", "dx", "dw1", "db1", "dw2", "db2"], results, torch_results, exact
    ):
        assert_within_reference_error(name, actual, same_dtype, exact_value)


@pytest.mark.parametrize("recompute_fc1", [False, True], ids=["keep-fc1", "recompute-fc1"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("rows, d_model, d_ff", [(1, 16, 24), (17, 40, 72), (97, 24, 200)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_mlp_matches_eager(backend, activation, dtype, rows, d_model, d_ff, dropout_p, recompute_fc1):
    _check_mlp(activation, dtype, rows, d_model, d_ff, dropout_p, recompute_fc1)


@pytest.mark.parametrize("recompute_fc1", [False, True], ids=["keep-fc1", "recompute-fc1"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "geglu"])
def test_reference_in_small_row_blocks(monkeypatch, activation, recompute_fc1):
    # The PyTorch path runs the MLP in blocks of rows (5 rows of fc1's 200 or 400 columns
    # here, 97 rows in all): dropout rows, recomputed fc1 and the summed weight gradients
    # must not depend on the blocks.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "REFERENCE_BLOCK_ELEMENTS", 5 * 200)
    _check_mlp(activation, torch.float32, 97, 24, 200, 0.2, recompute_fc1)


@pytest.mark.parametrize(
    "activation, recompute_fc1",
    [("relu", False), ("gelu", True), ("gelu_tanh", False), ("swiglu", True), ("geglu", False)],
)
def test_float64_matches_eager_float64_and_passes_gradcheck(backend, activation, recompute_fc1):
    # float64 takes the PyTorch reference in float64 on every device (with "triton", the
    # branch CUDA tensors take): elementwise math and weight-gradient sums included
    rows, d_model, d_ff, p = 5, 4, 6, 0.2
    leaves = [t.requires_grad_() for t in _mlp_inputs(rows, d_model, d_ff, activation, torch.float64)]
    torch.manual_seed(SEED)
    keep = dropout_keep_block(new_dropout_seed(torch.device("cpu")), torch.arange(rows), 0, d_ff, d_ff, p)

    def ours(*t):
        torch.manual_seed(SEED)
        return fused_mlp(*t, activation, p, recompute_fc1)

    out, expected = ours(*leaves), _eager_mlp(*leaves, activation, keep, p)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    dy = torch.randn(rows, d_model, dtype=torch.float64)
    for g, g_ref in zip(torch.autograd.grad(out, leaves, dy), torch.autograd.grad(expected, leaves, dy)):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(ours, leaves, fast_mode=True)


def test_float64_stays_float64_under_autocast_like_linear(backend):
    x, w1, b1, w2, b2 = _mlp_inputs(3, 4, 6, "gelu", torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = fused_mlp(x, w1, b1, w2, b2, "gelu"), _eager_mlp(x, w1, b1, w2, b2, "gelu", None, 0.0)
    assert out.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_no_bias_and_leading_dims(backend):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, requires_grad=True)
    w1, w2 = torch.randn(12, 8, requires_grad=True), torch.randn(8, 12, requires_grad=True)
    out = fused_mlp(x, w1, None, w2, None, "gelu")
    ref = F.linear(F.gelu(F.linear(x, w1)), w2)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (x, w1, w2))  # stride-0 incoming gradient
    grads_ref = torch.autograd.grad(ref.sum(), (x, w1, w2))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


def test_empty_batch(backend):
    x = torch.randn(0, 8, requires_grad=True)
    w1, b1, w2, b2 = (torch.randn(s, requires_grad=True) for s in [(12, 8), (12,), (8, 12), (8,)])
    out = fused_mlp(x, w1, b1, w2, b2, "relu", 0.1)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(b2.grad, torch.zeros_like(b2))


def test_dropout_reproducible_and_keep_fraction(backend):
    x = torch.randn(64, 16)
    w1, b1 = torch.eye(16).repeat(8, 1), torch.full((128,), 5.0)  # act(h) > 0 everywhere
    w2 = torch.eye(16).repeat(1, 8)[:, :128] * 0 + torch.eye(128)[:16]  # picks the first 16 units
    torch.manual_seed(1)
    first = fused_mlp(x, w1, b1, w2, None, "relu", 0.5)
    torch.manual_seed(1)
    second = fused_mlp(x, w1, b1, w2, None, "relu", 0.5)
    assert torch.equal(first, second)
    kept = (first != 0).float().mean().item()
    assert abs(kept - 0.5) < 0.05  # 1024 draws: 3 standard deviations


class TestMemory:
    rows, d_model, d_ff = 32, 16, 64

    def _kept(self, fn):
        leaves = _mlp_inputs(self.rows, self.d_model, self.d_ff, "gelu", torch.float32)
        x = leaves[0].requires_grad_(True)
        params = [t.requires_grad_(True) for t in leaves[1:]]
        return measure_activation_memory(fn, x, *params, exclude=params)

    def test_keeps_only_fc1_output_or_nothing(self, backend):
        h_bytes = 4 * self.rows * self.d_ff
        for recompute_fc1, expected in ((False, h_bytes), (True, 0)):
            kept = self._kept(lambda *t, recompute=recompute_fc1: fused_mlp(*t, "gelu", 0.1, recompute))
            seed_bytes = 8  # the int64 dropout seed
            assert kept.saved_bytes == kept.alive_bytes == expected + seed_bytes

    def test_eager_keeps_its_activation_and_mask_too(self):
        eager = self._kept(lambda x, w1, b1, w2, b2: F.linear(F.dropout(F.gelu(F.linear(x, w1, b1)), 0.1), w2, b2))
        ours = self._kept(lambda *t: fused_mlp(*t, "gelu", 0.1))
        # at least fc1's output and the dropped activation (fc2's input), plus the mask
        assert eager.saved_bytes > 8 * self.rows * self.d_ff
        assert ours.saved_bytes == 4 * self.rows * self.d_ff + 8


def test_layer_state_dict_and_train_eval(backend):
    layer = FusedMLP(16, 48, activation="swiglu", dropout=0.5)
    assert set(layer.state_dict()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert layer.fc1.out_features == 96
    x = torch.randn(4, 16)
    layer.eval()
    gate, up = layer.fc1(x).chunk(2, dim=-1)
    torch.testing.assert_close(layer(x), layer.fc2(F.silu(gate) * up))
    layer.train()
    assert not torch.allclose(layer(x), layer.fc2(F.silu(gate) * up))


class TestBadInput:
    def test_activation_and_dropout(self):
        w = torch.randn(8, 8)
        with pytest.raises(ValueError, match="activation must be one of"):
            fused_mlp(torch.randn(2, 8), w, None, w, None, "tanh")
        with pytest.raises(ValueError, match="dropout_p"):
            fused_mlp(torch.randn(2, 8), w, None, w, None, "gelu", 1.5)
        with pytest.raises(ValueError, match="activation must be one of"):
            FusedMLP(8, 8, activation="elu")

    def test_shapes_dtypes_devices(self):
        x = torch.randn(2, 8)
        with pytest.raises(ValueError, match=r"fc1_weight must have shape \(out_features, 8\)"):
            fused_mlp(x, torch.randn(12, 7), None, torch.randn(8, 12), None)
        with pytest.raises(ValueError, match=r"fc2_weight must have shape \(out_features, 12\)"):
            fused_mlp(x, torch.randn(12, 8), None, torch.randn(8, 11), None)
        with pytest.raises(ValueError, match="fc1_bias must have shape"):
            fused_mlp(x, torch.randn(12, 8), torch.randn(11), torch.randn(8, 12), None)
        with pytest.raises(TypeError, match="fc2_weight dtype must match"):
            fused_mlp(x, torch.randn(12, 8), None, torch.randn(8, 12, dtype=torch.float16), None)
        with pytest.raises(ValueError, match="fc1_weight must be on the input's device"):
            fused_mlp(x, torch.randn(12, 8, device="meta"), None, torch.randn(8, 12), None)
        with pytest.raises(ValueError, match="even number of rows"):
            fused_mlp(x, torch.randn(13, 8), None, torch.randn(8, 6), None, "swiglu")
        with pytest.raises(TypeError, match="x must be a float32, float16, bfloat16 or float64 torch.Tensor, got"):
            fused_mlp(x.long(), torch.randn(12, 8), None, torch.randn(8, 12), None)
        with pytest.raises(TypeError, match="fc1_weight dtype must match input dtype torch.float64, got torch.float32"):
            fused_mlp(x.double(), torch.randn(12, 8), None, torch.randn(8, 12), None)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts no float64 tensor, as nn.Linear's
            with pytest.raises(TypeError, match="fc2_weight dtype must match input dtype torch.bfloat16"):
                fused_mlp(x, torch.randn(12, 8), None, torch.randn(8, 12, dtype=torch.float64), None)
        with pytest.raises(ValueError, match="x must have at least one dimension"):
            fused_mlp(torch.tensor(1.0), torch.randn(12, 8), None, torch.randn(8, 12), None)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_compiled_kernels_on_gpu(activation, dtype, dropout_p):
    _check_mlp(activation, dtype, 1000, 768, 3072, dropout_p, True, device="cuda")
