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


def _cancellation_scales(q, k, v, grad, bias, dropout_scale):
    """Error scales of (dq, dk): the magnitudes of the terms that cancel in them, in float64.

    dS = P ∘ (Z ∘ dP − D) with dP = dO vᵀ and D = rowsum(dO ∘ O) (Z the dropout scale, else 1);
    dq = sm · dS k and dk = sm · dSᵀ q. Where a row sees one key (window 0) Z dP = D and dq is
    exactly 0, but the kernels compute D from O, not from P and dP, so their dq carries
    rounding of |P| (|Z dP| + |D|) |k|, not of dq's own size."""
    q, k, v, grad = (x.double() for x in (q, k, v, grad))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.mT / math.sqrt(q.shape[-1]) + bias.double()
    has_key = (s > -math.inf).any(-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(~has_key, 0.0), dim=-1) * has_key
    z = torch.ones_like(probs) if dropout_scale is None else dropout_scale.double()
    out = (probs * z) @ v
    terms = probs * ((z * (grad @ v.mT)).abs() + (grad * out).sum(-1, keepdim=True).abs())
    sm = 1 / math.sqrt(q.shape[-1])
    return (sm * terms @ k.abs()).max().item(), (sm * terms.mT @ q.abs()).max().item()


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
    dq_scale, dk_scale = _cancellation_scales(q, k, v, grad, bias, scale)
    for name, *tensors, error_scale in zip(
        ("out", "dq", "dk", "dv"), got, same_dtype, exact, (1.0, dq_scale, dk_scale, 1.0)
    ):
        assert_within_reference_error(name, *tensors, ulps, scale=error_scale)


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
    with pytest.raises(TypeError, match="window must be an int, got float"):
        attention(q, q, q, window=2.0)
    with pytest.raises(TypeError, match="window must be an int, got bool"):
        attention(q, q, q, window=True)


def test_the_kernels_visit_tiles_in_proportion_to_the_window(monkeypatch):
    # the interpreted kernels' tile functions, counted: with a window the tiles each query
    # (key) block visits stay the same as seq grows and grow with the window; without one
    # they grow with seq
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the interpreted kernels' tile calls")
    from slimformer.kernels.attention import backward, forward

    calls = {"fwd": 0, "dkdv": 0, "dq": 0}
    for module, name, key in (
        (forward, "_attention_fwd_tile", "fwd"),
        (backward, "_attention_bwd_dkdv_tile", "dkdv"),
        (backward, "_attention_bwd_dq_tile", "dq"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda *a, _real=real, _key=key, **k: calls.__setitem__(_key, calls[_key] + 1) or _real(*a, **k),
        )

    def visits(seq, window):
        for key in calls:
            calls[key] = 0
        q = torch.randn(1, 1, seq, 16, requires_grad=True)
        attention(q, q, q, window=window).sum().backward()
        return dict(calls)

    small, large, wider, full_small, full_large = (
        visits(256, 8), visits(512, 8), visits(512, 40), visits(256, None), visits(512, None)
    )  # fmt: skip
    for key in calls:
        assert large[key] <= 2 * small[key] + 2  # linear in seq: the same tiles per block
        assert wider[key] > large[key]  # more with a wider window
        assert full_large[key] >= 4 * full_small[key] - 4  # without: quadratic


def test_keeps_what_plain_attention_keeps():
    # the window changes which tiles run, not what backward keeps: q, k, v, out and lse
    from slimformer.memory import measure_activation_memory

    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    kept = [
        measure_activation_memory(lambda w=window: attention(q, k, v, dropout_p=0.1, window=w), exclude=(q, k, v))
        for window in (None, 16)
    ]
    assert kept[0].saved_bytes == kept[1].saved_bytes
