"""The eager fast path (``dispatch.eager_autograd``, and the dropout seed's) is the op's own
autograd formula without torch's generated wrapper: the same outputs, gradients, saved
tensors and seeds as the op's dispatch, taken only in plain eager mode. Under a dispatch
mode, a tensor subclass or a functorch transform the op itself is called, as before."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slimformer as sf
from slimformer.kernels import dispatch
from slimformer.kernels.philox import new_dropout_seed


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(4, 6, 32, generator=gen, requires_grad=True) for _ in range(2))
    weight = torch.nn.Parameter(torch.rand(32, generator=gen) + 0.5)
    bias = torch.nn.Parameter(torch.randn(32, generator=gen))
    q, k, v = (torch.randn(2, 3, 20, 16, generator=gen, requires_grad=True) for _ in range(3))
    return x, residual, weight, bias, q, k, v


CALLS = {
    "layer_norm": lambda x, r, w, b, q, k, v: sf.layer_norm(x, (32,), w, b, residual=r, dropout_p=0.25),
    "layer_norm_memory_efficient": lambda x, r, w, b, q, k, v: sf.layer_norm(
        x, (32,), w, b, residual=r, memory_efficient=True, return_residual=True
    )[0],
    "attention": lambda x, r, w, b, q, k, v: sf.attention(q, k, v, dropout_p=0.25, is_causal=True),
    "dropout_add": lambda x, r, w, b, q, k, v: sf.dropout_add(x, r, 0.25),
}


def _op_node(out: torch.Tensor) -> str:
    """The class name of the graph node of the op that made ``out`` (under its views)."""
    node = out.grad_fn
    while type(node).__name__ in ("ViewBackward0", "TransposeBackward0"):
        node = node.next_functions[0][0]
    return type(node).__name__


def _run(call, plain: bool, monkeypatch):
    """(output, gradients, saved tensors, op's graph node) of one call and its backward."""
    with monkeypatch.context() as patch:
        if not plain:
            patch.setattr(dispatch, "plain_eager", lambda args: False)
            patch.setattr("slimformer.kernels.philox.plain_eager", lambda args: False)
        inputs = _inputs()
        saved = []
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = call(*inputs)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    grads = [t.grad for t in inputs if t.grad is not None]
    return out, grads, saved, _op_node(out)


@pytest.mark.parametrize("name", CALLS)
def test_eager_path_equals_the_op_dispatch(name, monkeypatch):
    out, grads, saved, node = _run(CALLS[name], True, monkeypatch)
    out_op, grads_op, saved_op, node_op = _run(CALLS[name], False, monkeypatch)
    assert node.startswith("Eager_") and node_op.startswith("GeneratedBackwardFor_slimformer_")
    assert torch.equal(out, out_op)
    assert len(grads) == len(grads_op) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_op))
    assert [(t.shape, t.dtype) for t in saved] == [(t.shape, t.dtype) for t in saved_op]
    assert all(torch.equal(a, b) for a, b in zip(saved, saved_op))


def test_seed_is_the_op_draw():
    x = torch.zeros(3)
    torch.manual_seed(5)
    eager = [new_dropout_seed(x.device, x, "a") for _ in range(3)]
    torch.manual_seed(5)
    with _RecordOps() as mode:
        dispatched = [new_dropout_seed(x.device, x, "a") for _ in range(3)]
    assert mode.ops.count("slimformer.dropout_seed.default") == 3
    assert eager == dispatched


def test_a_dispatch_mode_sees_the_ops_as_before():
    x, residual, weight, bias, q, k, v = _inputs()
    with _RecordOps() as mode:
        y = sf.layer_norm(x, (32,), weight, bias, residual=residual, dropout_p=0.25)
        out = sf.attention(q, k, v, dropout_p=0.25)
    assert _op_node(y) == "GeneratedBackwardFor_slimformer_fused_norm_defaultBackward"
    assert _op_node(out) == "GeneratedBackwardFor_slimformer_attention_defaultBackward"
    for op in ("dropout_seed", "fused_norm", "attention"):
        assert f"slimformer.{op}.default" in mode.ops
    with _RecordOps() as mode:
        (y.sum() + out.sum()).backward()
    assert {"slimformer.fused_norm_backward.default", "slimformer.attention_backward.default"} <= set(mode.ops)


def test_plain_eager():
    x = torch.zeros(2)
    assert dispatch.plain_eager((x, torch.nn.Parameter(x), None, 1.0, [True]))

    class Subclass(torch.Tensor):
        pass

    assert not dispatch.plain_eager((x, x.as_subclass(Subclass)))
    with _RecordOps():
        assert not dispatch.plain_eager((x,))
    with torch.device("cpu"):  # a torch-function mode
        assert not dispatch.plain_eager((x,))
    assert torch.vmap(lambda t: torch.tensor(dispatch.plain_eager((t,))))(torch.zeros(2, 1)).tolist() == [False] * 2
    assert torch.compile(lambda t: t + dispatch.plain_eager((t,)), backend="eager", fullgraph=True)(x).tolist() == [
        0,
        0,
    ]


def test_no_grad_calls_the_op():
    x, residual, weight, bias, *_ = _inputs()
    with torch.no_grad():
        y = sf.layer_norm(x, (32,), weight, bias, residual=residual)
    assert y.grad_fn is None
