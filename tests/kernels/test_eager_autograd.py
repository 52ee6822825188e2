"""The eager fast path (``dispatch.eager_autograd`` and ``dispatch.DirectOp``, and the dropout
seed's) is the op's own autograd formula calling the ops' implementations without the
dispatcher: the same outputs, gradients, saved tensors and seeds as the ops' dispatch, for
every op, on the PyTorch references and on the (interpreted) kernels, taken only in plain
eager mode. Under a dispatch mode, a tensor subclass, a functorch transform or a
``create_graph`` backward the op itself is called, as before."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slimformer as sf
from slimformer.kernels import dispatch
from slimformer.kernels.philox import new_dropout_seed
from slimformer.kernels.projection import projections


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Inputs:
    """The tensors every call below takes its arguments from (leaves, fresh per run)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)

        def leaf(*shape, offset=0.0):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) + offset)

        self.x, self.residual = leaf(4, 6, 32), leaf(4, 6, 32)
        self.weight, self.bias = leaf(32, offset=2.0), leaf(32)
        self.q, self.k, self.v = leaf(2, 3, 20, 16), leaf(2, 3, 20, 16), leaf(2, 3, 20, 16)
        self.packed = [leaf(20, 3, 16) for _ in range(3)]
        self.pos_key, self.pos_query = leaf(3, 8, 16), leaf(3, 8, 16)
        self.qkv_weight, self.qkv_bias = leaf(96, 32), leaf(96)
        self.fc1, self.b1, self.fc2, self.b2 = leaf(64, 32), leaf(64), leaf(32, 64), leaf(32)
        self.vocab = leaf(50, 32)
        self.labels = torch.randint(0, 50, (24,), generator=gen)
        self.labels[::5] = -100

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if isinstance(t, torch.nn.Parameter)] + self.packed


_CU_SEQLENS = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
_PADDING = torch.tensor([[True] * 20, [True] * 13 + [False] * 7])

# Every public op that has a backward, as a model calls it (dropout where it has one): the
# output to take the backward of.
CALLS = {
    "layer_norm": lambda t: sf.layer_norm(t.x, (32,), t.weight, t.bias, residual=t.residual, dropout_p=0.25),
    "layer_norm_memory_efficient": lambda t: sf.layer_norm(
        t.x, (32,), t.weight, t.bias, residual=t.residual, memory_efficient=True, return_residual=True
    )[0],
    "rms_norm": lambda t: sf.rms_norm(t.x, (32,), t.weight, residual=t.residual, return_residual=True)[0],
    "dropout_add": lambda t: sf.dropout_add(t.x, t.residual, 0.25),
    "attention": lambda t: sf.attention(t.q, t.k, t.v, dropout_p=0.25, is_causal=True),
    "attention_padding_mask": lambda t: sf.attention(t.q, t.k, t.v, key_padding_mask=_PADDING, dropout_p=0.25),
    "self_attention_recompute_qkv": lambda t: sf.self_attention(
        t.x, t.qkv_weight, t.qkv_bias, 2, dropout_p=0.25, recompute_qkv=True
    ),
    "varlen_attention": lambda t: sf.varlen_attention(*t.packed, _CU_SEQLENS, _CU_SEQLENS, 13, 13, 0.25),
    "disentangled_attention": lambda t: sf.disentangled_attention(
        t.q, t.k, t.v, t.pos_key, t.pos_query, max_relative_positions=4, key_padding_mask=_PADDING, dropout_p=0.25
    ),
    "fused_mlp": lambda t: sf.fused_mlp(t.x, t.fc1, t.b1, t.fc2, t.b2, "gelu", 0.25),
    "linear_cross_entropy": lambda t: sf.linear_cross_entropy(
        t.x.view(24, 32), t.vocab, None, t.labels, reduction="none"
    ),
    "projections": lambda t: torch.cat(projections(t.x, [t.fc1, t.qkv_weight, t.vocab], [t.b1, None, None]), -1),
}


def _op_node(out: torch.Tensor) -> str:
    """The class name of the graph node of the op that made ``out`` (under its views, casts
    and concatenations): the first slimformer node from ``out`` back."""
    nodes = [out.grad_fn]
    while nodes:
        node = nodes.pop(0)
        name = type(node).__name__
        if name.startswith(("Eager_", "GeneratedBackwardFor_slimformer_")):
            return name
        nodes += [next_node for next_node, _ in node.next_functions if next_node is not None]
    raise AssertionError(f"no slimformer node under {type(out.grad_fn).__name__}")


def _run(call, plain: bool, monkeypatch):
    """(output, gradients, saved tensors, op's graph node) of one call and its backward."""
    with monkeypatch.context() as patch:
        if not plain:
            patch.setattr(dispatch, "plain_eager", lambda args: False)
            patch.setattr("slimformer.kernels.philox.plain_eager", lambda args: False)
        inputs = _Inputs()
        saved = []
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = call(inputs)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    grads = [t.grad for t in inputs.leaves() if t.grad is not None]
    return out, grads, saved, _op_node(out)


@pytest.mark.parametrize("name", CALLS)
def test_eager_path_equals_the_op_dispatch(name, backend, monkeypatch):
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


@pytest.fixture
def _reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.usefixtures("_reference_path")
def test_a_dispatch_mode_sees_the_ops_as_before():
    t = _Inputs()
    with _RecordOps() as mode:
        y = sf.layer_norm(t.x, (32,), t.weight, t.bias, residual=t.residual, dropout_p=0.25)
        out = sf.attention(t.q, t.k, t.v, dropout_p=0.25)
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


@pytest.mark.usefixtures("_reference_path")
def test_no_grad_calls_the_implementation_with_the_ops_result(monkeypatch):
    t = _Inputs()
    with torch.no_grad():
        y = sf.layer_norm(t.x, (32,), t.weight, t.bias, residual=t.residual)
        monkeypatch.setattr(dispatch, "plain_eager", lambda args: False)
        y_op = sf.layer_norm(t.x, (32,), t.weight, t.bias, residual=t.residual)
    assert y.grad_fn is None and y_op.grad_fn is None
    assert torch.equal(y, y_op)


@torch.library.custom_op("slimformer_test::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, factor: float, out: torch.Tensor) -> None:
    _SEEN.append(type(factor))
    out.copy_(x * factor)


@_scale_into.register_fake
def _(x, factor, out):
    return None


_SEEN = []


def test_direct_op_passes_what_the_dispatcher_would():
    """A float argument reaches the implementation as a float (Triton specializes on an int's
    type), and a mutated argument's version counter moves, on either path."""
    direct = dispatch.direct(_scale_into)
    x, out = torch.ones(3), torch.zeros(3)
    _SEEN.clear()
    for call in (direct, _scale_into):
        version = out._version
        call(x, 2, out)
        assert out._version > version and out.tolist() == [2.0] * 3
    assert _SEEN == [float, float]


def test_direct_op_calls_the_op_when_grad_mode_is_on_or_under_a_mode(monkeypatch):
    """A ``create_graph`` backward (grad mode on) and any dispatch mode get the op itself."""
    direct = dispatch.direct(_scale_into)
    calls = []
    monkeypatch.setattr(dispatch.DirectOp, "call_directly", lambda self, args: calls.append(args))
    x, out = torch.ones(3), torch.zeros(3)
    with torch.no_grad():
        direct(x, 1.0, out)
    assert len(calls) == 1
    direct(x, 1.0, out)
    with torch.no_grad(), _RecordOps() as mode:
        direct(x, 1.0, out)
    assert len(calls) == 1 and mode.ops == ["slimformer_test.scale_into.default"]


def test_an_op_with_device_kernels_is_refused():
    @torch.library.custom_op("slimformer_test::with_cpu_kernel", mutates_args=())
    def with_cpu_kernel(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    with_cpu_kernel.register_kernel("cpu")(lambda x: x + 1)
    with pytest.raises(ValueError, match="with_cpu_kernel has device kernels of its own"):
        dispatch.DirectOp(with_cpu_kernel)
