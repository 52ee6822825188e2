"""Three projections of one input, yᵢ = x Wᵢᵀ + bᵢ (attention's q, k and v), as one
differentiable op.

Its backward sums the input gradients into one tensor, dx = Σᵢ dyᵢ Wᵢ (one GEMM, then
in-place ones), and the weight gradients are dWᵢ = dyᵢᵀ x, dbᵢ = Σ_rows dyᵢ. The op saves x
and the weights, as the separate Linears do. What it changes is the input gradients' memory:
separate Linears make one input-sized gradient each, two of which eager autograd holds at
once to sum them, and torch.compile all of them (inductor allocates each, and keeps a dead
buffer for its next allocation of that size, which may come only after the next layer's
attention backward). Here only dx exists, and under torch.compile it is allocated by the
autograd backward, outside the op: inductor's buffer, which takes a dead gradient's storage.

The GEMMs are PyTorch's (cuBLAS on CUDA): there is no kernel of our own to run.
"""

import torch

from slimformer.kernels.dispatch import FLOAT_DTYPES, absent_output, check_linear, direct, eager_autograd

# The differentiable op: forward and backward ``torch.library`` ops joined by
# ``register_autograd``, so that torch.compile keeps x and the weights and cannot re-plan
# the backward into separate input gradients.


@torch.library.custom_op("slimformer::projections", mutates_args=())
def _projections_op(
    x: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x W₀ᵀ + b₀, x W₁ᵀ + b₁, x W₂ᵀ + b₂) for (M, D) rows x."""
    linear = torch.nn.functional.linear
    return linear(x, w0, b0), linear(x, w1, b1), linear(x, w2, b2)


@_projections_op.register_fake
def _(x, w0, b0, w1, b1, w2, b2):
    return tuple(x.new_empty((x.shape[0], w.shape[0])) for w in (w0, w1, w2))


@torch.library.custom_op("slimformer::projections_backward", mutates_args=("dx",))
def _projections_backward_op(
    dy0: torch.Tensor,
    dy1: torch.Tensor,
    dy2: torch.Tensor,
    x: torch.Tensor,
    w0: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    has_bias: list[bool],
    dx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dW₀, db₀, dW₁, db₁, dW₂, db₂), db an empty placeholder without bias; Σᵢ dyᵢ Wᵢ
    written into dx."""
    out = []
    for i, (dy, w, bias) in enumerate(zip((dy0, dy1, dy2), (w0, w1, w2), has_bias, strict=True)):
        dy = dy.contiguous()
        if i == 0:
            torch.mm(dy, w, out=dx)
        else:
            dx.addmm_(dy, w)
        out.append(dy.t() @ x)
        out.append(dy.sum(0, dtype=torch.float32).to(dy.dtype) if bias else absent_output(x.device))
    return tuple(out)


@_projections_backward_op.register_fake
def _(dy0, dy1, dy2, x, w0, w1, w2, has_bias, dx):
    out = []
    for dy, w, bias in zip((dy0, dy1, dy2), (w0, w1, w2), has_bias, strict=True):
        out += [torch.empty_like(w), dy.new_empty(dy.shape[1]) if bias else absent_output(x.device)]
    return tuple(out)


def _setup_context(ctx, inputs, output):
    x, w0, b0, w1, b1, w2, b2 = inputs
    ctx.save_for_backward(x, w0, w1, w2)
    ctx.has_bias = [b is not None for b in (b0, b1, b2)]


def _backward(ctx, dy0, dy1, dy2):
    x, w0, w1, w2 = ctx.saved_tensors
    dx = torch.empty_like(x)  # here, not inside the op: see the module docstring
    dw0, db0, dw1, db1, dw2, db2 = direct(_projections_backward_op)(dy0, dy1, dy2, x, w0, w1, w2, ctx.has_bias, dx)
    b0, b1, b2 = ctx.has_bias
    return dx, dw0, db0 if b0 else None, dw1, db1 if b1 else None, dw2, db2 if b2 else None


_projections = eager_autograd(_projections_op, _backward, _setup_context)


def projections(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """[x Wᵢᵀ + bᵢ for the three weights], as ``nn.Linear``s would compute them, with one
    input gradient.

    x: (..., D) float32/float16/bfloat16. weights: three (Nᵢ, D) tensors in x's dtype and
    on its device; biases: three (Nᵢ,) tensors or None. Returns a list of three (..., Nᵢ)
    in x's dtype (the autocast dtype under autocast, like nn.Linear).
    Raises ValueError/TypeError naming the argument on bad shapes, dtypes or devices.
    """
    weights, biases = list(weights), list(biases)
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32, float16 or bfloat16 torch.Tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., D), got a 0-d tensor")
    if len(weights) != 3 or len(biases) != 3:
        raise ValueError(f"weights and biases must be three each (q, k, v), got {len(weights)} and {len(biases)}")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x = x.to(dtype)
        weights = [w.to(dtype) for w in weights]
        biases = [None if b is None else b.to(dtype) for b in biases]
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        check_linear(w, b, x.shape[-1], x, f"weights[{i}]", f"biases[{i}]")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    with torch.autocast(x.device.type, enabled=False):
        out = _projections(rows, *(t for pair in zip(weights, biases, strict=True) for t in pair))
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in out]
