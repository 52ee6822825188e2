"""Norm benchmarks: LayerNorm, RMSNorm and residual add + LayerNorm; forward, backward, both.

Ops: ``layer_norm`` and ``rms_norm`` normalise x; ``add_layer_norm`` normalises x + residual
(slimformer fuses the add through ``residual=``; the baselines run ``F.layer_norm(x + residual)``).
Providers: ``slimformer`` (``memory_efficient=True``, what sf.LayerNorm and sf.RMSNorm
do by default), ``torch`` (eager ``F.layer_norm`` / ``F.rms_norm``) and ``torch.compile`` of that
eager function. Modes: ``fwd`` is the training forward (inputs require grad, so each
provider saves what its backward needs); ``bwd`` is the backward of a retained forward;
``full`` is forward + backward. Gradients are taken for every input (x, residual, weight,
bias) with ``torch.autograd.grad``, so nothing accumulates between rounds.

GB/s divides ``norm_bytes`` (the op's ideal traffic, the same for every provider) by the
median time. On CPU slimformer runs its PyTorch reference path: the numbers there only
exercise the harness.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import slimformer as sf
from bench.harness import CLOCK, bench_device, device_name, measure, warm_up
from slimformer.kernels.dispatch import use_triton

pytestmark = pytest.mark.benchmark(timer=CLOCK)

DEVICE = bench_device()
if DEVICE.type == "cuda":
    ROWS, HIDDEN, DTYPE = 4096, [512, 768, 1024, 2048, 4096, 8192, 16384], torch.bfloat16
else:
    ROWS, HIDDEN, DTYPE = 64, [128, 256, 768, 1024], torch.float32  # four points: a trend to read
EPS = 1e-5
OPS = ["layer_norm", "rms_norm", "add_layer_norm"]
MODES = ["fwd", "bwd", "full"]
PROVIDERS = ["slimformer", "torch", "torch.compile"]


def norm_bytes(op: str, mode: str, rows: int, hidden: int, itemsize: int) -> int:
    """Bytes an ideal kernel reads and writes in one call of ``op`` in ``mode``.

    With act = rows * hidden * itemsize (one activation), vec = hidden * itemsize (one
    parameter vector) and stats = 4 bytes per row per fp32 statistic (LayerNorm: mean
    and rstd; RMSNorm: rstd):
      fwd:  read x (+ residual) + weight (+ bias); write y + stats.
      bwd:  read dy + one saved activation + weight + stats; write dx + dweight (+ dbias).
            The residual's gradient is dx itself (no dropout), so it is not written twice.
      full: fwd + bwd.
    """
    act, vec = rows * hidden * itemsize, hidden * itemsize
    has_bias = op != "rms_norm"
    stats = 4 * rows * (2 if has_bias else 1)
    params = vec * (2 if has_bias else 1)
    inputs = act * (2 if op == "add_layer_norm" else 1)
    fwd = inputs + params + act + stats
    bwd = 2 * act + vec + stats + act + params
    return {"fwd": fwd, "bwd": bwd, "full": fwd + bwd}[mode]


def torch_layer_norm(x, residual, weight, bias):
    return F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def torch_add_layer_norm(x, residual, weight, bias):
    h = x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, EPS)


def torch_rms_norm(x, residual, weight, bias):
    return F.rms_norm(x, x.shape[-1:], weight, EPS)


def slimformer_layer_norm(x, residual, weight, bias):
    return sf.layer_norm(x, x.shape[-1:], weight, bias, EPS, residual=residual, memory_efficient=True)


def slimformer_rms_norm(x, residual, weight, bias):
    return sf.rms_norm(x, x.shape[-1:], weight, EPS, memory_efficient=True)


EAGER = {"layer_norm": torch_layer_norm, "rms_norm": torch_rms_norm, "add_layer_norm": torch_add_layer_norm}
SLIMFORMER = {
    "layer_norm": slimformer_layer_norm,
    "rms_norm": slimformer_rms_norm,
    "add_layer_norm": slimformer_layer_norm,
}


@functools.cache
def compiled(op: str):
    """torch.compile of the eager op, one graph per shape (each op has its own code object,
    so the sweep stays under dynamo's recompile limit of 8 per function)."""
    return torch.compile(EAGER[op], dynamic=False)


def norm_function(op: str, provider: str):
    if provider == "slimformer":
        return SLIMFORMER[op]
    return EAGER[op] if provider == "torch" else compiled(op)


def make_inputs(op: str, hidden: int) -> tuple:
    """(x, residual or None, weight, bias or None), all requiring grad.

    Weights near 1 and small biases keep the memory-efficient rebuild x̂ = (y - b) / w valid.
    """

    def tensor(*shape, scale=1.0, offset=0.0):
        values = offset + scale * torch.randn(*shape, device=DEVICE, dtype=torch.float32)
        return values.to(DTYPE).requires_grad_()

    x = tensor(ROWS, hidden)
    residual = tensor(ROWS, hidden) if op == "add_layer_norm" else None
    weight = tensor(hidden, scale=0.1, offset=1.0)
    bias = None if op == "rms_norm" else tensor(hidden, scale=0.1)
    return x, residual, weight, bias


def make_step(fn, inputs: tuple, mode: str):
    """The callable one round times: ``fn``'s forward, backward (of a retained forward) or both."""
    leaves = [t for t in inputs if t is not None]
    dy = torch.randn_like(inputs[0])
    if mode == "fwd":
        return lambda: fn(*inputs)
    if mode == "bwd":
        y = fn(*inputs)
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*inputs), leaves, dy)


def implementation(provider: str, x: torch.Tensor) -> str:
    """What actually runs, so a CPU run is never mistaken for a kernel measurement."""
    if provider == "slimformer":
        return "triton" if use_triton(x) else "pytorch-reference"
    return "eager" if provider == "torch" else "inductor"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_norm(benchmark, op, mode, hidden, provider):
    inputs = make_inputs(op, hidden)
    try:
        step = make_step(norm_function(op, provider), inputs, mode)
        warm_up(step, DEVICE)
    except Exception as err:
        if provider != "torch.compile":
            raise
        first_line = next(iter(str(err).splitlines()), "")
        pytest.skip(f"torch.compile does not work on this machine: {type(err).__name__}: {first_line[:200]}")

    benchmark.group = f"norm {op} {mode} hidden={hidden}"
    benchmark.extra_info.update(
        family="norm",
        op=op,
        mode=mode,
        provider=provider,
        implementation=implementation(provider, inputs[0]),
        sweep="hidden",
        hidden=hidden,
        rows=ROWS,
        dtype=str(DTYPE).removeprefix("torch."),
        device=device_name(DEVICE),
        work=norm_bytes(op, mode, ROWS, hidden, DTYPE.itemsize),
        unit="GB/s",
    )
    measure(benchmark, step, DEVICE)
