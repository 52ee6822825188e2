"""GEMMs for inference: fp16/bf16 with a fused epilogue, W8A8 and W8A16 (int8 weights).

Every GEMM computes ``y = act(x @ Wᵀ + b)`` for x (M, K) and an nn.Linear weight W
(N, K), with an fp32 (or int32) accumulator and the epilogue (scales, bias, GELU or
ReLU) applied to the accumulator before the one rounding to the output dtype.

INT8 is symmetric. A weight row n is stored as ``Wq[n] = round(W[n] / s_w[n])`` with
``s_w[n] = max|W[n]| / 127`` rounded up to a bfloat16 value; an activation row m is quantized on the fly the same way
(per token, ``s_x[m] = max|x[m]| / 127``; an all-zero row gets scale 1). Then

    W8A8:  y[m, n] = (Σ_k xq[m, k] wq[n, k]) · s_x[m] · s_w[n] + b[n]   (int32 sum)
    W8A16: y[m, n] = (Σ_k x[m, k] wq[n, k]) · s_w[n] + b[n]              (fp32 sum)

so the scales leave the K loop, and W8A16 reads one byte per weight (its speed at small
M, where the GEMM is bound by reading W). ``round`` is one IEEE division then rounding
half to even (``torch.round``): the kernel and the reference compute the same two
roundings, so they agree bit for bit (a product ``x · (127 / max)`` followed by ``+ 0.5``
would let the compiler fuse an fma and round differently from the reference). Before
quantization, x may be multiplied per channel by ``smooth`` (SmoothQuant: the
activation's outliers moved into the weights, which were multiplied by 1 / smooth).

On CPU (outside the interpreter) W8A8 runs the references' arithmetic in two compiled
loops around an exact int8 GEMM (oneDNN's where the CPU has VNNI or AMX, else
``int8_cpu.int8_mm``; the quantization in one pass, the epilogue in one pass), bit for
bit; the references run where it cannot be built. Under torch.compile the loops are the
``slimformer::cpu_int8_*`` ops.

W8A16 on a CPU with VNNI or AMX is the same op rounded differently, since no float GEMM
there beats the int8 one: each activation row becomes 16-bit fixed point, ``v = round(x / s)`` with
``s = max|x[m]| / 32639`` (|v| <= 32639; the IEEE division, rounded half to even), split
into two int8 rows ``v = 256·hi + lo`` (hi in [-127, 127], lo in [-128, 127]); both go
through one int8 GEMM (``int8_cpu.int8_mm`` on 2M rows) and the epilogue computes, in fp32,

    y[m, n] = fma((256·acc_hi[m, n] + acc_lo[m, n]) · s[m], s_w[n], b[n])

(the int32 sums converted to fp32 first: 256·acc_hi alone could pass int32 at K = 1536).
The activation so keeps 15 bits of its row's max (error at most s / 2 = max|x[m]| / 65278
per element), finer than the fp16/bf16 activations of the GPU kernel; an fp32 input's
values below that step are lost, where fp32 sgemm keeps them. A row with NaN or infinity
gives a NaN row. On other CPUs (int8 no faster than fp32 there), past
``MAX_SPLIT_IN_FEATURES`` (int32 overflow of the sums), and in the interpreter (which runs
the GPU kernel), W8A16 sums x · wq in fp32 as above.

These are inference ops: nothing is saved for backward, and backward raises.
"""

import math
import os
import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slimformer.kernels import int8_cpu
from slimformer.kernels.dispatch import cdiv, next_power_of_2, use_triton

ACTIVATIONS = (None, "gelu", "relu")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The int32 accumulator holds any sum of 127·127 products over at most this many terms.
MAX_INT8_IN_FEATURES = (2**31 - 1) // 127**2
# Rows of ``quantize_per_token``'s program read at most this many elements per step.
_QUANTIZE_BLOCK_ELEMENTS = 4096
# Rows whose max |x| is below this quantize as zero rows (scale 1): 127 / absmax would
# overflow fp32 near the subnormals, and such rows are zero to any output's precision.
MIN_ROW_ABSMAX = 2.0**-100
_MIN_ROW_ABSMAX = tl.constexpr(MIN_ROW_ABSMAX)
_C127 = torch.tensor([127.0])


# Adding then subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to an integer,
# halves to even (the fp32 spacing there is 1): torch.round in plain arithmetic, which the
# interpreter runs too (libdevice's rint is compiled-only).
_ROUNDING_SHIFT = tl.constexpr(12582912.0)


@triton.jit
def _round_half_even(x):
    """Round fp32 |x| < 2^22 to the nearest integer, halves to even (as ``torch.round``)."""
    return (x + _ROUNDING_SHIFT) - _ROUNDING_SHIFT


@triton.jit
def _load_row_block(X, SMOOTH, row_starts, row_ok, ks, K):
    """fp32 (BLOCK_M, BLOCK_K) block of X (times SMOOTH), zero outside the matrix."""
    mask = row_ok[:, None] & (ks < K)[None, :]
    x = tl.load(X + row_starts + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if SMOOTH is not None:
        x *= tl.load(SMOOTH + ks, mask=ks < K, other=0.0)[None, :]
    return x


@triton.jit
def _row_scale(absmax):
    """max|row| / 127 by IEEE division, or 1 for a row below MIN_ROW_ABSMAX."""
    nonzero = absmax >= _MIN_ROW_ABSMAX
    return tl.where(nonzero, tl.math.div_rn(absmax, 127.0), 1.0)


@triton.jit
def _quantize_to_int8(x, scale):
    # div_rn: the reference's IEEE division, not a reciprocal multiply.
    return _round_half_even(tl.math.div_rn(x, scale[:, None])).to(tl.int8)


@triton.jit
def _quantize_rows_kernel(
    X,  # (M, K) float activations
    SMOOTH,  # (K,) fp32 per-channel multipliers, or None
    Q,  # (M, K) int8 output
    SCALE,  # (M,) fp32 output: max|row| / 127, or 1 for an all-zero row
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # BLOCK_K >= K: each row is read once and quantized from registers
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    row_starts = rows[:, None].to(tl.int64) * K
    ks = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:
        x = _load_row_block(X, SMOOTH, row_starts, row_ok, ks, K)
        scale = _row_scale(tl.max(tl.abs(x), axis=1))
        tl.store(Q + row_starts + ks[None, :], _quantize_to_int8(x, scale), mask=row_ok[:, None] & (ks < K)[None, :])
    else:
        absmax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _load_row_block(X, SMOOTH, row_starts, row_ok, k0 + ks, K)
            absmax = tl.maximum(absmax, tl.max(tl.abs(x), axis=1))
        scale = _row_scale(absmax)
        for k0 in range(0, K, BLOCK_K):
            x = _load_row_block(X, SMOOTH, row_starts, row_ok, k0 + ks, K)
            mask = row_ok[:, None] & (k0 + ks < K)[None, :]
            tl.store(Q + row_starts + (k0 + ks)[None, :], _quantize_to_int8(x, scale), mask=mask)
    tl.store(SCALE + rows, scale, mask=row_ok)


@triton.jit
def _gemm_kernel(
    X,  # (M, K) activations: float, or int8 when X_SCALE is given
    W,  # (N, K) weight (nn.Linear layout): X's dtype, or int8 when W_SCALE is given
    X_SCALE,  # (M,) fp32 per-token scales of an int8 X (W8A8), or None
    W_SCALE,  # (N,) fp32 per-output-channel scales of an int8 W, or None
    BIAS,  # (N,) bias in any float dtype, or None
    Y,  # (M, N) output
    M,
    N,
    K,
    M_BUCKET,  # M rounded up to a power of two: unused by the kernel, the autotuning key
    ACTIVATION: tl.constexpr,  # "none", "gelu" or "relu"
    UPCAST: tl.constexpr,  # multiply 16-bit blocks as fp32 (bf16 under the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Programs walk the output tiles in column bands GROUP_M tiles tall, so the tiles
    # running at once share rows of X and columns of W in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = X + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_ptrs = W + cols[None, :].to(tl.int64) * K + ks[:, None]  # (BLOCK_K, BLOCK_N) tile of Wᵀ

    if X_SCALE is not None:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        if X_SCALE is not None:
            acc = tl.dot(x, w, acc, out_dtype=tl.int32)
        else:
            if UPCAST:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
            else:
                if W_SCALE is not None:
                    # int8 values are exact in fp16/bf16; the scale is applied after the sum.
                    w = w.to(X.dtype.element_ty)
                if X.dtype.element_ty == tl.float32:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out = acc.to(tl.float32)
    if X_SCALE is not None:
        out = out * tl.load(X_SCALE + rows, mask=row_ok, other=0.0)[:, None]
    if W_SCALE is not None:
        out = out * tl.load(W_SCALE + cols, mask=col_ok, other=0.0)[None, :]
    if BIAS is not None:
        out += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
    elif ACTIVATION == "relu":
        out = tl.maximum(out, 0.0)
    y_ptrs = Y + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _config(block_m, block_n, block_k, num_warps, num_stages):
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
        num_warps=num_warps,
        num_stages=num_stages,
    )


# Candidates per GEMM kind for Hopper, tuned per (M bucket, N, K, dtypes); the first
# run of each key benchmarks those that ``_prune_configs`` keeps. int8 blocks take
# K steps of >= 32 (the int8 MMA's depth); W8A16 favours narrow N tiles at small M
# so that enough programs stream the weight. fp32 ("ieee" precision) multiplies on the
# FMA units with operands in registers, so it has smaller tiles and K steps than the
# 16-bit kinds; no tile is 128x256, whose GELU epilogue outgrows a thread's 255 registers.
# Every config here compiles without spills (bench/results/compile-sm90.md).
GPU_CONFIGS = {
    "float32": [
        _config(128, 64, 32, 8, 3),
        _config(64, 128, 32, 8, 3),
        _config(64, 64, 32, 4, 3),
        _config(32, 64, 32, 4, 3),
        _config(16, 64, 128, 4, 4),
    ],
    "float": [
        _config(128, 128, 64, 8, 4),
        _config(64, 128, 64, 4, 4),
        _config(32, 64, 128, 4, 4),
        _config(16, 64, 128, 4, 4),
    ],
    "w8a8": [
        _config(128, 128, 128, 8, 4),
        _config(64, 128, 128, 4, 4),
        _config(32, 64, 128, 4, 4),
        _config(16, 64, 256, 4, 4),
    ],
    "w8a16": [
        _config(128, 128, 64, 8, 4),
        _config(64, 128, 64, 4, 4),
        _config(32, 64, 128, 4, 4),
        _config(16, 128, 128, 4, 4),
        _config(16, 64, 256, 4, 4),
        _config(16, 32, 256, 4, 4),
    ],
}
# The interpreter cannot autotune; small blocks keep its (serial) programs cheap.
INTERPRETER_CONFIG = _config(16, 32, 32, 4, 1)


# When K is not a multiple of 16 the JIT cannot prove 16-byte rows, so X and W tiles are
# loaded element by element, each with its own address registers: only tiles of at most
# 2048 outputs fit without spilling (bench/results/compile-sm90.md). fp32 keeps its list:
# its register pressure comes from the K depth, not the addresses.
_UNALIGNED_K_MAX_TILE = 32 * 64


def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles taller than M's bucket, and short tiles once M is large (with 16-byte
    aligned rows; with unaligned rows, the tiles that would spill)."""
    bucket = named_args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= bucket]
    if named_args["K"] % 16 and named_args["X"].dtype != torch.float32:
        return [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= _UNALIGNED_K_MAX_TILE]
    return [c for c in kept if bucket < 1024 or c.kwargs["BLOCK_M"] >= 64]


def _tuned_gemm(kind: str):
    # Read when the module loads, like triton.jit itself: a kernel decorated while
    # interpreting is interpreted for the life of the process.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return triton.autotune(
        configs=[INTERPRETER_CONFIG] if interpreting else GPU_CONFIGS[kind],
        key=["M_BUCKET", "N", "K"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_gemm_kernel)


_TUNED_GEMMS = {kind: _tuned_gemm(kind) for kind in GPU_CONFIGS}


def _m_bucket(m: int) -> int:
    return min(max(16, next_power_of_2(m)), 8192)


def _gemm(x, weight, x_scale, w_scale, bias, activation, out_dtype):
    """Launch ``_gemm_kernel`` on contiguous x (M, K) and weight (N, K). Returns y (M, N)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if x_scale is not None:
        kind = "w8a8"
    elif w_scale is not None:
        kind = "w8a16"
    else:
        kind = "float32" if x.dtype == torch.float32 else "float"

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    _TUNED_GEMMS[kind][grid](
        x,
        weight,
        x_scale,
        w_scale,
        bias,
        y,
        M,
        N,
        K,
        _m_bucket(M),
        ACTIVATION=activation or "none",
        UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda,
    )
    return y


def _quantize_block(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_K columns, num_warps) for ``_quantize_rows_kernel``."""
    block_k = min(next_power_of_2(max(n_cols, 1)), _QUANTIZE_BLOCK_ELEMENTS)
    block_m = max(1, min(16, _QUANTIZE_BLOCK_ELEMENTS // block_k))
    return block_m, block_k, 4 if block_m * block_k <= 1024 else 8


def _quantize_rows(x, smooth):
    """Launch ``_quantize_rows_kernel`` on contiguous x (M, K). Returns (q (M, K) int8, scale (M,) fp32)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    block_m, block_k, num_warps = _quantize_block(K)
    _quantize_rows_kernel[(cdiv(M, block_m),)](
        x,
        smooth,
        q,
        scale,
        M,
        K,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        ONE_BLOCK=block_k >= K,
        num_warps=num_warps,
    )
    return q, scale


def _quantize_rows_reference(x, smooth):
    """PyTorch statement of ``_quantize_rows`` (bit-exact: the same fp32 operations).

    Few whole-tensor passes, since each reads and writes all of x: max, min, then ``x / scale + 1.5·2^23`` (the division, then the add that rounds half to
    even, as the kernel's ``_round_half_even``), whose bits are 0x4B400000 + n for the
    rounded integer n: their low byte is n in two's complement, and the int32 -> int8
    conversion keeps exactly that byte. No clamp is needed: |x| / (max / 127) rounds to
    at most 127.
    """
    x = x.float()
    if smooth is not None:
        x = x * smooth
    scale = _row_scales_reference(x)
    return _quantize_with_scales(x, scale), scale


def _row_scales_reference(x: torch.Tensor) -> torch.Tensor:
    """max|row| / 127 of fp32 x (M, K), 1 for rows below ``MIN_ROW_ABSMAX``: (M,) fp32."""
    if x.shape[1]:
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
    else:
        absmax = x.new_zeros(x.shape[0])
    # A tensor divisor: torch divides by a Python scalar as a multiplication by its
    # reciprocal (two roundings) in some kernels; the Triton kernel divides exactly.
    return torch.where(absmax >= MIN_ROW_ABSMAX, absmax / _C127.to(absmax.device), 1.0)


def _quantize_with_scales(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale[:, None]) of fp32 x (M, K) as int8, for scales >= max|row| / 127."""
    shifted = torch.div(x, scale[:, None]).add_(_ROUNDING_SHIFT.value)
    return shifted.view(torch.int32).to(torch.int8)


def _round_up_to_bfloat16(t: torch.Tensor) -> torch.Tensor:
    """The least bfloat16 value >= each positive finite fp32 element, as fp32: adding
    2^16 - 1 to the bits carries into the 16 bits bfloat16 keeps unless the low ones are zero."""
    return ((t.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)


def _int_mm_supports(m: int, k: int, n: int, device: torch.device) -> bool:
    """Whether ``torch._int_mm`` accepts (m, k) @ (k, n) on ``device`` (CUDA: cuBLASLt's limits)."""
    if device.type == "cpu":
        return True
    return m > 16 and k > 0 and k % 8 == 0 and n % 8 == 0


def _gemm_reference(x, weight, x_scale, w_scale, bias, activation, out_dtype):
    """PyTorch statement of ``_gemm``: the same accumulator and epilogue, one final rounding.

    W8A8 sums exactly in int32 with ``int8_cpu.int8_mm`` where ``torch._int_mm`` applies (on a
    VNNI CPU oneDNN's int8 GEMM; without VNNI sgemm over exact slices of K), else in float64
    (exact for any K below 2^39); the float GEMMs and W8A16 sum in fp32. The epilogue runs
    in place: each extra whole-tensor op would be another pass over the (M, N) output.
    """
    M, K = x.shape
    N = weight.shape[0]
    if x_scale is not None:
        if _int_mm_supports(M, K, N, x.device):
            # For torch.compile: with sizes traced as symbols, _int_mm's shape check needs the
            # contraction dimensions known equal.
            torch._check(weight.shape[1] == K)
            acc = int8_cpu.int8_mm(x, weight.t())
            # int32 -> fp32 in the accumulator's own memory (same element size, each element
            # read before it is written): a fresh (M, N) buffer costs its page faults too.
            out = acc.view(torch.float32).copy_(acc)
        else:
            out = (x.double() @ weight.double().t()).float()
        out.mul_(x_scale[:, None])
    elif w_scale is None:
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    else:
        out = F.linear(x.float(), weight.float())
    if w_scale is not None:
        out = out.mul_(w_scale) if bias is None else torch.addcmul(bias.float(), out, w_scale, out=out)
    return _activate(out, activation).to(out_dtype)


def _activate(out, activation):
    """The epilogue's activation on the fp32 ``out`` (in place where torch has one)."""
    if activation == "gelu":
        return F.gelu(out)
    return out.relu_() if activation == "relu" else out


def _fused_cpu_int8(t: torch.Tensor):
    """The compiled CPU int8 loops (``int8_cpu``) where ``t``'s op runs the PyTorch path
    (where ``use_triton(t)`` is False on a CPU tensor), or None: on other devices (or a
    CPU tensor emulating CUDA for the compile report) or without a compiler. While
    torch.compile traces, the ``slimformer::cpu_int8_*`` ops that call them (it cannot
    trace into ctypes; the ops run them, or the same bits in PyTorch). The cheap tests come
    first: each Linear calls this twice, on a small Linear's critical path."""
    if t.is_cuda or not t.is_cpu or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if torch.compiler.is_compiling():
        return _CompiledCpuInt8
    return int8_cpu.extension()


@torch.library.custom_op("slimformer::cpu_int8_quantize_rows", mutates_args=())
def _cpu_quantize_rows_op(x: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    fused = int8_cpu.extension()
    if fused is None:
        return _quantize_rows_reference(x, smooth)
    return fused.quantize_rows(x, smooth, MIN_ROW_ABSMAX)


@_cpu_quantize_rows_op.register_fake
def _(x, smooth):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0])


@torch.library.custom_op("slimformer::cpu_int8_gemm", mutates_args=())
def _cpu_int8_gemm_op(
    q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    fused = int8_cpu.extension()
    if fused is None:
        return _gemm_reference(q, weight, x_scale, w_scale, bias, None, torch.float32)
    return fused.int8_gemm(q, weight, x_scale, w_scale, bias)


@_cpu_int8_gemm_op.register_fake
def _(q, weight, x_scale, w_scale, bias):
    return q.new_empty(q.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("slimformer::cpu_int8_weight_only", mutates_args=())
def _cpu_weight_only_op(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _weight_only_cpu(x, weight, w_scale, bias, int8_cpu.extension())


@_cpu_weight_only_op.register_fake
def _(x, weight, w_scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


class _CompiledCpuInt8:
    """``int8_cpu``'s loops as torch.compile sees them: ops it calls, opaque to it."""

    @staticmethod
    def quantize_rows(x, smooth, min_absmax):
        return torch.ops.slimformer.cpu_int8_quantize_rows(x, smooth)

    @staticmethod
    def int8_gemm(q, weight, x_scale, w_scale, bias):
        return torch.ops.slimformer.cpu_int8_gemm(q, weight, x_scale, w_scale, bias)


# The activation's 16-bit fixed point on CPU W8A16: |v| = |round(x / s)| <= 32639 splits
# into hi in [-127, 127] and lo in [-128, 127], so the int32 sums hold |lo · w| <= 128 · 127
# over at most this many terms (beyond it, W8A16 runs the fp32 GEMM).
_SPLIT_LEVELS = 32639
MAX_SPLIT_IN_FEATURES = (2**31 - 1) // (128 * 127)
_C_SPLIT = torch.tensor([float(_SPLIT_LEVELS)])
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _quantize_rows_split_reference(x):
    """PyTorch statement of ``int8_cpu``'s ``quantize_rows_split`` (the same bits).

    Per row of fp32 x (M, K): ``s = max|x| / 32639`` (1 below ``MIN_ROW_ABSMAX``, NaN for a
    row with NaN or infinity), ``v = round(x / s)`` (the IEEE division, then the add of
    1.5·2^23 that rounds half to even; v is the bits minus 0x4B400000), zero for a NaN-scale
    row, and ``v = 256·hi + lo`` with ``hi = (v + 128) >> 8`` in [-127, 127] and ``lo`` the low
    byte, in [-128, 127]. Returns (q (2M, K) int8: the hi rows, then the lo rows; s (M,) fp32).
    """
    if x.shape[1]:
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
    else:
        absmax = x.new_zeros(x.shape[0])
    finite = absmax <= _FLOAT32_MAX  # False for NaN and infinity
    scale = torch.where(absmax >= MIN_ROW_ABSMAX, absmax / _C_SPLIT.to(absmax.device), 1.0)
    scale = torch.where(finite, scale, float("nan"))
    shifted = torch.div(x, scale[:, None]).add_(_ROUNDING_SHIFT.value)
    v = shifted.view(torch.int32).sub_(0x4B400000).mul_(finite[:, None])
    hi = v.add(128).bitwise_right_shift_(8).to(torch.int8)
    return torch.cat([hi, v.to(torch.int8)]), scale


def _split_gemm_reference(q, weight, x_scale, w_scale, bias):
    """PyTorch statement of ``int8_cpu``'s ``split_gemm``: ``acc = q @ weightᵀ`` in int32 (2M, N),
    ``t = 256·fp32(acc[:M]) + fp32(acc[M:])`` (the product exact, one rounding), then the W8A8
    epilogue ``fma(t · x_scale, w_scale, bias)``."""
    M = q.shape[0] // 2
    torch._check(weight.shape[1] == q.shape[1])
    acc = int8_cpu.int8_mm(q, weight.t())
    out = acc[M:].float().add_(acc[:M].float(), alpha=256.0)
    out.mul_(x_scale[:, None])
    return out.mul_(w_scale) if bias is None else torch.addcmul(bias.float(), out, w_scale, out=out)


def _weight_only_cpu(x, weight, w_scale, bias, fused):
    """CPU W8A16 on fp32 x (M, K) -> fp32 (M, N). Where int8 GEMMs are fast here
    (``int8_cpu.int8_gemm_is_fast``) and K <= MAX_SPLIT_IN_FEATURES: x's rows as 16-bit fixed
    point (``_quantize_rows_split_reference``), both halves in one int8 GEMM, on the compiled
    path a view of the first M rows of the (2M, N) accumulator (a fresh buffer costs its page
    faults); else the fp32 GEMM on the weight's integers. ``fused``: the compiled loops, or
    None for the PyTorch statement of either."""
    bias = bias if bias is None or bias.dtype == torch.float32 else bias.float()
    M, K = x.shape
    if 0 < K <= MAX_SPLIT_IN_FEATURES and 0 not in (M, weight.shape[0]) and int8_cpu.int8_gemm_is_fast():
        if fused is not None:
            q, scale = fused.quantize_rows_split(x, MIN_ROW_ABSMAX)
            return fused.split_gemm(q, weight, scale, w_scale, bias)
        q, scale = _quantize_rows_split_reference(x)
        return _split_gemm_reference(q, weight, scale, w_scale, bias)
    if fused is not None:
        return fused.weight_only_gemm(x, weight, w_scale, bias)
    return _gemm_reference(x, weight, None, w_scale, bias, None, torch.float32)


def _run_gemm(x, weight, x_scale, w_scale, bias, activation, out_dtype):
    if x_scale is None and w_scale is not None and x.is_cpu and not x.is_cuda and not use_triton(x):
        fused = _fused_cpu_int8(x)
        if fused is _CompiledCpuInt8:
            out = torch.ops.slimformer.cpu_int8_weight_only(x.float(), weight, w_scale, bias)
        else:
            out = _weight_only_cpu(x.float(), weight, w_scale, bias, fused)
        return out if activation is None and out_dtype == torch.float32 else _activate(out, activation).to(out_dtype)
    fused = None if x_scale is None else _fused_cpu_int8(x)
    if fused is not None:
        bias = bias if bias is None or bias.dtype == torch.float32 else bias.float()
        out = fused.int8_gemm(x, weight, x_scale, w_scale, bias)
        return out if activation is None and out_dtype == torch.float32 else _activate(out, activation).to(out_dtype)
    if use_triton(x):
        return _gemm(x, weight, x_scale, w_scale, bias, activation, out_dtype)
    return _gemm_reference(x, weight, x_scale, w_scale, bias, activation, out_dtype)


def _run_quantize_rows(x, smooth):
    fused = _fused_cpu_int8(x)
    if fused is not None:
        q, scale = fused.quantize_rows(x if x.dtype == torch.float32 else x.float(), smooth, MIN_ROW_ABSMAX)
        return q, scale  # a tuple, as the other two paths return
    return (_quantize_rows if use_triton(x) else _quantize_rows_reference)(x, smooth)


def _inference(op_name, compute, *tensors):
    """``compute`` on contiguous ``tensors``; through ``_InferenceOnly`` only when autograd
    records (its Python overhead is not free beside a small Linear on CPU)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _InferenceOnly.apply(op_name, compute, *tensors)
    return compute(*(None if t is None else t.contiguous() for t in tensors))


def _dynamic_int8_gemm(x, weight, w_scale, bias, smooth, activation):
    q, x_scale = _run_quantize_rows(x, smooth)
    return _run_gemm(q, weight, x_scale, w_scale, bias, activation, x.dtype)


class _InferenceOnly(torch.autograd.Function):
    """Runs ``compute`` on contiguous copies of ``tensors`` (None stays None); backward
    raises, since these GEMMs keep nothing for it."""

    @staticmethod
    def forward(ctx, op_name, compute, *tensors):
        ctx.op_name = op_name
        return compute(*(None if t is None else t.contiguous() for t in tensors))

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"{ctx.op_name} is an inference-only op and has no backward: train the float model "
            "(torch.nn.Linear) and quantize it afterwards"
        )


def _check_tensor(name, tensor, dtypes, dim=None, shape=None, device=None):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise TypeError(f"{name} must be {expected}, got {tensor.dtype}")
    if dim is not None and tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {list(tensor.shape)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on the input's device {device}, got {tensor.device}")


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_input(input, dtypes):
    _check_tensor("input", input, dtypes)
    if input.dim() == 0:
        raise ValueError("input must have at least 1 dimension (..., in_features), got a scalar")


def _check_weight_and_bias(input, weight, weight_dtypes, bias):
    _check_tensor("weight", weight, weight_dtypes, dim=2, device=input.device)
    if weight.shape[1] != input.shape[-1]:
        raise ValueError(
            f"weight must have shape [out_features, {input.shape[-1]}] (input's last dimension), "
            f"got {list(weight.shape)}"
        )
    if bias is not None:
        _check_tensor("bias", bias, FLOAT_DTYPES, shape=(weight.shape[0],), device=input.device)


def _check_int32_depth(in_features: int) -> None:
    if in_features > MAX_INT8_IN_FEATURES:
        raise ValueError(f"W8A8 sums at most {MAX_INT8_IN_FEATURES} in_features in int32, got {in_features}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous (..., K) -> (M, K)."""
    return t.view(math.prod(t.shape[:-1]), t.shape[-1])


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str | None = None
) -> torch.Tensor:
    """``act(input @ weight.T + bias)`` in one kernel, accumulated in fp32.

    input: (..., K) float16, bfloat16 or float32. weight: (N, K), input's dtype.
    bias: (N,) any float dtype, or None. activation: None, "gelu" (exact, erf) or "relu".
    Returns (..., N) in input's dtype. Inference only: backward raises RuntimeError.
    Raises TypeError/ValueError naming the argument on bad dtypes, shapes or devices.
    """
    _check_input(input, FLOAT_DTYPES)
    _check_weight_and_bias(input, weight, (input.dtype,), bias)
    _check_activation(activation)

    def compute(x, w, b):
        return _run_gemm(_rows(x), w, None, None, b, activation, x.dtype)

    y = _inference("slimformer linear", compute, input, weight, bias)
    return y.view(*input.shape[:-1], weight.shape[0])


def quantize_per_token(input: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 quantization: ``q = round(input * smooth / scale)``.

    input: (..., K) float16, bfloat16 or float32. smooth: (K,) float32 per-channel
    multipliers (SmoothQuant), or None. Returns q (..., K) int8 in [-127, 127] and
    scale (...) float32 = max|row| / 127 (1 for an all-zero row), so row ≈ q * scale.
    Not differentiable (the result is an integer tensor).
    """
    _check_input(input, FLOAT_DTYPES)
    if smooth is not None:
        _check_tensor("smooth", smooth, (torch.float32,), shape=(input.shape[-1],), device=input.device)
    smooth = None if smooth is None else smooth.contiguous()
    with torch.no_grad():
        q, scale = _run_quantize_rows(_rows(input.contiguous()), smooth)
    return q.view(input.shape), scale.view(input.shape[:-1])


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each output row of an nn.Linear weight.

    weight: (N, K) float16, bfloat16 or float32, all finite. Returns q (N, K) int8 in
    [-127, 127] and scale (N,) float32 = max|row| / 127 rounded up to the next bfloat16
    value (1 for an all-zero row): the step grows by less than 2^-7 of itself, and the
    scales take two bytes each on disk without loss (``Linear8bit``'s state_dict).
    Raises ValueError when weight has a NaN or infinity.
    """
    _check_tensor("weight", weight, FLOAT_DTYPES, dim=2)
    with torch.no_grad():
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("weight must be finite to quantize, got NaN or infinity")
        weight = weight.float()
        scale = _round_up_to_bfloat16(_row_scales_reference(weight))
        return _quantize_with_scales(weight, scale), scale


def int8_matmul(
    q_input: torch.Tensor,
    input_scale: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W8A8 GEMM: ``act((q_input @ q_weight.T) * input_scale[:, None] * weight_scale + bias)``.

    q_input: (..., K) int8. input_scale: (...) float32, one per row of q_input.
    q_weight: (N, K) int8. weight_scale: (N,) float32. bias: (N,) any float dtype, or None.
    The product is summed exactly in int32. Returns (..., N) in out_dtype (float16,
    bfloat16 or float32). Inference only: backward raises RuntimeError.
    """
    _check_input(q_input, (torch.int8,))
    _check_tensor("input_scale", input_scale, (torch.float32,), shape=q_input.shape[:-1], device=q_input.device)
    _check_weight_and_bias(q_input, q_weight, (torch.int8,), bias)
    _check_int32_depth(q_weight.shape[1])
    _check_tensor("weight_scale", weight_scale, (torch.float32,), shape=(q_weight.shape[0],), device=q_input.device)
    _check_activation(activation)
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")

    def compute(q, s, w, sw, b):
        return _run_gemm(_rows(q), w, s.view(-1), sw, b, activation, out_dtype)

    y = _inference("slimformer int8_matmul", compute, q_input, input_scale, q_weight, weight_scale, bias)
    return y.view(*q_input.shape[:-1], q_weight.shape[0])


def int8_linear(
    input: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dynamic W8A8 linear: ``quantize_per_token(input, smooth)`` then ``int8_matmul``.

    input: (..., K) float16, bfloat16 or float32. q_weight: (N, K) int8 and
    weight_scale: (N,) float32 from ``quantize_per_channel`` (of the weight times
    1 / smooth when smooth is given). bias: (N,) any float dtype, or None. smooth: (K,)
    float32, or None. Returns (..., N) in input's dtype. Backward raises RuntimeError.
    """
    _check_input(input, FLOAT_DTYPES)
    _check_weight_and_bias(input, q_weight, (torch.int8,), bias)
    _check_int32_depth(q_weight.shape[1])
    _check_tensor("weight_scale", weight_scale, (torch.float32,), shape=(q_weight.shape[0],), device=input.device)
    if smooth is not None:
        _check_tensor("smooth", smooth, (torch.float32,), shape=(input.shape[-1],), device=input.device)
    _check_activation(activation)

    def compute(x, w, sw, b, s):
        return _dynamic_int8_gemm(_rows(x), w, sw, b, s, activation)

    y = _inference("slimformer int8_linear", compute, input, q_weight, weight_scale, bias, smooth)
    return y.view(*input.shape[:-1], q_weight.shape[0])


def int8_linear_unchecked(
    input: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """``int8_linear`` without its argument checks and without autograd, for layers whose
    buffers are valid by construction (``Linear8bit``), called where autograd does not
    record: on CPU the checks and the autograd.Function cost about a tenth of a BERT
    Linear's time. Without ``smooth``, the quantization of ``input`` is shared with the
    next call that gets the same, unmodified tensor (Q, K and V read one input).

    input: (..., K) float32, float16 or bfloat16 on the weights' device. q_weight: (N, K)
    int8 contiguous, K <= MAX_INT8_IN_FEATURES; weight_scale: (N,) float32; bias: (N,) or
    None; smooth: (K,) float32 or None. Returns (..., N) in input's dtype.
    """
    rows = _rows(input.contiguous())
    q, x_scale = _run_quantize_rows(rows, smooth) if smooth is not None else _shared_quantization(input, rows)
    y = _run_gemm(q, q_weight, x_scale, weight_scale, bias, None, input.dtype)
    return y.view(*input.shape[:-1], q_weight.shape[0])


# (weak reference to an input, its version counter, its per-token quantization): the last
# input ``int8_linear_unchecked`` quantized without smooth.
_last_quantized: tuple | None = None


def _shared_quantization(input: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_run_quantize_rows(rows, None)`` for ``rows`` = ``input`` as (M, K), reused while
    ``input`` is the same tensor object with the same version counter (every in-place
    write bumps it; an inference-mode tensor has none, so it is never reused; nor under
    torch.compile)."""
    global _last_quantized
    if torch.compiler.is_compiling() or input.is_inference():
        # torch.compile traces this once: object identity and versions are not guarded.
        return _run_quantize_rows(rows, None)
    last = _last_quantized
    if last is not None and last[0]() is input and last[1] == input._version:
        return last[2]
    quantized = _run_quantize_rows(rows, None)
    _last_quantized = (weakref.ref(input), input._version, quantized)
    return quantized


def int8_weight_only_linear_unchecked(
    input: torch.Tensor, q_weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``int8_weight_only_linear`` without its argument checks and without autograd, for
    ``Linear8bit`` (as ``int8_linear_unchecked``). Same arguments, no activation."""
    y = _run_gemm(_rows(input.contiguous()), q_weight, None, weight_scale, bias, None, input.dtype)
    return y.view(*input.shape[:-1], q_weight.shape[0])


def int8_weight_only_linear(
    input: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """W8A16 linear: ``act((input @ q_weight.T) * weight_scale + bias)``, weights dequantized in the kernel.

    input: (..., K) float16, bfloat16 or float32. q_weight: (N, K) int8 and
    weight_scale: (N,) float32 from ``quantize_per_channel``. bias: (N,) any float
    dtype, or None. On GPU (and in the interpreter) sums input · q_weight in fp32; on
    CPU multiplies the input rounded per row to 16-bit fixed point (step max|row| / 32639)
    exactly in int32, as two int8 halves in one int8 GEMM (module docstring). Returns
    (..., N) in input's dtype. Backward raises.
    """
    _check_input(input, FLOAT_DTYPES)
    _check_weight_and_bias(input, q_weight, (torch.int8,), bias)
    _check_tensor("weight_scale", weight_scale, (torch.float32,), shape=(q_weight.shape[0],), device=input.device)
    _check_activation(activation)

    def compute(x, w, sw, b):
        return _run_gemm(_rows(x), w, None, sw, b, activation, x.dtype)

    y = _inference("slimformer int8_weight_only_linear", compute, input, q_weight, weight_scale, bias)
    return y.view(*input.shape[:-1], q_weight.shape[0])
