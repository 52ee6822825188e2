"""The q/k/v projections op vs three nn.Linear calls: outputs and every gradient, one input
gradient's memory, autocast and bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from slimformer.kernels.projection import projections
from tests.helpers import assert_within_reference_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, outs, dtype, biases):
    gen = torch.Generator().manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape, generator=gen).to(dtype)
    weights = [(torch.randn(n, d, generator=gen) * d**-0.5).to(dtype) for n in outs]
    bias_list = [(torch.randn(n, generator=gen) * 0.5).to(dtype) if b else None for n, b in zip(outs, biases)]
    return x, weights, bias_list


def _run(fn, x, weights, biases, grads):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, *weights, *(b for b in biases if b is not None))]
    x, ws = leaves[0], leaves[1:4]
    it = iter(leaves[4:])
    bs = [None if b is None else next(it) for b in biases]
    out = fn(x, ws, bs)
    return (*out, *torch.autograd.grad(out, leaves, [g.to(o.dtype) for g, o in zip(grads, out)]))


def _linears(x, weights, biases):
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, outs, biases",
    [
        ((1, 16), (16, 16, 16), (True, True, True)),
        ((3, 17, 24), (24, 8, 40), (True, False, True)),
        ((97, 40), (40, 40, 40), (False, False, False)),
    ],
    ids=["one-row", "odd-sizes-no-key-bias", "no-bias"],
)
def test_projections_match_linears(dtype, shape, outs, biases):
    x, weights, bias_list = _inputs(shape, outs, dtype, biases)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(*shape[:-1], n, generator=gen).to(dtype) for n in outs]
    ours = _run(projections, x, weights, bias_list, grads)
    same_dtype = _run(_linears, x, weights, bias_list, grads)
    exact = _run(
        _linears,
        x.double(),
        [w.double() for w in weights],
        [None if b is None else b.double() for b in bias_list],
        grads,
    )
    names = ["q", "k", "v", "dx", "dwq", "dwk", "dwv"] + [f"db{i}" for i, b in enumerate(biases) if b]
    for name, actual, torch_value, exact_value in zip(names, ours, same_dtype, exact, strict=True):
        assert actual.dtype == dtype, name
        assert_within_reference_error(name, actual, torch_value, exact_value)


def test_empty_input_and_unused_outputs():
    x, weights, biases = _inputs((0, 8), (8, 8, 8), torch.float32, (True, True, True))
    out = projections(x.requires_grad_(), weights, biases)
    assert [tuple(t.shape) for t in out] == [(0, 8)] * 3
    x, weights, biases = _inputs((5, 8), (8, 8, 8), torch.float32, (True, True, True))
    x.requires_grad_()
    q, _, _ = projections(x, weights, biases)
    (dx,) = torch.autograd.grad(q.sum(), x)  # k and v get no gradient
    torch.testing.assert_close(dx, weights[0].sum(0).expand(5, 8), rtol=0, atol=1e-6)


def test_backward_holds_one_input_gradient():
    # three Linears' backward has two input-sized gradients alive to sum them; ours one
    x, weights, biases = _inputs((512, 64), (64, 64, 64), torch.float32, (True, True, True))

    def transient_peak(fn):
        leaves = [t.clone().requires_grad_() for t in (x, *weights)]
        out = fn(leaves[0], leaves[1:], biases)
        grads = [torch.ones_like(t) for t in out]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.autograd.backward(out, grads)
        total = peak = 0
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        for e in sorted(events, key=lambda e: e.start_ns()):
            total += e.nbytes()
            peak = max(peak, total)
        return peak

    input_grad = x.numel() * 4
    weight_grads = 3 * weights[0].numel() * 4
    assert transient_peak(projections) <= weight_grads + input_grad + 4096
    assert transient_peak(_linears) >= weight_grads + 2 * input_grad


def test_autocast_runs_in_its_dtype_like_linear():
    x, weights, biases = _inputs((4, 8), (8, 8, 8), torch.float32, (True, True, True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = projections(x, weights, biases)
        linears = _linears(x, weights, biases)
    for a, b in zip(ours, linears):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b)


def test_bad_input_names_the_argument():
    x, weights, biases = _inputs((4, 8), (8, 8, 8), torch.float32, (True, True, True))
    with pytest.raises(TypeError, match="x must be"):
        projections(x.long(), weights, biases)
    with pytest.raises(ValueError, match="three each"):
        projections(x, weights[:2], biases[:2])
    with pytest.raises(ValueError, match=r"weights\[1\] must have shape"):
        projections(x, [weights[0], torch.randn(8, 7), weights[2]], biases)
    with pytest.raises(ValueError, match=r"biases\[2\] must have shape"):
        projections(x, weights, [biases[0], biases[1], torch.randn(5)])
    with pytest.raises(TypeError, match=r"weights\[0\] dtype"):
        projections(x, [weights[0].half(), *weights[1:]], biases)
    with pytest.raises(ValueError, match=r"weights\[2\] must be on the input's device"):
        projections(x, [*weights[:2], weights[2].to("meta")], biases)
