"""``window`` of ``slimformer.attention`` / ``varlen_attention``: a sliding window (query i
attends keys j with |j − i| <= window, ModernBERT's local layers), the kernels visiting only
the key blocks within it. Against explicit attention with the banded mask, in float64 (the
exact result) and in the input dtype (torch's own error)."""

import math

import pytest
import torch

from slimformer.kernels.attention import attention, varlen_attention
from slimformer.kernels.philox import dropout_threshold
from tests.helpers import assert_within_reference_error
from tests.kernels.test_attention import DTYPES, Case, _bias, _forward_backward, _inputs, _keep, _reference

CASES = [
    (Case(1, 1, 1, 1, 1, 16), 0),
    (Case(2, 2, 2, 70, 70, 40), 0),
    (Case(2, 2, 2, 97, 97, 64, masks=("padding",)), 5),
    (Case(2, 4, 2, 130, 130, 16, causal=True, masks=("padding",)), 33),
    (Case(1, 2, 2, 70, 45, 32), 20),
    (Case(1, 2, 1, 45, 97, 32, causal=True), 200),
]


def _band(case: Case, window: int) -> torch.Tensor:
    """(seq_q, seq_k) additive mask of the window."""
    offsets = torch.arange(case.seq_k)[None, :] - torch.arange(case.seq_q)[:, None]
    return torch.zeros(case.seq_q, case.seq_k).masked_fill(offsets.abs() > window, -math.inf)


def _check(case: Case, window: int, dtype, ulps, p=0.0, deterministic=True):
    q, k, v, grad, _, key_padding_mask = _inputs(case, dtype)
    bias = _bias(case, None, key_padding_mask) + _band(case, window)
    torch.manual_seed(7)
    got = _forward_backward(
        lambda q, k, v: attention(
            q,
            k,
            v,
            dropout_p=p,
            is_causal=case.causal,
            enable_gqa=True,
            key_padding_mask=key_padding_mask,
            deterministic=deterministic,
            window=window,
        ),
        q,
        k,
        v,
        grad,
    )
    torch.manual_seed(7)
    scale = _keep(bias.shape, p, "cpu") * dropout_threshold(p)[1] if p else None
    exact = _forward_backward(
        lambda q, k, v: _reference(q, k, v, bias.double(), None if scale is None else scale.double()),
        q.double(),
        k.double(),
        v.double(),
        grad.double(),
    )
    same_dtype = _forward_backward(lambda q, k, v: _reference(q, k, v, bias, scale), q, k, v, grad)
    for name, *tensors in zip(("out", "dq", "dk", "dv"), got, same_dtype, exact):
        assert_within_reference_error(name, *tensors, ulps)


@pytest.mark.parametrize("case, window", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_matches_the_banded_mask(backend, dtype, ulps, case, window):
    _check(case, window, dtype, ulps)


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_atomic_dq_and_dropout(backend, dtype, ulps):
    _check(Case(2, 2, 1, 97, 97, 40, masks=("padding",)), 17, dtype, ulps, p=0.25, deterministic=False)


def test_varlen_equals_attention_per_sequence(backend):
    lengths, heads, head_dim, longest, window = [5, 1, 70, 0, 33], 2, 16, 70, 9
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v, grad = (torch.randn(total, heads, head_dim, generator=gen) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = _forward_backward(
        lambda q, k, v: varlen_attention(q, k, v, cu, cu, longest, longest, window=window), q, k, v, grad
    )
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    outs = []
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n:
            rows = [x[start : start + n].transpose(0, 1)[None] for x in leaves]
            outs.append(attention(*rows, window=window)[0].transpose(0, 1))
    torch.cat(outs).backward(grad)
    for name, value, expected in zip(("out", "dq", "dk", "dv"), got, (torch.cat(outs), *(x.grad for x in leaves))):
        torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_float64_passes_gradcheck(backend):
    case = Case(1, 2, 2, 9, 9, 8, masks=("padding",))
    q, k, v, _, _, key_padding_mask = _inputs(case, torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, key_padding_mask=key_padding_mask, window=2), leaves
    )


def test_bad_window_is_refused_with_its_name():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="window must be >= 0"):
        attention(q, q, q, window=-1)
    with pytest.raises(TypeError, match="window must be an int or None, got float"):
        attention(q, q, q, window=2.0)
    with pytest.raises(TypeError, match="window must be an int or None, got bool"):
        attention(q, q, q, window=True)
