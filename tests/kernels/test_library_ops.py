"""Every differentiable op is a ``torch.library`` custom op that passes ``opcheck``: its
schema, fake (meta) function, autograd registration and AOT dispatch, forward and backward.

The ops run their PyTorch reference here (the kernels are tested against it elsewhere);
small shapes, fp32 and bf16, with and without dropout.
"""

import pytest
import torch

from slimformer.kernels.activation import _mlp_backward_op, _mlp_op
from slimformer.kernels.attention.ops import (
    attention_op as _attention_op,
    self_attention_op as _self_attention_op,
    varlen_attention_op as _varlen_op,
)
from slimformer.kernels.dropout import _dropout_add_op
from slimformer.kernels.linear_cross_entropy import _linear_cross_entropy_op
from slimformer.kernels.norm import _norm_op
from slimformer.kernels.philox import new_dropout_seed
from slimformer.kernels.projection import _projections_backward_op, _projections_op

DTYPES = [torch.float32, torch.bfloat16]
# each op in fp32 without dropout and in bf16 with it (half the cross product's time)
DTYPE_DROPOUT = pytest.mark.parametrize(
    "dtype, dropout_p", [(torch.float32, 0.0), (torch.bfloat16, 0.25)], ids=["fp32", "bf16-dropout"]
)


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _randn(*shape, dtype, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _seed(dropout_p):
    return new_dropout_seed(torch.device("cpu")) if dropout_p > 0 else None


def _opcheck(op, args):
    # test_autograd_registration, test_faketensor, test_aot_dispatch_static/dynamic, test_schema
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.25])
def test_dropout_add(dtype, dropout_p):
    x, residual = _randn(3, 5, 17, dtype=dtype), _randn(3, 5, 17, dtype=torch.float32)
    _opcheck(_dropout_add_op, (x, residual, _seed(dropout_p), dropout_p))


@DTYPE_DROPOUT
@pytest.mark.parametrize(
    "is_rms, rebuild_from_output, with_residual, return_residual, dropout_after",
    [
        (False, False, False, False, False),
        (False, True, True, False, False),
        (False, False, True, True, False),
        (True, True, True, True, False),
        (False, False, False, False, True),
    ],
    ids=["layer-plain", "layer-rebuild-residual", "layer-return-residual", "rms-rebuild-return", "layer-dropout-after"],
)
def test_fused_norm(dtype, dropout_p, is_rms, rebuild_from_output, with_residual, return_residual, dropout_after):
    x = _randn(2, 7, 24, dtype=dtype)
    residual = _randn(2, 7, 24, dtype=dtype) if with_residual else None
    weight = (torch.rand(24, dtype=dtype) + 0.5).requires_grad_()
    bias = None if is_rms else _randn(24, dtype=dtype)
    args = (x, residual, weight, bias, _seed(dropout_p), is_rms, 1, 1e-5, dropout_p, rebuild_from_output,
            return_residual, dtype, dropout_after)  # fmt: skip
    _opcheck(_norm_op, args)


@DTYPE_DROPOUT
@pytest.mark.parametrize("recompute_fc1", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_mlp(dtype, dropout_p, recompute_fc1, activation):
    fc1_rows = 2 * 20 if activation == "swiglu" else 20
    x = _randn(9, 12, dtype=dtype)
    w1, b1 = _randn(fc1_rows, 12, dtype=dtype), _randn(fc1_rows, dtype=dtype)
    w2 = _randn(12, 20, dtype=dtype)
    b2 = _randn(12, dtype=dtype) if activation == "gelu" else None
    _opcheck(_mlp_op, (x, w1, b1, w2, b2, _seed(dropout_p), activation, dropout_p, recompute_fc1))
    # the backward op on its own: it writes dx into the tensor passed (a declared mutation)
    h = None if recompute_fc1 else torch.randn(9, fc1_rows, dtype=dtype)
    dx = torch.empty(9, 12, dtype=dtype)
    args = (torch.randn(9, 12, dtype=dtype), x.detach(), w1.detach(), b1.detach(), w2.detach(), h,
            _seed(dropout_p), activation, dropout_p, b2 is not None, dx)  # fmt: skip
    _opcheck(_mlp_backward_op, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("biases", [(True, True, True), (True, False, True)], ids=["biases", "no-key-bias"])
def test_projections(dtype, biases):
    x = _randn(9, 12, dtype=dtype)
    weights = [_randn(rows, 12, dtype=dtype) for rows in (12, 12, 7)]
    bias_list = [_randn(w.shape[0], dtype=dtype) if b else None for w, b in zip(weights, biases)]
    _opcheck(_projections_op, (x, *(t for pair in zip(weights, bias_list) for t in pair)))
    grads = [torch.randn(9, w.shape[0], dtype=dtype) for w in weights]
    detached = [w.detach() for w in weights]
    _opcheck(_projections_backward_op, (*grads, x.detach(), *detached, list(biases), torch.empty(9, 12, dtype=dtype)))


@DTYPE_DROPOUT
@pytest.mark.parametrize("masks", ["none", "padding+causal", "additive"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_attention(dtype, dropout_p, masks, deterministic):
    q, k, v = (_randn(2, 3, 11, 8, dtype=dtype) for _ in range(3))
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, 8:] = True
    attn_mask = torch.randn(11, 11, dtype=dtype) if masks == "additive" else None
    key_padding_mask = padding if masks == "padding+causal" else None
    args = (q, k, v, attn_mask, key_padding_mask, _seed(dropout_p), dropout_p, masks == "padding+causal", 0.3,
            deterministic)  # fmt: skip
    _opcheck(_attention_op, args)


@DTYPE_DROPOUT
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_self_attention_recompute_qkv(dtype, dropout_p, with_bias, deterministic):
    x = _randn(2, 9, 16, dtype=dtype)
    weight = _randn(48, 16, dtype=dtype)
    bias = _randn(48, dtype=dtype) if with_bias else None
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 6:] = True
    args = (x, weight, bias, 4, None, padding, _seed(dropout_p), dropout_p, False, 0.5, dtype, deterministic)
    _opcheck(_self_attention_op, args)


@DTYPE_DROPOUT
@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_attention(dtype, dropout_p, is_causal):
    # lengths 5, 0, 7 and a GQA pair of heads; the max lengths are upper bounds
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q = _randn(12, 4, 8, dtype=dtype)
    k, v = (_randn(12, 2, 8, dtype=dtype) for _ in range(2))
    _opcheck(_varlen_op, (q, k, v, cu, cu, _seed(dropout_p), 9, 9, dropout_p, is_causal, 0.3))


@DTYPE_DROPOUT
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_attention_and_varlen_with_a_relative_bias(dtype, dropout_p, deterministic):
    q, k, v = (_randn(2, 4, 11, 8, dtype=dtype) for _ in range(3))
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, 8:] = True
    bias = _randn(4, 21, dtype=torch.float32)
    _opcheck(_attention_op, (q, k, v, None, padding, _seed(dropout_p), dropout_p, False, 0.3, deterministic, bias))
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (_randn(12, 4, 8, dtype=dtype) for _ in range(3))
    args = (
        q,
        k,
        v,
        cu,
        cu,
        _seed(dropout_p),
        9,
        9,
        dropout_p,
        True,
        0.3,
        deterministic,
        _randn(4, 17, dtype=torch.float32),
    )
    _opcheck(_varlen_op, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy(dtype, reduction):
    x, weight, bias = _randn(10, 16, dtype=dtype), _randn(37, 16, dtype=dtype), _randn(37, dtype=dtype)
    labels = torch.randint(0, 37, (10,))
    labels[3] = -100
    _opcheck(_linear_cross_entropy_op, (x, weight, bias, labels, -100, 0.1, reduction))


def test_self_attention_recompute_qkv_under_autocast_keeps_fp32_weights():
    # the projection runs in the dtype passed (autocast's), the saved x and weights stay fp32
    x, weight = _randn(2, 9, 16, dtype=torch.float32), _randn(48, 16, dtype=torch.float32)
    args = (x, weight, None, 4, None, None, None, 0.0, True, 0.5, torch.bfloat16, True)
    out, lse = _self_attention_op(*args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    _opcheck(_self_attention_op, args)
