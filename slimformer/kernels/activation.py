"""Activation (+ dropout) that backward recomputes, and the MLP built on it.

The MLP block of a Transformer is fc2(dropout(act(fc1(x)))). Eager PyTorch keeps, for
backward, fc1's output, the dropout mask and the dropped activation (fc2's input).
Here only h = x W1ᵀ + b1 (fc1's output) is kept, or nothing at all with
``recompute_fc1`` (h is recomputed from x, which the block's caller keeps anyway):

    forward:  h = x W1ᵀ + b1                    (cuBLAS, bias in its epilogue)
              a = dropout(act(h))               (Triton, elementwise)
              out = a W2ᵀ + b2                  (cuBLAS); a is freed at once
    backward: a = dropout(act(h)) again         (same Philox mask, from the seed)
              dW2 = doutᵀ a,  da = dout W2
              dh = da · mask · scale · act'(h),  db1 = Σ_rows dh   (scale = 1 / (1 - p_eff))
              dW1 = dhᵀ x,  dx = dh W1

The bias is added inside fc1's GEMM, before h is rounded to its dtype, as eager
PyTorch does: adding it to an already rounded x W1ᵀ could flip the sign ReLU sees.

Activations: ``relu``, ``gelu`` (exact: z Φ(z), Φ to about 6e-7 on the Triton path),
``gelu_tanh`` (tanh approximation), and the gated ``swiglu`` and ``geglu`` (ModernBERT's),
for which fc1 produces [gate | up] side by side (2·F columns) and a = silu(gate) · up or
gelu(gate) · up. Elementwise math runs in fp32; outputs keep
the input dtype. The dropout mask is a (rows, F) dropout matrix (see ``philox.py``).
float64 inputs (``torch.autograd.gradcheck``, float64 models) always take the PyTorch
reference, on every device, computing and accumulating in float64.
"""

import math

import torch
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels.dispatch import (
    FLOAT_DTYPES,
    absent_output,
    cdiv,
    check_linear,
    direct,
    eager_autograd,
    next_power_of_2,
    reference_row_blocks,
    use_triton,
)
from slimformer.kernels.dropout import tile_origin
from slimformer.kernels.philox import (
    DECISIONS_PER_CALL,
    dropout_keep_block,
    dropout_keep_tile,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
# fc1 produces [gate | up] for these: act(gate) * up
GATED = ("swiglu", "geglu")
_ACTIVATION_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}
_RELU, _GELU, _GELU_TANH, _SWIGLU, _GEGLU = range(5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _reciprocal(x):
    """1 / x for x >= 1 (or inf) as rsqrt(x)², about 3 ulp: the hardware's reciprocal square
    root and one multiply, where IEEE division is a subroutine and ``tl.fdiv`` wraps the
    hardware reciprocal in range checks (their cost: bench/results/compile-sm90.md)."""
    r = tl.math.rsqrt(x)
    return r * r


@triton.jit
def _sigmoid(x):
    # 1 / (1 + 2^(-x log2 e)): tl.exp2 is the hardware's base-2 exponential (flush-to-zero),
    # tl.exp adds a multiply and a denormal fix-up around it; 1 / inf = 0 far left.
    return _reciprocal(1.0 + tl.exp2(x * -1.4426950408889634))


@triton.jit
def _normal_upper_tail(z):
    """(Φ(-|z|), e^{-z²/2}) from Abramowitz & Stegun 7.1.26 (|error in Φ| < 8e-8; t's ~3 ulp
    from the fast reciprocal add up to 6e-7 near z = 0, where |t dΦ/dt| is largest, 1.7): one
    reciprocal and a degree-5 polynomial, where libdevice's erf evaluates two polynomials
    and selects per element, which leaves the GELU kernels issue-bound. With x = |z| / √2,
    t = 1 / (1 + 0.3275911 x): Φ(-|z|) = e^{-x²} (a1 t + ... + a5 t⁵) / 2; the coefficients
    below are a_i / 2."""
    t = _reciprocal(1.0 + 0.23164190554202086 * tl.abs(z))  # 0.3275911 / √2
    gauss = tl.exp2(z * z * -0.7213475204444817)  # e^{-z²/2} = 2^(-z² log2(e) / 2)
    poly = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    return gauss * poly, gauss


@triton.jit
def _activation_and_derivative(z, ACTIVATION: tl.constexpr):
    """act(z) and act'(z) in fp32 for the single-input activations."""
    if ACTIVATION == 0:  # relu
        value = tl.maximum(z, 0.0)
        derivative = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == 1:  # gelu: z Φ(z), derivative Φ(z) + z φ(z)
        tail, gauss = _normal_upper_tail(z)
        cdf = tl.where(z >= 0.0, 1.0 - tail, tail)
        value = z * cdf
        derivative = cdf + z * (0.3989422804014327 * gauss)
    else:  # gelu_tanh: 0.5 z (1 + tanh(u)) = z s, s = sigmoid(2u), u = √(2/π) (z + 0.044715 z³);
        # derivative s + z u' (1 - tanh²(u)) / 2 = s + 2 z u' s (1 - s)
        z2 = z * z
        # s = 1 / (1 + 2^(-2u log2 e)), the constants folded by hand (the compiler keeps fp order)
        s = _reciprocal(1.0 + tl.exp2(z * (-2.302208198144325 - 0.1029432395800235 * z2)))
        value = z * s
        derivative = s + 1.5957691216057308 * z * s * (1.0 - s) * (1.0 + 0.134145 * z2)
    return value, derivative


@triton.jit
def _activation_fwd_kernel(
    H,  # (M, K) fc1 output; K = N, or 2N for swiglu and geglu ([gate | up])
    OUT,  # (M, N) dropout(act(h))
    SEED,  # () int64 dropout seed, or None
    M,
    N,
    dropout_p,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, col_start = tile_origin(M, N, BLOCK_M, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    width = 2 * N if ACTIVATION >= 3 else N
    h_offsets = rows[:, None].to(tl.int64) * width + cols[None, :]
    z = tl.load(H + h_offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 3:  # swiglu: silu(gate) * up
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        a = z * _sigmoid(z) * up
    elif ACTIVATION == 4:  # geglu: gelu(gate) * up
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        a, _ = _activation_and_derivative(z, 1)
        a = a * up
    else:
        a, _ = _activation_and_derivative(z, ACTIVATION)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    if SEED is not None:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        keep = dropout_keep_tile(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N)
        a *= tl.where(keep, scale, 0.0)
    tl.store(OUT + offsets, a.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _activation_bwd_kernel(
    DA,  # (M, N) gradient of the dropped activation
    H,  # (M, K) fc1 output
    DH,  # (M, K) gradient of h
    SEED,  # () int64 dropout seed, or None
    M,
    N,
    dropout_p,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, col_start = tile_origin(M, N, BLOCK_M, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    da = tl.load(DA + offsets, mask=mask, other=0.0).to(tl.float32)
    if SEED is not None:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        keep = dropout_keep_tile(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N)
        da *= tl.where(keep, scale, 0.0)
    width = 2 * N if ACTIVATION >= 3 else N
    h_offsets = rows[:, None].to(tl.int64) * width + cols[None, :]
    z = tl.load(H + h_offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 3:
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        sig = _sigmoid(z)
        silu = z * sig
        dgate = da * up * sig * (1.0 + z * (1.0 - sig))
        tl.store(DH + h_offsets, dgate.to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + h_offsets + N, (da * silu).to(DH.dtype.element_ty), mask=mask)
    elif ACTIVATION == 4:
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        gelu, derivative = _activation_and_derivative(z, 1)
        tl.store(DH + h_offsets, (da * up * derivative).to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + h_offsets + N, (da * gelu).to(DH.dtype.element_ty), mask=mask)
    else:
        _, derivative = _activation_and_derivative(z, ACTIVATION)
        tl.store(DH + h_offsets, (da * derivative).to(DH.dtype.element_ty), mask=mask)


def _grid(M: int, N: int) -> tuple[tuple[int], int, int]:
    """2-D tiles of 8192 elements (64 per thread: the per-program set-up and the Philox key
    schedule amortised), wide along the contiguous columns, on one grid axis."""
    block_n = min(1024, max(DECISIONS_PER_CALL, next_power_of_2(N)))
    block_m = 8192 // block_n
    return (cdiv(M, block_m) * cdiv(N, block_n),), block_m, block_n


def _out_features(h: torch.Tensor, activation: str) -> int:
    return h.shape[1] // 2 if activation in GATED else h.shape[1]


def _activation_fwd(h, seed, activation, dropout_p):
    """(M, K) -> (M, N): dropout(act(h)) with the Triton kernel."""
    M, N = h.shape[0], _out_features(h, activation)
    out = torch.empty((M, N), dtype=h.dtype, device=h.device)
    if out.numel():
        grid, block_m, block_n = _grid(M, N)
        _activation_fwd_kernel[grid](
            h,
            out,
            seed,
            M,
            N,
            dropout_p,
            ACTIVATION=_ACTIVATION_IDS[activation],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
    return out


def _activation_bwd(da, h, seed, activation, dropout_p):
    """Gradient of h (M, K) from that of the dropped activation (M, N)."""
    M, N = da.shape
    dh = torch.empty_like(h)
    if dh.numel():
        grid, block_m, block_n = _grid(M, N)
        _activation_bwd_kernel[grid](
            da,
            h,
            dh,
            seed,
            M,
            N,
            dropout_p,
            ACTIVATION=_ACTIVATION_IDS[activation],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
    return dh


def _runs_kernels(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype != torch.float64


def _reference_dtype(x: torch.Tensor) -> torch.dtype:
    """The references' compute dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _activation_value(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(z) in z's dtype for the single-input activations (the kernel's functions, torch's CPU ops)."""
    if activation == "relu":
        return z.clamp_min(0.0)
    return torch.nn.functional.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _activation_input_grad(da: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """da · act'(z) in their dtype for the single-input activations."""
    if activation == "relu":
        return torch.ops.aten.threshold_backward(da, z, 0.0)
    return torch.ops.aten.gelu_backward(da, z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _halves(h: torch.Tensor, activation: str):
    """(gate, up) for swiglu and geglu, else (h, None), in the reference dtype."""
    if activation in GATED:
        gate, up = rearrange(h.to(_reference_dtype(h)), "m (two n) -> two m n", two=2)
        return gate, up
    return h.to(_reference_dtype(h)), None


def _dropout_scale_rows(seed, start, stop, n_cols, dropout_p, dtype, device) -> torch.Tensor:
    """keep · scale in ``dtype`` for rows start:stop of an (M, n_cols) matrix, as the kernels draw it."""
    keep = dropout_keep_block(seed, torch.arange(start, stop, device=device), 0, n_cols, n_cols, dropout_p)
    return keep.to(dtype).mul_(dropout_threshold(dropout_p)[1])


def _activated_rows(h_rows, start, seed, activation, dropout_p) -> torch.Tensor:
    """dropout(act(h)) in the reference dtype for the rows of h from row ``start`` on (the mask's rows)."""
    z, up = _halves(h_rows, activation)
    if activation in GATED:
        a = (torch.nn.functional.silu(z) if activation == "swiglu" else _activation_value(z, "gelu")).mul_(up)
    else:
        a = _activation_value(z, activation)
    if seed is not None:
        a.mul_(_dropout_scale_rows(seed, start, start + len(h_rows), a.shape[1], dropout_p, a.dtype, h_rows.device))
    return a


def _input_grad_rows(da_rows, h_rows, start, seed, activation, dropout_p) -> torch.Tensor:
    """The gradient of h in the reference dtype from that of dropout(act(h)), for rows from ``start`` on."""
    da_rows = da_rows.to(_reference_dtype(da_rows))
    if seed is not None:
        n_cols = da_rows.shape[1]
        da_rows = da_rows * _dropout_scale_rows(
            seed, start, start + len(da_rows), n_cols, dropout_p, da_rows.dtype, da_rows.device
        )
    z, up = _halves(h_rows, activation)
    if activation == "swiglu":
        return torch.cat([torch.ops.aten.silu_backward(da_rows * up, z), da_rows.mul_(torch.nn.functional.silu(z))], 1)
    if activation == "geglu":
        return torch.cat(
            [_activation_input_grad(da_rows * up, z, "gelu"), da_rows.mul_(_activation_value(z, "gelu"))], 1
        )
    return _activation_input_grad(da_rows, z, activation)


def _activation_fwd_reference(h, seed, activation, dropout_p):
    """PyTorch statement of ``_activation_fwd``, in blocks of rows."""
    out = torch.empty((h.shape[0], _out_features(h, activation)), dtype=h.dtype, device=h.device)
    for start, stop in reference_row_blocks(h.shape[0], h.shape[1]):
        out[start:stop] = _activated_rows(h[start:stop], start, seed, activation, dropout_p)
    return out


def _activation_bwd_reference(da, h, seed, activation, dropout_p):
    """PyTorch statement of ``_activation_bwd``, in blocks of rows."""
    dh = torch.empty_like(h)
    for start, stop in reference_row_blocks(h.shape[0], h.shape[1]):
        dh[start:stop] = _input_grad_rows(da[start:stop], h[start:stop], start, seed, activation, dropout_p)
    return dh


def _mlp_fwd_reference(x, w1, b1, w2, b2, seed, activation, dropout_p, keep_h):
    """The MLP forward on the PyTorch path: (out, h if ``keep_h`` else None). Works in
    blocks of rows, so that with fc1 recomputed neither h nor the activation exists at
    full size, and otherwise only h does."""
    h = torch.nn.functional.linear(x, w1, b1) if keep_h else None
    out = torch.empty((x.shape[0], w2.shape[0]), dtype=x.dtype, device=x.device)
    for start, stop in reference_row_blocks(x.shape[0], w1.shape[0]):
        h_rows = h[start:stop] if keep_h else torch.nn.functional.linear(x[start:stop], w1, b1)
        a = _activated_rows(h_rows, start, seed, activation, dropout_p).to(x.dtype)
        out[start:stop] = torch.nn.functional.linear(a, w2, b2)
    return out, h


def _mlp_bwd_reference(dout, x, w1, b1, w2, h, seed, activation, dropout_p, dx):
    """(dw1, db1, dw2) of the MLP on the PyTorch path, dx written into ``dx``, in blocks
    of rows: a block of h (recomputed from x when not kept), of the activation, of its
    gradient and of dh is all that is alive besides the gradients; dW1, db1 and dW2
    accumulate in the reference dtype."""
    acc = _reference_dtype(x)
    dw1 = torch.zeros(w1.shape, dtype=acc, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=acc, device=x.device)
    db1 = None if b1 is None else torch.zeros(w1.shape[0], dtype=acc, device=x.device)
    for start, stop in reference_row_blocks(x.shape[0], w1.shape[0]):
        x_rows, dout_rows = x[start:stop], dout[start:stop]
        h_rows = torch.nn.functional.linear(x_rows, w1, b1) if h is None else h[start:stop]
        a = _activated_rows(h_rows, start, seed, activation, dropout_p).to(x.dtype)
        dw2.addmm_(dout_rows.t().to(acc), a.to(acc))
        dh = _input_grad_rows(dout_rows @ w2, h_rows, start, seed, activation, dropout_p).to(x.dtype)
        dx[start:stop] = dh @ w1
        dw1.addmm_(dh.t().to(acc), x_rows.to(acc))
        if db1 is not None:
            db1 += dh.sum(0, dtype=acc)
    return dw1.to(w1.dtype), None if db1 is None else db1.to(b1.dtype), dw2.to(w2.dtype)


def _activation(h, seed, activation, dropout_p):
    fwd = _activation_fwd if use_triton(h) else _activation_fwd_reference
    return fwd(h, seed, activation, dropout_p)


def _activation_grad(da, h, seed, activation, dropout_p):
    bwd = _activation_bwd if use_triton(da) else _activation_bwd_reference
    return bwd(da.contiguous(), h, seed, activation, dropout_p)


# The differentiable op: forward and backward ``torch.library`` ops joined by
# ``register_autograd``, so that torch.compile keeps x, the weights, the seed and h (or
# not h, with recompute_fc1) and cannot re-plan what is saved.


@torch.library.custom_op("slimformer::fused_mlp", mutates_args=())
def _mlp_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    seed: torch.Tensor | None,
    activation: str,
    dropout_p: float,
    recompute_fc1: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h) on (M, D) rows; h is an empty placeholder with ``recompute_fc1``."""
    if _runs_kernels(x):
        h = torch.nn.functional.linear(x, w1, b1)
        out = torch.nn.functional.linear(_activation(h, seed, activation, dropout_p), w2, b2)
    else:
        out, h = _mlp_fwd_reference(x, w1, b1, w2, b2, seed, activation, dropout_p, keep_h=not recompute_fc1)
    return out, absent_output(x.device) if recompute_fc1 else h


@_mlp_op.register_fake
def _(x, w1, b1, w2, b2, seed, activation, dropout_p, recompute_fc1):
    out = x.new_empty((x.shape[0], w2.shape[0]))
    return out, absent_output(x.device) if recompute_fc1 else x.new_empty((x.shape[0], w1.shape[0]))


@torch.library.custom_op("slimformer::fused_mlp_backward", mutates_args=("dx",))
def _mlp_backward_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    h: torch.Tensor | None,
    seed: torch.Tensor | None,
    activation: str,
    dropout_p: float,
    has_b2: bool,
    dx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dw1, db1, dw2, db2), the input gradient written into ``dx`` (x's shape), h
    recomputed from x when None; db1 / db2 are empty placeholders without biases."""
    dout = dout.contiguous()
    db2 = dout.sum(0, dtype=_reference_dtype(dout)).to(dout.dtype) if has_b2 else absent_output(x.device)
    if not _runs_kernels(x):
        with torch.autocast(x.device.type, enabled=False):  # as in the forward
            dw1, db1, dw2 = _mlp_bwd_reference(dout, x, w1, b1, w2, h, seed, activation, dropout_p, dx)
        return dw1, absent_output(x.device) if db1 is None else db1, dw2, db2
    if h is None:
        h = torch.nn.functional.linear(x, w1, b1)
    a = _activation(h, seed, activation, dropout_p)
    dw2 = dout.t() @ a
    del a
    dh = _activation_grad(dout @ w2, h, seed, activation, dropout_p)
    torch.mm(dh, w1, out=dx)
    dw1 = dh.t() @ x
    db1 = absent_output(x.device) if b1 is None else dh.sum(0, dtype=torch.float32).to(b1.dtype)
    return dw1, db1, dw2, db2


@_mlp_backward_op.register_fake
def _(dout, x, w1, b1, w2, h, seed, activation, dropout_p, has_b2, dx):
    db1 = absent_output(x.device) if b1 is None else torch.empty_like(b1)
    db2 = dout.new_empty(dout.shape[1]) if has_b2 else absent_output(x.device)
    return torch.empty_like(w1), db1, torch.empty_like(w2), db2


def _mlp_setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, seed, activation, dropout_p, recompute_fc1 = inputs
    ctx.save_for_backward(x, w1, b1, w2, seed, None if recompute_fc1 else output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.config = (activation, dropout_p, b2 is not None)


def _mlp_backward(ctx, dout, _dh):
    if dout is None:  # the output got no gradient
        return (None,) * 9
    x, w1, b1, w2, seed, h = ctx.saved_tensors
    activation, dropout_p, has_b2 = ctx.config
    # dx is allocated here, not inside the op: under torch.compile it is then inductor's
    # buffer, which can take the storage of a gradient that died just before (inductor
    # keeps a dead buffer for its next allocation of that size, and sees none inside a
    # custom op: with dx allocated in the op, that dead buffer outlives the op).
    dx = torch.empty_like(x)
    dw1, db1, dw2, db2 = direct(_mlp_backward_op)(dout, x, w1, b1, w2, h, seed, activation, dropout_p, has_b2, dx)
    return dx, dw1, db1 if b1 is not None else None, dw2, db2 if has_b2 else None, None, None, None, None


_mlp = eager_autograd(_mlp_op, _mlp_backward, _mlp_setup_context)


def _check_linear(name: str, weight: torch.Tensor, bias, in_features: int, x: torch.Tensor) -> None:
    check_linear(weight, bias, in_features, x, f"{name}_weight", f"{name}_bias")


def _autocast_inputs(x, tensors):
    """Cast like the Linear layers autocast would (a no-op outside autocast; autocast casts
    no float64 tensor)."""
    if not torch.is_autocast_enabled(x.device.type):
        return x, tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    x, *cast = (t if t is None or t.dtype == torch.float64 else t.to(dtype) for t in (x, *tensors))
    return x, cast


def fused_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    activation: str = "gelu",
    dropout_p: float = 0.0,
    recompute_fc1: bool = False,
) -> torch.Tensor:
    """fc2(dropout(act(fc1(x)))) keeping only fc1's output for backward (or nothing).

    x: (..., D) float32/float16/bfloat16, or float64 (the PyTorch reference in float64, on
    any device: ``torch.autograd.gradcheck``). fc1_weight: (F, D), or (2F, D) for "swiglu"
    and "geglu" ([gate | up] rows); fc1_bias: its rows or None. fc2_weight: (D_out, F); fc2_bias:
    (D_out,) or None. activation: "relu", "gelu", "gelu_tanh", "swiglu" or "geglu". dropout_p in
    [0, 1) (pass 0 in eval), masks regenerated from a Philox seed drawn from torch's
    generator. recompute_fc1: keep nothing but x; backward recomputes fc1.
    Returns (..., D_out) in x's dtype (the autocast dtype under autocast, like nn.Linear).
    Raises ValueError/TypeError naming the argument on bad shapes, dtypes or devices.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in (*FLOAT_DTYPES, torch.float64):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32, float16, bfloat16 or float64 torch.Tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., D_in), got a 0-d tensor")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    x, (fc1_weight, fc1_bias, fc2_weight, fc2_bias) = _autocast_inputs(x, (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    _check_linear("fc1", fc1_weight, fc1_bias, x.shape[-1], x)
    hidden = fc1_weight.shape[0] // 2 if activation in GATED else fc1_weight.shape[0]
    if activation in GATED and fc1_weight.shape[0] % 2:
        raise ValueError(
            f"fc1_weight for {activation} needs an even number of rows [gate | up], got {fc1_weight.shape[0]}"
        )
    _check_linear("fc2", fc2_weight, fc2_bias, hidden, x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    seed = new_dropout_seed(x.device, rows.detach(), "fused_mlp") if dropout_p > 0 else None
    with torch.autocast(x.device.type, enabled=False):
        out, _ = _mlp(
            rows, fc1_weight, fc1_bias, fc2_weight, fc2_bias, seed, activation, float(dropout_p), bool(recompute_fc1)
        )
    return out.view(*x.shape[:-1], fc2_weight.shape[0])
