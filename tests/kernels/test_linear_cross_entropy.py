"""linear_cross_entropy vs F.cross_entropy(F.linear(...)): loss and grads, both the
interpreted Triton kernels and the PyTorch reference, several vocabulary chunks."""

import pytest
import torch
import torch.nn.functional as F

import slimformer.kernels.linear_cross_entropy as lce
from slimformer.kernels.linear_cross_entropy import linear_cross_entropy
from tests.helpers import assert_within_reference_error

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(params=["triton", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def _inputs(rows, hidden, vocab, dtype, seed=0, ignored_every=3):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, generator=generator).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    if ignored_every:
        labels[::ignored_every] = -100
    return x, weight, bias, labels


def _loss_and_grads(function, x, weight, bias, labels, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    loss = function(*leaves, labels, **kwargs)
    grad_out = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(loss.dtype)
    grads = torch.autograd.grad(loss, leaves, grad_out)
    return loss.detach(), grads


def _torch_op(x, weight, bias, labels, **kwargs):
    return F.cross_entropy(F.linear(x, weight, bias), labels, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "hidden", "vocab", "smoothing", "reduction"),
    [(17, 24, 301, 0.0, "mean"), (97, 33, 300, 0.1, "mean"), (1, 16, 129, 0.0, "sum"), (13, 40, 257, 0.2, "none")],
)
def test_matches_torch(path, dtype, rows, hidden, vocab, smoothing, reduction, monkeypatch):
    monkeypatch.setattr(lce, "_CHUNK_ELEMENTS", 128 * max(rows, 1))  # several chunks, one ragged
    x, weight, bias, labels = _inputs(rows, hidden, vocab, dtype)
    kwargs = dict(label_smoothing=smoothing, reduction=reduction)
    loss, grads = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, **kwargs)
    same, same_grads = _loss_and_grads(_torch_op, x, weight, bias, labels, **kwargs)
    exact, exact_grads = _loss_and_grads(_torch_op, x.double(), weight.double(), bias.double(), labels, **kwargs)
    assert loss.dtype == dtype
    assert_within_reference_error("loss", loss, same, exact, scale=10)
    for name, grad, same_grad, exact_grad in zip(("dx", "dW", "db"), grads, same_grads, exact_grads):
        assert grad.dtype == dtype
        assert_within_reference_error(name, grad, same_grad, exact_grad)


def test_uninitialized_memory_never_reaches_the_result(path, monkeypatch):
    # torch's CPU bf16 GEMM on one thread reads a row-strided operand's padding, so garbage
    # in the chunk buffer's columns past the chunk would make dx NaN under autocast (here
    # every new tensor starts as NaN, on one intra-op thread as in CI)
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(factory):
        def make(*args, **kwargs):
            tensor = factory(*args, **kwargs)
            return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

        return make

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, weight, bias, labels = _inputs(21, 32, 200, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(t).all() for t in (loss, *grads))


def test_chunk_width_bounds_the_temporary():
    assert lce._chunk_width(300, 30522) * 300 <= lce._CHUNK_ELEMENTS
    assert lce._chunk_width(1, 30522) == 30522
    assert lce._chunk_width(10**6, 250_000) == 128


def test_all_ignored_is_nan_like_torch(path):
    x, weight, bias, labels = _inputs(5, 8, 50, torch.float32)
    labels[:] = -100
    loss, grads = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels)
    same, same_grads = _loss_and_grads(_torch_op, x, weight, bias, labels)
    assert loss.isnan() and same.isnan()
    for grad, same_grad in zip(grads, same_grads):
        torch.testing.assert_close(grad, same_grad, rtol=0, atol=0)


def test_no_rows(path):
    x, weight, bias, labels = _inputs(0, 8, 50, torch.float32)
    loss, (dx, dweight, dbias) = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels)
    assert loss.isnan() and dx.shape == (0, 8)
    assert not dweight.any() and not dbias.any()


def test_no_bias_and_lse(path):
    x, weight, _, labels = _inputs(9, 16, 70, torch.float32)
    loss, lse = linear_cross_entropy(x, weight, None, labels, return_lse=True)
    torch.testing.assert_close(loss, F.cross_entropy(x @ weight.T, labels))
    torch.testing.assert_close(lse, torch.logsumexp(x @ weight.T, dim=1))


def test_autocast_matches_torch_autocast(path):
    x, weight, bias, labels = _inputs(21, 32, 200, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels)
        same, same_grads = _loss_and_grads(_torch_op, x, weight, bias, labels)
    exact, exact_grads = _loss_and_grads(_torch_op, x.double(), weight.double(), bias.double(), labels)
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    # bf16 inputs and logits: both within bf16 rounding of the exact result
    for actual, reference, exact_value in zip((loss, *grads), (same, *same_grads), (exact, *exact_grads)):
        bound = 2 * (reference.double() - exact_value).abs().max() + 2**-7 * exact_value.abs().max()
        assert (actual.double() - exact_value).abs().max() <= bound


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: {**a, "labels": a["labels"][:-1]}, ValueError, "labels must be \\(9,\\)"),
        (lambda a: {**a, "labels": a["labels"].int()}, TypeError, "labels must be torch.int64"),
        (lambda a: {**a, "labels": a["labels"].float()}, TypeError, "labels must be torch.int64"),
        (lambda a: {**a, "labels": torch.full((9,), 70)}, ValueError, "labels must be in \\[0, 70\\).*got 70"),
        (lambda a: {**a, "labels": torch.full((9,), -1)}, ValueError, "got -1"),
        (lambda a: {**a, "weight": a["weight"][:, :-1]}, ValueError, "weight must be \\(vocab >= 1, 16\\)"),
        (lambda a: {**a, "weight": a["weight"][:0], "bias": None}, ValueError, "weight must be \\(vocab >= 1"),
        (lambda a: {**a, "bias": a["bias"][:-1]}, ValueError, "bias must be \\(70,\\)"),
        (lambda a: {**a, "input": a["input"].double()}, TypeError, "input must be float32"),
        (lambda a: {**a, "weight": a["weight"].half()}, TypeError, "share a dtype"),
        (lambda a: {**a, "input": a["input"][None]}, ValueError, "input must be 2-d"),
        (lambda a: {**a, "reduction": "max"}, ValueError, "reduction must be one of"),
        (lambda a: {**a, "label_smoothing": 1.5}, ValueError, "label_smoothing must be in"),
    ],
)
def test_bad_input(change, error, match):
    x, weight, bias, labels = _inputs(9, 16, 70, torch.float32)
    arguments = change(dict(input=x, weight=weight, bias=bias, labels=labels))
    with pytest.raises(error, match=match):
        linear_cross_entropy(**arguments)


def test_labels_on_a_gpu_are_checked_on_the_device(monkeypatch):
    """On a CUDA tensor the label range goes to ``torch._assert_async`` (a device-side assert,
    as F.cross_entropy's, no host sync); on CPU its kernel raises at once, with the message."""
    x, weight, bias, _ = _inputs(9, 16, 70, torch.float32)
    asserted = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch, "_assert_async", lambda flag, message: asserted.append((flag.clone(), message)))
    lce._check_inputs(x, weight, bias, torch.full((9,), 3), -100, 0.0, "mean")
    lce._check_inputs(x, weight, bias, torch.full((9,), 70), -100, 0.0, "mean")
    assert [flag.item() for flag, _ in asserted] == [True, False]
    assert asserted[1][1] == "labels must be in [0, 70) or ignore_index=-100"
