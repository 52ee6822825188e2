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
              dh = da · mask / (1 - p) · act'(h),  db1 = Σ_rows dh
              dW1 = dhᵀ x,  dx = dh W1

The bias is added inside fc1's GEMM, before h is rounded to its dtype, as eager
PyTorch does: adding it to an already rounded x W1ᵀ could flip the sign ReLU sees.

Activations: ``relu``, ``gelu`` (exact, erf), ``gelu_tanh`` (tanh approximation) and
``swiglu``, for which fc1 produces [gate | up] side by side (2·F columns) and
a = silu(gate) · up. Elementwise math runs in fp32; outputs keep the input dtype.
"""

import math

import torch
import triton
import triton.language as tl
from einops import rearrange

from slimformer.kernels.dispatch import FLOAT_DTYPES, use_triton
from slimformer.kernels.philox import (
    DECISIONS_PER_CALL,
    dropout_keep_block,
    dropout_keep_tile,
    dropout_threshold,
    dropout_threshold_and_scale,
    new_dropout_seed,
)

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")
_ACTIVATION_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}
_RELU, _GELU, _GELU_TANH, _SWIGLU = range(4)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _tanh(u):
    # tanh without libdevice (not available to the interpreter), from e^{-2|u|} <= 1
    # so nothing overflows: tanh|u| = (1 - e) / (1 + e).
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0.0, t, -t)


@triton.jit
def _activation_and_derivative(z, ACTIVATION: tl.constexpr):
    """act(z) and act'(z) in fp32 for the single-input activations."""
    if ACTIVATION == 0:  # relu
        value = tl.maximum(z, 0.0)
        derivative = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == 1:  # gelu: z Φ(z), derivative Φ(z) + z φ(z)
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        value = z * cdf
        derivative = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    else:  # gelu_tanh: 0.5 z (1 + tanh(u)), u = √(2/π) (z + 0.044715 z³)
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        value = 0.5 * z * (1.0 + t)
        derivative = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    return value, derivative


@triton.jit
def _activation_fwd_kernel(
    H,  # (M, K) fc1 output; K = N, or 2N for swiglu ([gate | up])
    OUT,  # (M, N) dropout(act(h))
    SEED,  # () int64 dropout seed, or None
    M,
    N,
    dropout_p,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    width = 2 * N if ACTIVATION == 3 else N
    h_offsets = rows[:, None].to(tl.int64) * width + cols[None, :]
    z = tl.load(H + h_offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 3:  # swiglu: silu(gate) * up
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        a = z * tl.sigmoid(z) * up
    else:
        a, _ = _activation_and_derivative(z, ACTIVATION)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    if SEED is not None:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        keep = dropout_keep_tile(tl.load(SEED), rows, tl.program_id(1) * BLOCK_N, N, threshold, BLOCK_N)
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
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    da = tl.load(DA + offsets, mask=mask, other=0.0).to(tl.float32)
    if SEED is not None:
        threshold, scale = dropout_threshold_and_scale(dropout_p)
        keep = dropout_keep_tile(tl.load(SEED), rows, tl.program_id(1) * BLOCK_N, N, threshold, BLOCK_N)
        da *= tl.where(keep, scale, 0.0)
    width = 2 * N if ACTIVATION == 3 else N
    h_offsets = rows[:, None].to(tl.int64) * width + cols[None, :]
    z = tl.load(H + h_offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 3:
        up = tl.load(H + h_offsets + N, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        silu = z * sig
        dgate = da * up * sig * (1.0 + z * (1.0 - sig))
        tl.store(DH + h_offsets, dgate.to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + h_offsets + N, (da * silu).to(DH.dtype.element_ty), mask=mask)
    else:
        _, derivative = _activation_and_derivative(z, ACTIVATION)
        tl.store(DH + h_offsets, (da * derivative).to(DH.dtype.element_ty), mask=mask)


def _grid(M: int, N: int) -> tuple[tuple[int, int], int, int]:
    """2-D tiles of at most 4096 elements, wide along the contiguous columns."""
    block_n = min(1024, max(DECISIONS_PER_CALL, triton.next_power_of_2(N)))
    block_m = max(1, 4096 // block_n)
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n


def _out_features(h: torch.Tensor, activation: str) -> int:
    return h.shape[1] // 2 if activation == "swiglu" else h.shape[1]


def _activation_fwd(h, seed, activation, dropout_p):
    """(M, K) -> (M, N): dropout(act(h)) with the Triton kernel."""
    M, N = h.shape[0], _out_features(h, activation)
    out = torch.empty((M, N), dtype=h.dtype, device=h.device)
    if out.numel():
        grid, block_m, block_n = _grid(M, N)
        _activation_fwd_kernel[grid](
            h, out, seed, M, N, dropout_p,
            ACTIVATION=_ACTIVATION_IDS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return out


def _activation_bwd(da, h, seed, activation, dropout_p):
    """Gradient of h (M, K) from that of the dropped activation (M, N)."""
    M, N = da.shape
    dh = torch.empty_like(h)
    if dh.numel():
        grid, block_m, block_n = _grid(M, N)
        _activation_bwd_kernel[grid](
            da, h, dh, seed, M, N, dropout_p,
            ACTIVATION=_ACTIVATION_IDS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return dh


def _activation_reference(z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(z), act'(z) in fp32 for the single-input activations (the kernel's formulas)."""
    if activation == "relu":
        return z.clamp_min(0.0), (z > 0).to(z.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT_2))
        return z * cdf, cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_CUBIC * z**3))
    derivative = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_CUBIC * z * z)
    return 0.5 * z * (1 + t), derivative


def _halves(h: torch.Tensor, activation: str):
    """(gate, up) for swiglu, else (h, None), in fp32."""
    if activation == "swiglu":
        gate, up = rearrange(h.float(), "m (two n) -> two m n", two=2)
        return gate, up
    return h.float(), None


def _dropout_reference(shape, seed, dropout_p, device):
    M, N = shape
    keep = dropout_keep_block(seed, torch.arange(M, device=device), 0, N, N, dropout_p)
    return keep * torch.tensor(dropout_threshold(dropout_p)[1], dtype=torch.float32, device=device)


def _activation_fwd_reference(h, seed, activation, dropout_p):
    """PyTorch statement of ``_activation_fwd``."""
    z, up = _halves(h, activation)
    a = torch.nn.functional.silu(z) * up if activation == "swiglu" else _activation_reference(z, activation)[0]
    if seed is not None:
        a = a * _dropout_reference(a.shape, seed, dropout_p, h.device)
    return a.to(h.dtype)


def _activation_bwd_reference(da, h, seed, activation, dropout_p):
    """PyTorch statement of ``_activation_bwd``."""
    da = da.float()
    if seed is not None:
        da = da * _dropout_reference(da.shape, seed, dropout_p, da.device)
    z, up = _halves(h, activation)
    if activation == "swiglu":
        sig = torch.sigmoid(z)
        dh = torch.cat([da * up * sig * (1 + z * (1 - sig)), da * z * sig], dim=1)
    else:
        dh = da * _activation_reference(z, activation)[1]
    return dh.to(h.dtype)


def _activation(h, seed, activation, dropout_p):
    fwd = _activation_fwd if use_triton(h) else _activation_fwd_reference
    return fwd(h, seed, activation, dropout_p)


def _activation_grad(da, h, seed, activation, dropout_p):
    bwd = _activation_bwd if use_triton(da) else _activation_bwd_reference
    return bwd(da.contiguous(), h, seed, activation, dropout_p)


class _FusedMLPFunction(torch.autograd.Function):
    """fc2(dropout(act(fc1(x)))) on (M, D) rows, keeping h (or nothing) for backward."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, seed, activation, dropout_p, recompute_fc1):
        h = torch.nn.functional.linear(x, w1, b1)
        a = _activation(h, seed, activation, dropout_p)
        out = torch.nn.functional.linear(a, w2, b2)
        ctx.save_for_backward(x, w1, b1, w2, seed, None if recompute_fc1 else h)
        ctx.config = (activation, dropout_p, b2 is not None)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, b1, w2, seed, h = ctx.saved_tensors
        activation, dropout_p, has_b2 = ctx.config
        dout = dout.contiguous()
        if h is None:
            h = torch.nn.functional.linear(x, w1, b1)
        a = _activation(h, seed, activation, dropout_p)
        dw2 = dout.t() @ a
        del a
        dh = _activation_grad(dout @ w2, h, seed, activation, dropout_p)
        dx = dh @ w1
        dw1 = dh.t() @ x
        db1 = None if b1 is None else dh.sum(0, dtype=torch.float32).to(b1.dtype)
        db2 = dout.sum(0, dtype=torch.float32).to(dout.dtype) if has_b2 else None
        return dx, dw1, db1, dw2, db2, None, None, None, None


def _check_linear(name: str, weight: torch.Tensor, bias, in_features: int, x: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != in_features:
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name}_weight must have shape (out_features, {in_features}), got {shape}")
    for tensor, label in ((weight, f"{name}_weight"), (bias, f"{name}_bias")):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{label} must be on the input's device {x.device}, got {tensor.device}")
        if tensor.dtype != x.dtype:
            raise TypeError(f"{label} dtype must match input dtype {x.dtype}, got {tensor.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}_bias must have shape ({weight.shape[0]},), got {list(bias.shape)}")


def _autocast_inputs(x, tensors):
    """Cast like the Linear layers autocast would (a no-op outside autocast)."""
    if not torch.is_autocast_enabled(x.device.type):
        return x, tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    cast = [None if t is None else t.to(dtype) for t in tensors]
    return x.to(dtype), cast


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

    x: (..., D) float32/float16/bfloat16. fc1_weight: (F, D), or (2F, D) for "swiglu"
    ([gate | up] rows); fc1_bias: its rows or None. fc2_weight: (D_out, F); fc2_bias:
    (D_out,) or None. activation: "relu", "gelu", "gelu_tanh" or "swiglu". dropout_p in
    [0, 1) (pass 0 in eval), masks regenerated from a Philox seed drawn from torch's
    generator. recompute_fc1: keep nothing but x; backward recomputes fc1.
    Returns (..., D_out) in x's dtype (the autocast dtype under autocast, like nn.Linear).
    Raises ValueError/TypeError naming the argument on bad shapes, dtypes or devices.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32, float16 or bfloat16 torch.Tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., D_in), got a 0-d tensor")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    x, (fc1_weight, fc1_bias, fc2_weight, fc2_bias) = _autocast_inputs(x, (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    _check_linear("fc1", fc1_weight, fc1_bias, x.shape[-1], x)
    hidden = fc1_weight.shape[0] // 2 if activation == "swiglu" else fc1_weight.shape[0]
    if activation == "swiglu" and fc1_weight.shape[0] % 2:
        raise ValueError(f"fc1_weight for swiglu needs an even number of rows [gate | up], got {fc1_weight.shape[0]}")
    _check_linear("fc2", fc2_weight, fc2_bias, hidden, x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    seed = new_dropout_seed(x.device) if dropout_p > 0 else None
    with torch.autocast(x.device.type, enabled=False):
        out = _FusedMLPFunction.apply(
            rows, fc1_weight, fc1_bias, fc2_weight, fc2_bias, seed, activation, float(dropout_p), recompute_fc1
        )
    return out.view(*x.shape[:-1], fc2_weight.shape[0])
