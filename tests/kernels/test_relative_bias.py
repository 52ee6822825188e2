"""``relative_bias`` of ``slimformer.attention`` / ``varlen_attention``: a learned bias by the
offset j − i (MPNet's and T5's bucketed relative positions), read by the kernels along each
tile's diagonals; its gradient summed along them. Against explicit attention with the bias
materialised, in float64 (the exact result) and in the input dtype (torch's own error)."""

import math

import pytest
import torch

from slimformer.kernels.attention import attention, varlen_attention
from slimformer.kernels.attention.reference import relative_positions
from slimformer.kernels.philox import dropout_threshold
from slimformer.memory import measure_activation_memory
from tests.helpers import ULP, assert_within_reference_error
from tests.kernels.test_attention import DTYPES, Case, _bias, _inputs, _keep, _reference

CASES = [
    Case(1, 1, 1, 1, 1, 16),
    Case(2, 2, 2, 37, 37, 40, causal=True),
    Case(2, 3, 3, 97, 70, 64, masks=("padding",)),
    Case(2, 4, 2, 70, 97, 16, causal=True, masks=("padding",)),
    Case(1, 2, 2, 130, 129, 32),
]


def _relative_bias(case: Case, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(case.heads, case.seq_q + case.seq_k - 1, generator=gen).to(dtype)


def _materialised(relative_bias: torch.Tensor, seq_q: int, seq_k: int) -> torch.Tensor:
    """(heads, seq_q, seq_k): the bias every score gets."""
    return relative_bias[:, relative_positions(0, seq_q, seq_k, seq_q, relative_bias.device)]


def _with_bias_grad(fn, q, k, v, relative_bias, grad):
    """(out, dq, dk, dv, dbias) of fn(q, k, v, relative_bias) for ``grad``."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, relative_bias)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), *(x.grad for x in leaves)


def _check(case: Case, dtype, ulps, p=0.0, deterministic=True):
    q, k, v, grad, _, key_padding_mask = _inputs(case, dtype)
    masks = _bias(case, None, key_padding_mask)
    relative_bias = _relative_bias(case)
    torch.manual_seed(1234)
    got = _with_bias_grad(
        lambda q, k, v, b: attention(
            q,
            k,
            v,
            dropout_p=p,
            is_causal=case.causal,
            enable_gqa=True,
            key_padding_mask=key_padding_mask,
            deterministic=deterministic,
            relative_bias=b,
        ),
        q,
        k,
        v,
        relative_bias,
        grad,
    )
    torch.manual_seed(1234)
    scale = _keep(masks.shape, p, "cpu") * dropout_threshold(p)[1] if p else None

    def explicit(q, k, v, b):
        bias = masks.to(b.dtype) + _materialised(b, case.seq_q, case.seq_k)
        return _reference(q, k, v, bias, None if scale is None else scale.to(b.dtype))

    exact = _with_bias_grad(explicit, q.double(), k.double(), v.double(), relative_bias.double(), grad.double())
    same_dtype = _with_bias_grad(explicit, q, k, v, relative_bias, grad)
    for name, *tensors in zip(("out", "dq", "dk", "dv"), got, same_dtype, exact):
        assert_within_reference_error(name, *tensors, ulps)
    # dbias is fp32 but sums batch x diagonal terms of dS, each with the input dtype's
    # rounding (the kernels' delta = rowsum(dO * O) reads O as stored, in that dtype; torch
    # sums P * dP instead): its slack is the input dtype's ULP, grown as the square root of
    # the number of (independent) terms
    terms = case.batch * min(case.seq_q, case.seq_k)
    assert_within_reference_error(
        "dbias", got[4], same_dtype[4], exact[4], ulps * ULP[dtype] / ULP[torch.float32] * math.sqrt(terms)
    )


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_matches_the_materialised_bias(backend, dtype, ulps, case):
    _check(case, dtype, ulps)


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_atomic_dq_and_dropout(backend, dtype, ulps):
    _check(Case(2, 2, 1, 70, 45, 40, causal=True, masks=("padding",)), dtype, ulps, p=0.25, deterministic=False)


def test_float64_passes_gradcheck(backend):
    case = Case(1, 2, 2, 5, 7, 8, masks=("padding",))
    q, k, v, _, _, key_padding_mask = _inputs(case, torch.float64)
    relative_bias = _relative_bias(case, torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, relative_bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: attention(q, k, v, key_padding_mask=key_padding_mask, relative_bias=b), leaves
    )


def test_varlen_equals_attention_per_sequence(backend):
    # each sequence reads the window of the (heads, max_q + max_k - 1) bias around its
    # centre; the gradient of that window sums over the sequences that read it
    lengths, heads, head_dim, longest = [5, 1, 17, 0, 12], 2, 16, 17
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v, grad = (torch.randn(total, heads, head_dim, generator=gen) for _ in range(4))
    relative_bias = torch.randn(heads, 2 * longest - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = _with_bias_grad(
        lambda q, k, v, b: varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True, relative_bias=b),
        q,
        k,
        v,
        relative_bias,
        grad,
    )
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, relative_bias)]
    outs = []
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n == 0:
            continue
        window = leaves[3][:, longest - n : longest - 1 + n]
        rows = [x[start : start + n].transpose(0, 1)[None] for x in leaves[:3]]
        outs.append(attention(*rows, is_causal=True, relative_bias=window)[0].transpose(0, 1))
    torch.cat(outs).backward(grad)
    for name, value, expected in zip(
        ("out", "dq", "dk", "dv", "dbias"), got, (torch.cat(outs), *(x.grad for x in leaves))
    ):
        torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_keeps_nothing_quadratic(backend):
    # what backward keeps grows linearly in seq: q, k, v, out, lse and the bias itself
    kept = {}
    for seq in (64, 128):
        q, k, v = (torch.randn(1, 2, seq, 16, requires_grad=True) for _ in range(3))
        relative_bias = torch.randn(2, 2 * seq - 1, requires_grad=True)
        memory = measure_activation_memory(
            lambda: attention(q, k, v, dropout_p=0.1, relative_bias=relative_bias), exclude=(q, k, v, relative_bias)
        )
        kept[seq] = memory.saved_bytes
        assert all(math.prod(record.shape) < seq * seq for record in memory.saved), memory.saved
    assert kept[128] <= 2 * kept[64]


def test_bad_relative_bias_is_refused_with_its_name():
    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"relative_bias must have shape \(heads, seq_q \+ seq_k - 1\) = \(2, 9\)"):
        attention(q, k, v, relative_bias=torch.zeros(2, 8))
    with pytest.raises(TypeError, match="relative_bias must be a float tensor"):
        attention(q, k, v, relative_bias=torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="relative_bias cannot be combined with attn_mask"):
        attention(q, k, v, attn_mask=torch.zeros(5, 5), relative_bias=torch.zeros(2, 9))
    with pytest.raises(TypeError, match="relative_bias must be a torch.Tensor or None"):
        attention(q, k, v, relative_bias=[0.0] * 9)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(heads, max_seqlen_q \+ max_seqlen_k - 1\) = \(2, 9\)"):
        varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 5, 5,
                         relative_bias=torch.zeros(2, 10))  # fmt: skip
