"""slimformer.memory: both measurements on forwards whose saved tensors are known exactly."""

import dataclasses
import gc
import weakref

import pytest
import torch

from slimformer.memory import (
    ActivationMemory,
    TensorRecord,
    format_bytes,
    measure_activation_memory,
    peak_memory,
)

TOKENS, HIDDEN = 32, 64
FP32 = 4
ROWS_BYTES = TOKENS * HIDDEN * FP32  # one (32, 64) fp32 activation
STAT_BYTES = TOKENS * FP32  # one per-row fp32 statistic


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(TOKENS, HIDDEN, requires_grad=True)


class _KeepsExtraOnCtx(torch.autograd.Function):
    """y = 3x, but keeps a (32, 64) tensor as a ctx attribute instead of saving it."""

    @staticmethod
    def forward(ctx, x):
        ctx.scale = torch.full_like(x, 3.0)
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    extra: tuple


def test_linear_saves_only_its_input_and_weight(x):
    linear = torch.nn.Linear(HIDDEN, HIDDEN)

    mem = measure_activation_memory(linear, x)

    assert mem.saved == () and mem.alive == ()
    assert mem.saved_bytes == 0 and mem.alive_bytes == 0


def test_linear_layer_norm_linear_exact_bytes(x):
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
    )
    expected = ROWS_BYTES + 2 * STAT_BYTES + ROWS_BYTES  # LN input, mean, rstd, LN output

    mem = measure_activation_memory(model, x)

    assert mem.saved_bytes == expected, mem.saved
    assert mem.alive_bytes == expected, mem.alive
    assert sorted(r.nbytes for r in mem.saved) == [STAT_BYTES, STAT_BYTES, ROWS_BYTES, ROWS_BYTES]
    assert set(mem.saved) == set(mem.alive)
    assert mem.per_token(TOKENS, HIDDEN) == expected / (TOKENS * HIDDEN)


def test_ctx_attribute_is_alive_but_not_saved(x):
    mem = measure_activation_memory(_KeepsExtraOnCtx.apply, x)

    assert mem.saved_bytes == 0
    assert mem.alive_bytes == ROWS_BYTES
    assert mem.alive == (TensorRecord((TOKENS, HIDDEN), torch.float32, ROWS_BYTES),)


def _exp_then_sum(x, w, *, return_exp):
    """mm saves x and w, exp saves its output e, sum saves nothing."""
    e = (x @ w).exp()
    total = e.sum(-1)
    if return_exp:
        return {"total": (total,), "nested": _Output(hidden=e, extra=(x, [w]))}
    return total


@pytest.mark.parametrize("return_exp", [True, False])
def test_inputs_and_outputs_excluded_inside_containers(x, return_exp):
    w = torch.randn(HIDDEN, HIDDEN, requires_grad=True)

    mem = measure_activation_memory(_exp_then_sum, x, w=w, return_exp=return_exp)

    expected = 0 if return_exp else ROWS_BYTES  # e counts unless it is an output
    assert (mem.saved_bytes, mem.alive_bytes) == (expected, expected)


def test_inputs_nested_in_args_excluded(x):
    w = torch.randn(HIDDEN, HIDDEN, requires_grad=True)

    mem = measure_activation_memory(lambda pair, d: (pair[0] @ d["w"]).sum(), [x, 1], {"w": w})

    assert mem.saved_bytes == 0 and mem.alive_bytes == 0


LINEAR_WEIGHT_BYTES = HIDDEN * HIDDEN * FP32
NORM_PARAM_BYTES = 2 * HIDDEN * FP32  # weight and bias


@pytest.mark.parametrize(
    "excluded, saved_params",
    [("all", 0), ("linear", NORM_PARAM_BYTES), ("none", LINEAR_WEIGHT_BYTES + NORM_PARAM_BYTES)],
)
def test_exclude_argument(x, excluded, saved_params):
    linear, norm = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN)
    exclude = {
        "all": [*linear.parameters(), *norm.parameters()],
        "linear": linear.parameters(),
        "none": (),
    }[excluded]

    mem = measure_activation_memory(lambda inp: linear(norm(inp)), x, exclude=exclude)

    activations = 2 * STAT_BYTES + ROWS_BYTES  # mean, rstd, LN output saved by linear
    assert mem.saved_bytes == activations + saved_params
    assert mem.alive_bytes == activations  # views of parameters are not new storages


def test_nothing_leaks(x):
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN))
    kept = []

    def fn(inp):
        hidden = model[0](inp)  # saved by LayerNorm, so alive while the graph is
        kept.extend([weakref.ref(hidden), weakref.ref(hidden.untyped_storage())])
        return model[1](hidden)

    mem = measure_activation_memory(fn, x, exclude=model.parameters())

    assert mem.saved_bytes == ROWS_BYTES + 2 * STAT_BYTES
    gc.collect()
    assert [ref() for ref in kept] == [None, None]


def test_outputs_still_have_gradients_after_measuring(x):
    grads = []

    def fn(inp):
        y = torch.nn.functional.layer_norm(inp.sin(), (HIDDEN,))
        y.sum().backward()
        grads.append(inp.grad.clone())
        return y

    measure_activation_memory(fn, x)

    reference = torch.autograd.grad(torch.nn.functional.layer_norm(x.sin(), (HIDDEN,)).sum(), x)
    torch.testing.assert_close(grads[0], reference[0], rtol=0, atol=0)


def test_per_token_validates_and_str_uses_units():
    mem = ActivationMemory(saved_bytes=2048, alive_bytes=4096, saved=(), alive=())

    assert mem.per_token(2, 4) == 512.0
    with pytest.raises(ValueError, match="tokens=0"):
        mem.per_token(0, 4)
    assert str(mem) == "saved 2.00 KiB in 0 storages, alive 4.00 KiB in 0 storages"
    assert [format_bytes(n) for n in (0, 1023, 16640, 3 * 2**30)] == [
        "0 B",
        "1023 B",
        "16.25 KiB",
        "3.00 GiB",
    ]


def test_peak_memory_on_cpu_counts_live_tensor_bytes_above_the_start():
    before = torch.ones(10_000)  # allocated before the block: not counted
    with peak_memory("cpu") as peak:
        a = torch.empty(1000)  # 4000 bytes
        b = a + before[:1000]  # 8000 live
        view = b[::2]  # a view: no new storage
        del a
        c = torch.empty(3000)  # 4000 + 12000 = 16000 live: the peak
        del b, view, c
        d = torch.empty(100)
    assert peak.bytes == 16000 and peak.method == "CPU allocator events (torch.profiler)"
    del d
