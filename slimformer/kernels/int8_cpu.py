"""W8A8 and W8A16 on CPU in fused C loops around an exact int8 GEMM chosen by measuring it.

The PyTorch statement of the CPU path (``matmul._quantize_rows_reference`` and the int8
branch of ``matmul._gemm_reference``) takes about fifteen whole-tensor ops per Linear,
each a dispatch and a pass over memory, which together can cost more than the GEMM at
BERT's sizes. These functions compute exactly the same values in one pass each:

- ``quantize_rows(x, smooth)``: per row, ``absmax = max|x * smooth|`` (NaN if the row
  has one), ``scale = absmax / 127`` (1 below ``MIN_ROW_ABSMAX`` or for NaN), and
  ``q = int8(bits(x * smooth / scale + 1.5·2^23))``: the IEEE division, then the add
  that rounds half to even, whose low byte is the rounded integer.
- ``int8_gemm(q, weight, x_scale, w_scale, bias)``: ``acc = q @ weightᵀ`` exactly (the product
  ``choose_product`` picks: oneDNN's packed int8 GEMM, giving fp32(acc), torch._int_mm or
  sgemm slices, giving int32), then
  ``fma(fp32(acc) * x_scale[m], w_scale[n], bias[n])`` in the accumulator's own
  memory: the reference's ``mul_`` then ``addcmul`` (which fuses its multiply-add);
  ``-ffp-contract=off`` keeps the compiler from fusing anything else.
- ``weight_only_gemm(x, weight, w_scale, bias)``: W8A16 as ``_gemm_reference`` states it,
  ``fma(x @ fp32(weight)ᵀ, w_scale[n], bias[n])``: the weight's integers converted into a
  buffer each thread keeps (the reference's ``weight.float()`` allocates a fresh one per
  call), the same fp32 GEMM, the epilogue in the output's memory.
- ``quantize_rows_split(x, min_absmax)`` and ``split_gemm(q, weight, x_scale, w_scale, bias)``:
  W8A16 as ``matmul._quantize_rows_split_reference`` / ``_split_gemm_reference`` state it
  (the same bits): per row ``s = absmax / 32639`` (1 below ``min_absmax``, NaN for a row
  with NaN or infinity, whose integers are zeros), ``v = round(x / s)`` by the same
  division and add as above, ``v = 256·hi + lo`` stacked as (2M, K) int8 (hi rows, then lo
  rows); then ``acc = q @ weightᵀ`` as in ``int8_gemm`` and
  ``fma((256·fp32(acc_hi) + fp32(acc_lo)) * x_scale[m], w_scale[n], bias[n])`` in the
  first M rows of the accumulator's memory. ``weight_only_gemm`` remains for K past
  ``matmul.MAX_SPLIT_IN_FEATURES``.

Which exact product runs is measured, not read from the CPU's flags: a CPU can have the
instructions while oneDNN runs its reference code for them (``ref_int8`` for qlinear on AMD
Zen 4, 300-900x slower than fp32). ``exact_products`` keeps the candidates that sum exactly
here, ``_screened`` drops those far slower than fp32 on a small problem, once per process,
and ``choose_product`` races the rest once per (K, N, row class). Every candidate gives the
same bits, so the choice changes speed only; W8A16's split runs where ``int8_gemm_is_fast``.

The loops are plain C (``c_loops``: compiled once per machine, called through ctypes).
They run on torch's own OpenMP runtime with ``torch.get_num_threads()`` threads. Allocation,
argument checks and the GEMMs stay in torch. ``Linear8bit.from_float`` builds the library
when it makes a CPU layer, so the time is spent at quantize / load time, not in the first
forward. Without a working C compiler ``extension()`` returns None and the callers run the
PyTorch statement, which gives the same bits, only slower.
"""

import contextlib
import ctypes
import functools
import math
import os
import threading
import time
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from slimformer.kernels import c_loops

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SHIFT 12582912.0f /* 1.5 * 2^23 */
#define LANES 16

/* max |v| over a row, NaN if the row holds a NaN (as torch.amax / torch.amin). */
static float row_absmax(const float* restrict x, const float* restrict smooth, int64_t k) {
  float lane_max[LANES] = {0};
  int lane_nan[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= k; j += LANES) {
    for (int l = 0; l < LANES; ++l) {
      float v = smooth ? x[j + l] * smooth[j + l] : x[j + l];
      float a = fabsf(v);
      lane_max[l] = lane_max[l] < a ? a : lane_max[l];
      lane_nan[l] |= (v != v);
    }
  }
  float absmax = 0.0f;
  int nan = 0;
  for (; j < k; ++j) {
    float v = smooth ? x[j] * smooth[j] : x[j];
    float a = fabsf(v);
    absmax = absmax < a ? a : absmax;
    nan |= (v != v);
  }
  for (int l = 0; l < LANES; ++l) {
    absmax = absmax < lane_max[l] ? lane_max[l] : absmax;
    nan |= lane_nan[l];
  }
  return nan ? NAN : absmax;
}

/* The IEEE quotient plus 1.5 * 2^23: its low mantissa bits are round-half-even(v / s). */
static inline int32_t shifted_bits(float v, float scale) {
  float shifted = v / scale + SHIFT;
  int32_t bits;
  memcpy(&bits, &shifted, sizeof(bits));
  return bits;
}

void quantize_rows(const float* restrict x, const float* restrict smooth, int64_t m, int64_t k, float lowest,
                   int8_t* restrict q, float* restrict scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * k;
    int8_t* qr = q + i * k;
    const float absmax = row_absmax(xr, smooth, k);
    const float s = absmax >= lowest ? absmax / 127.0f : 1.0f;
    scale[i] = s;
    if (smooth) {
      for (int64_t j = 0; j < k; ++j) qr[j] = (int8_t)shifted_bits(xr[j] * smooth[j], s);
    } else {
      for (int64_t j = 0; j < k; ++j) qr[j] = (int8_t)shifted_bits(xr[j], s);
    }
  }
}

/* out[i, j] = fma(fp32(acc[i, j]) * x_scale[i], w_scale[j], bias[j]), over acc's memory:
   ACC int32 (int8_epilogue) or float, already fp32(acc) (int8_epilogue_f32). */
#define INT8_EPILOGUE(NAME, ACC)                                                                  \
  void NAME(const ACC* acc, float* out, const float* x_scale, const float* w_scale, const float* bias, \
            int64_t m, int64_t n, int threads) {                                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")            \
    for (int64_t i = 0; i < m; ++i) {                                                             \
      const ACC* a = acc + i * n;                                                                 \
      float* o = out + i * n;                                                                     \
      const float s = x_scale[i];                                                                 \
      if (bias) {                                                                                 \
        for (int64_t j = 0; j < n; ++j) o[j] = fmaf((float)a[j] * s, w_scale[j], bias[j]);        \
      } else {                                                                                    \
        for (int64_t j = 0; j < n; ++j) o[j] = (float)a[j] * s * w_scale[j];                      \
      }                                                                                           \
    }                                                                                             \
  }
INT8_EPILOGUE(int8_epilogue, int32_t)
INT8_EPILOGUE(int8_epilogue_f32, float)

/* Per row v = round(x / s), s = absmax / 32639 (a 16-bit value, |v| <= 32639), split
   v = 256 * hi + lo with hi in [-127, 127] and lo in [-128, 127]; rows [hi; lo] stacked as
   (2M, K). A row with NaN or infinity gets scale NaN and zero rows. */
void quantize_rows_split(const float* restrict x, int64_t m, int64_t k, float lowest, int8_t* restrict q,
                         float* restrict scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * k;
    int8_t* hi = q + i * k;
    int8_t* lo = q + (m + i) * k;
    const float absmax = row_absmax(xr, 0, k);
    if (!(absmax <= 3.4028234663852886e38f)) { /* NaN or infinity */
      scale[i] = NAN;
      memset(hi, 0, k);
      memset(lo, 0, k);
      continue;
    }
    const float s = absmax >= lowest ? absmax / 32639.0f : 1.0f;
    scale[i] = s;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t v = shifted_bits(xr[j], s) - 0x4B400000;
      hi[j] = (int8_t)((v + 128) >> 8);
      lo[j] = (int8_t)v;
    }
  }
}

/* out[i, j] = fma((256 * fp32(acc[i, j]) + fp32(acc[M + i, j])) * x_scale[i], w_scale[j], bias[j])
   for acc (2M, N), written over acc's first M rows; ACC as for INT8_EPILOGUE. */
#define SPLIT_EPILOGUE(NAME, ACC)                                                                 \
  void NAME(const ACC* acc, float* out, const float* x_scale, const float* w_scale, const float* bias, \
            int64_t m, int64_t n, int threads) {                                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")            \
    for (int64_t i = 0; i < m; ++i) {                                                             \
      const ACC* ah = acc + i * n;                                                                \
      const ACC* al = acc + (m + i) * n;                                                          \
      float* o = out + i * n;                                                                     \
      const float s = x_scale[i];                                                                 \
      if (bias) {                                                                                 \
        for (int64_t j = 0; j < n; ++j)                                                           \
          o[j] = fmaf((256.0f * (float)ah[j] + (float)al[j]) * s, w_scale[j], bias[j]);           \
      } else {                                                                                    \
        for (int64_t j = 0; j < n; ++j) o[j] = (256.0f * (float)ah[j] + (float)al[j]) * s * w_scale[j]; \
      }                                                                                           \
    }                                                                                             \
  }
SPLIT_EPILOGUE(split_epilogue, int32_t)
SPLIT_EPILOGUE(split_epilogue_f32, float)

void int8_to_float(const int8_t* restrict w, float* restrict out, int64_t count, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < count; ++i) out[i] = (float)w[i];
}

/* out[i, j] = fma(out[i, j], w_scale[j], bias[j]) in place. */
void scale_bias(float* restrict out, const float* restrict w_scale, const float* restrict bias, int64_t m, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < m; ++i) {
    float* o = out + i * n;
    if (bias) {
      for (int64_t j = 0; j < n; ++j) o[j] = fmaf(o[j], w_scale[j], bias[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) o[j] = o[j] * w_scale[j];
    }
  }
}
"""

# Elements below which a loop runs on the calling thread (at::parallel_for's grain).
_GRAIN = 32768

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "quantize_rows": [_P, _P, _I64, _I64, _F32, _P, _P, _INT],
    "int8_epilogue": [_P, _P, _P, _P, _P, _I64, _I64, _INT],
    "quantize_rows_split": [_P, _I64, _I64, _F32, _P, _P, _INT],
    "split_epilogue": [_P, _P, _P, _P, _P, _I64, _I64, _INT],
    "int8_epilogue_f32": [_P, _P, _P, _P, _P, _I64, _I64, _INT],
    "split_epilogue_f32": [_P, _P, _P, _P, _P, _I64, _I64, _INT],
    "int8_to_float": [_P, _P, _I64, _INT],
    "scale_bias": [_P, _P, _P, _I64, _I64, _INT],
}


def _sums_exactly(product) -> bool:
    """Whether ``product(q, w)`` (int8 q (M, K), int8 w (N, K) -> q @ wᵀ as fp32 or int32) sums
    exactly here: products of ±127 whose pairs pass 2^15 - 1, which a saturating 16-bit pair
    sum (vpmaddubsw) would clip. The CPU's flags alone do not tell: ONEDNN_MAX_CPU_ISA can
    hold oneDNN (behind torch._int_mm too) below VNNI."""
    q = torch.full((4, 64), 127, dtype=torch.int8)
    q[1] = -127
    w = torch.full((8, 64), 127, dtype=torch.int8)
    w[1::2] = -127
    try:
        got = product(q, w)
    except RuntimeError:
        return False
    return torch.equal(got.long(), q.long() @ w.long().t())


def _packed(weight: torch.Tensor) -> tuple:
    """(oneDNN's packing of int8 ``weight`` (N, K), unit scales (N,), zero points (N,))."""
    n = weight.shape[0]
    packing = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
    return packing, torch.ones(n, dtype=torch.float32), torch.zeros(n, dtype=torch.long)


def _onednn_product(q, packed: tuple):
    """fp32(q @ weightᵀ) by oneDNN's int8 GEMM on ``_packed(weight)``: unit scales and zero
    points, no bias."""
    packing, ones, zeros = packed
    return torch.ops.onednn.qlinear_pointwise.default(
        q, 1.0, 0, packing, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )


# int8 weight -> ((data_ptr, shape, version), ``_packed(weight)``)
_PACKED = WeakIdKeyDictionary()


def forget_packing(weight: torch.Tensor) -> None:
    """Drop ``weight``'s oneDNN packing (and the weak reference to it, which
    ``torch.utils.swap_tensors`` refuses): before a layer's weight is replaced or loaded."""
    _PACKED.pop(weight, None)


def _packing(weight: torch.Tensor) -> tuple:
    """``_packed(weight)``, made once and again when the weight's memory, shape or version
    changes (writes that bypass the version counter, through ``.data`` or numpy, are not seen)."""
    key = (weight.data_ptr(), weight.shape, None if weight.is_inference() else weight._version)
    entry = _PACKED.get(weight)
    if entry is None or entry[0] != key:
        entry = (key, _packed(weight))
        _PACKED[weight] = entry
    return entry[1]


# |a·b| <= 128·128 = 2^14 for int8 a, b: every partial sum of at most 2^10 such products
# is an integer below 2^24, which fp32 holds exactly, whatever order the GEMM adds in.
_EXACT_FP32_TERMS = 1024


def _sgemm_product(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q (M, K) @ weight (N, K)ᵀ as int32 by sgemm over slices of K short enough to add
    integers exactly (dgemm where fp32 matmuls may run in lower precision:
    ``torch.set_float32_matmul_precision``)."""
    if torch.get_float32_matmul_precision() != "highest":
        return torch.mm(q.double(), weight.double().t()).to(torch.int32)
    if q.shape[1] <= _EXACT_FP32_TERMS:
        return torch.mm(q.float(), weight.float().t()).to(torch.int32)
    acc = torch.zeros(q.shape[0], weight.shape[0], dtype=torch.int32)
    for start in range(0, q.shape[1], _EXACT_FP32_TERMS):
        part = slice(start, start + _EXACT_FP32_TERMS)
        acc += torch.mm(q[:, part].float(), weight[:, part].float().t()).to(torch.int32)
    return acc


# The exact products q (M, K) @ weight (N, K)ᵀ a CPU may run, fastest first where each is
# fast: oneDNN's packed int8 GEMM (fp32(acc); several times torch._int_mm's speed with AMX),
# torch._int_mm (int32; oneDNN's matmul with VNNI, a scalar loop without), sgemm slices (int32).
PRODUCTS = {
    "onednn": lambda q, weight: _onednn_product(q, _packing(weight)),
    "int_mm": lambda q, weight: torch._int_mm(q, weight.t()),
    "sgemm": _sgemm_product,
}
INT32_PRODUCTS = ("int_mm", "sgemm")
# Names a product to run wherever it is exact, instead of the measured choice.
PRODUCT_ENV = "SLIMFORMER_CPU_INT8_GEMM"


@functools.cache
def exact_products() -> tuple[str, ...]:
    """The names in ``PRODUCTS`` that sum exactly on this CPU (``_sums_exactly``): sgemm
    always; oneDNN's GEMM and torch._int_mm where oneDNN runs VNNI or AMX code."""
    onednn_here = torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
    return tuple(
        name for name, product in PRODUCTS.items() if (name != "onednn" or onednn_here) and _sums_exactly(product)
    )


class ProductChoice(NamedTuple):
    """The product chosen for a class of GEMMs, with the times that chose it (``_race``): the
    best round, in µs, of it and of the fp32 GEMM of the same shape."""

    product: str
    product_us: float
    fp32_us: float


def _best_us(run, repeats: int = 3, warm_up: bool = True) -> float:
    if warm_up:
        run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


# A product this much slower than the fp32 GEMM on the screening problem is a reference
# implementation (oneDNN's ``ref_int8`` on a CPU with VNNI and no AMX: AMD Zen 4 runs
# qlinear there at 1/900 of fp32's speed), never raced on a real shape.
_SCREEN_SHAPE = (16, 128, 128)
_SCREEN_FACTOR = 50.0
# Rows the race runs at: from about this many rows up, the ranking no longer changes.
_RACE_ROWS = 256
# A race's rounds; a product whose first run takes this many times the fastest product's
# is not run again.
_RACE_ROUNDS = 5
_RACE_CUTOFF = 20.0
# candidates -> the candidates that passed the screen
_SCREENED: dict[tuple, tuple[str, ...]] = {}
# (int32 only, threads, N, K, row class) -> ProductChoice
_CHOICES: dict[tuple, ProductChoice] = {}


def _random_int8(*shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def _one_thread():
    """torch's intra-op threads set to one for a measurement whose answer does not depend on
    them: one thread's times are not the stalls of a thread pool on a busy machine (tens of
    ms at two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _screened(candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The candidates no slower than ``_SCREEN_FACTOR`` times the fp32 GEMM on a problem of
    ``_SCREEN_SHAPE`` (a few ms for the slowest), measured once per process on one thread (a
    reference implementation is slow at any thread count)."""
    if candidates not in _SCREENED:
        m, k, n = _SCREEN_SHAPE
        q, weight = _random_int8(m, k), _random_int8(n, k)
        x, w = q.float(), weight.float()
        with _one_thread():
            limit = _SCREEN_FACTOR * _best_us(lambda: torch.mm(x, w.t()))
            kept = tuple(name for name in candidates if _best_us(lambda: PRODUCTS[name](q, weight), 1) <= limit)
        _SCREENED[candidates] = kept or ("sgemm",)
    return _SCREENED[candidates]


def choose_product(m: int, weight: torch.Tensor, int32: bool = False) -> ProductChoice:
    """The exact product to run ``(m, K) @ weight (N, K)ᵀ`` with on this CPU: the fastest of the
    exact candidates that pass the screen (``_screened``), raced (``_race``) on ``min(m, 256)``
    rows of this weight once per process, thread count, (K, N) and row class (up to 16 rows,
    up to 128, more); or the one that ``$SLIMFORMER_CPU_INT8_GEMM`` names when the choice is made
    (``auto``, the default, measures; a name that is not a product or not exact here is a
    ValueError). ``int32``: only the products that return int32 (a forced ``onednn`` leaves
    their choice measured)."""
    key = (int32, torch.get_num_threads(), *weight.shape, 16 if m <= 16 else 128 if m <= 128 else _RACE_ROWS)
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _choose(m, weight, int32)
    return choice


def _choose(m: int, weight: torch.Tensor, int32: bool) -> ProductChoice:
    exact = exact_products()
    candidates = tuple(name for name in (INT32_PRODUCTS if int32 else PRODUCTS) if name in exact)
    forced = os.environ.get(PRODUCT_ENV, "auto")
    if forced != "auto":
        if forced not in PRODUCTS:
            raise ValueError(f"${PRODUCT_ENV} must be one of auto, {', '.join(PRODUCTS)}, got {forced!r}")
        if forced not in exact:
            raise ValueError(f"${PRODUCT_ENV}: {forced!r} does not sum exactly on this CPU ({cpu_isa()})")
    if forced in candidates:
        return ProductChoice(forced, math.nan, math.nan)
    return _race(_screened(candidates), min(max(m, 1), _RACE_ROWS), weight)


def _race(candidates: tuple[str, ...], rows: int, weight: torch.Tensor) -> ProductChoice:
    """The fastest of ``candidates`` on (rows, K) @ weightᵀ, with the fp32 GEMM's time beside it:
    on one thread (the products' ranking, not a busy machine's thread-pool stalls), the
    candidates interleaved over ``_RACE_ROUNDS`` rounds, the best round of each."""
    q = _random_int8(rows, weight.shape[1])
    x, w = q.float(), weight.float()
    runs = {name: (lambda name=name: PRODUCTS[name](q, weight)) for name in candidates}
    runs["fp32"] = lambda: torch.mm(x, w.t())
    with _one_thread():
        first = {name: _best_us(run, 1, warm_up=False) for name, run in runs.items()}  # the warm-ups
        fastest = min(first[name] for name in candidates)
        runs = {name: run for name, run in runs.items() if name == "fp32" or first[name] <= _RACE_CUTOFF * fastest}
        best = dict.fromkeys(runs, math.inf)
        for _ in range(_RACE_ROUNDS):
            for name, run in runs.items():
                best[name] = min(best[name], _best_us(run, 1, warm_up=False))
    fp32_us = best.pop("fp32")
    winner = min(best, key=best.get)
    return ProductChoice(winner, best[winner], fp32_us)


# exact products -> whether int8 GEMMs are fast
_FAST: dict[tuple, bool] = {}


def int8_gemm_is_fast() -> bool:
    """Whether this CPU's fastest exact int8 product takes under half the fp32 GEMM's time on a
    BERT-small Linear, (128, 384) @ (384, 384)ᵀ: raced once per process (``_race``, one thread).
    Where it does (VNNI or AMX code in oneDNN: 9x on an AMD Zen 4), W8A8 gains and W8A16's split
    (two int8 rows per row of x) beats the fp32 GEMM; where it does not, W8A8 still runs
    (exactly, no faster than fp32) and W8A16 runs as an fp32 GEMM. One answer per process,
    not per shape, because W8A16's two paths round differently."""
    exact = exact_products()
    fast = _FAST.get(exact)
    if fast is None:
        choice = _race(_screened(tuple(name for name in PRODUCTS if name in exact)), 128, _random_int8(384, 384))
        fast = _FAST[exact] = 2 * choice.product_us < choice.fp32_us
    return fast


def chosen_products() -> dict[str, str]:
    """The products this process chose so far, for reports: ``"K x N, rows <= R"`` -> name."""
    return {f"{k} x {n}, rows <= {rows}": choice.product for (*_, n, k, rows), choice in _CHOICES.items()}


def cpu_isa() -> str:
    """The CPU's vector ISA as the int8 paths see it: "AVX512-VNNI + AMX", "AVX512-VNNI", "AVX512 (no VNNI)",
    "AVX2 (no VNNI)" or torch's capability name (e.g. "DEFAULT" on ARM)."""
    if torch.cpu._is_amx_tile_supported():
        return "AVX512-VNNI + AMX" if torch.cpu._is_vnni_supported() else "AMX"
    if torch.cpu._is_vnni_supported():
        return "AVX512-VNNI"
    if torch.cpu._is_avx512_supported():
        return "AVX512 (no VNNI)"
    if torch.cpu._is_avx2_supported():
        return "AVX2 (no VNNI)"
    return torch.backends.cpu.get_cpu_capability()


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact product of int8 a (M, K) and b (K, N) as int32 (M, N), as ``torch._int_mm``
    computes it: that op on CUDA and while torch.compile traces; on a CPU the int32 product
    ``choose_product`` picks (torch._int_mm or sgemm slices)."""
    if not a.is_cpu or torch.compiler.is_compiling():
        return torch._int_mm(a, b)
    torch._check(a.shape[1] == b.shape[0])
    weight = b.t()
    if 0 in (*a.shape, b.shape[1]):
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32)
    return PRODUCTS[choose_product(a.shape[0], weight, int32=True).product](a, weight)


@functools.cache
def extension():
    """The fused loops as a namespace of ``quantize_rows``, ``int8_gemm``,
    ``weight_only_gemm``, ``quantize_rows_split`` and ``split_gemm`` (torch tensors in and
    out), or None where they cannot be built (no C compiler): the callers then run the
    PyTorch statement."""
    library = c_loops.load(
        "int8_cpu",
        _SOURCE,
        _SIGNATURES,
        "the fused CPU int8 path",
        "W8A8 runs on plain PyTorch ops (slower, same results)",
    )
    return None if library is None else _FusedLoops(library)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads(elements: int) -> int:
    return 1 if elements < _GRAIN else torch.get_num_threads()


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(M, K) of a contiguous fp32 CPU matrix x, else ValueError."""
    _check_fp32("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be (M, K), got shape {tuple(x.shape)}")
    return x.shape


def _check_fp32(name: str, t: torch.Tensor, numel: int | None = None) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")


class _FusedLoops:
    """The C loops behind torch-tensor functions: checks and allocation here, the passes
    over memory in C, the GEMMs in torch."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self.scratch = threading.local()

    def quantize_rows(self, x, smooth, min_absmax):
        """fp32 x (M, K), smooth (K,) or None -> (q (M, K) int8, scale (M,) fp32)."""
        m, k = _rows(x)
        if smooth is not None:
            _check_fp32("smooth", smooth, k)
        q, scale = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
        self.library.quantize_rows(
            x.data_ptr(), _pointer(smooth), m, k, min_absmax, q.data_ptr(), scale.data_ptr(), _threads(m * k)
        )
        return q, scale

    def int8_gemm(self, q, weight, x_scale, w_scale, bias):
        """int8 q (M, K) @ int8 weight (N, K)ᵀ, then the W8A8 epilogue -> fp32 (M, N)."""
        acc, epilogue = self._product(q, weight, self.library.int8_epilogue, self.library.int8_epilogue_f32)
        m, n = acc.shape
        self._check_epilogue(x_scale, m, w_scale, n, bias)
        out = acc.view(torch.float32)  # fp32 written over the accumulator it is read from
        epilogue(
            acc.data_ptr(),
            out.data_ptr(),
            x_scale.data_ptr(),
            w_scale.data_ptr(),
            _pointer(bias),
            m,
            n,
            _threads(m * n),
        )
        return out

    def quantize_rows_split(self, x, min_absmax):
        """fp32 x (M, K) -> (q (2M, K) int8: hi rows then lo rows, scale (M,) fp32)."""
        m, k = _rows(x)
        q, scale = torch.empty(2 * m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
        self.library.quantize_rows_split(
            x.data_ptr(), m, k, min_absmax, q.data_ptr(), scale.data_ptr(), _threads(m * k)
        )
        return q, scale

    def split_gemm(self, q, weight, x_scale, w_scale, bias):
        """int8 q (2M, K) @ int8 weight (N, K)ᵀ, the halves recombined -> fp32 (M, N), a view
        of the accumulator's first M rows."""
        if q.shape[0] % 2:
            raise ValueError(f"q must have an even number of rows (2M), got {q.shape[0]}")
        acc, epilogue = self._product(q, weight, self.library.split_epilogue, self.library.split_epilogue_f32)
        m, n = acc.shape[0] // 2, acc.shape[1]
        self._check_epilogue(x_scale, m, w_scale, n, bias)
        out = acc.view(torch.float32)
        epilogue(
            acc.data_ptr(),
            out.data_ptr(),
            x_scale.data_ptr(),
            w_scale.data_ptr(),
            _pointer(bias),
            m,
            n,
            _threads(m * n),
        )
        return out[:m]

    def _product(self, q, weight, int32_epilogue, float_epilogue):
        """(q @ weightᵀ exactly, the epilogue that reads it): int32, or fp32(acc) from
        oneDNN's int8 GEMM with the weight packed once, as ``choose_product`` picks."""
        if weight.dtype != torch.int8 or weight.dim() != 2 or q.shape[1] != weight.shape[1]:
            raise ValueError(
                f"weight must be an (N, {q.shape[1]}) int8 tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        if 0 in (*q.shape, weight.shape[0]):  # oneDNN does not take empty matrices
            return int8_mm(q, weight.t()), int32_epilogue
        acc = PRODUCTS[choose_product(q.shape[0], weight).product](q, weight)
        return acc, float_epilogue if acc.dtype == torch.float32 else int32_epilogue

    def weight_only_gemm(self, x, weight, w_scale, bias):
        """fp32 x (M, K) @ fp32(int8 weight (N, K))ᵀ, then ``fma(·, w_scale, bias)`` -> fp32 (M, N)."""
        _rows(x)
        if weight.dtype != torch.int8 or not weight.is_contiguous() or weight.dim() != 2:
            raise ValueError(
                f"weight must be a contiguous (N, K) int8 tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        n, k = weight.shape
        if x.shape[1] != k:
            raise ValueError(f"x must be (M, {k}), got shape {tuple(x.shape)}")
        self._check_epilogue(None, None, w_scale, n, bias)
        # The weight's integers as fp32 in one buffer per thread, reused by every call: a
        # fresh (N, K) tensor per call costs its allocation and page faults too.
        scratch = getattr(self.scratch, "buffer", None)
        if scratch is None or scratch.numel() < n * k:
            scratch = self.scratch.buffer = torch.empty(n * k)
        self.library.int8_to_float(weight.data_ptr(), scratch.data_ptr(), n * k, _threads(n * k))
        out = torch.mm(x, scratch[: n * k].view(n, k).t())
        self.library.scale_bias(out.data_ptr(), w_scale.data_ptr(), _pointer(bias), *out.shape, _threads(out.numel()))
        return out

    @staticmethod
    def _check_epilogue(x_scale, m, w_scale, n, bias):
        if x_scale is not None:
            _check_fp32("x_scale", x_scale, m)
        _check_fp32("w_scale", w_scale, n)
        if bias is not None:
            _check_fp32("bias", bias, n)
