"""W8A8 and W8A16 on CPU in fused C++ loops around oneDNN's int8 GEMM (``torch._int_mm``).

The PyTorch statement of the CPU path (``matmul._quantize_rows_reference`` and the int8
branch of ``matmul._gemm_reference``) takes about fifteen whole-tensor ops per Linear;
at BERT's sizes each costs a few microseconds of dispatch and a pass over memory, which
together cost more than the GEMM. These two functions compute exactly the same values
in one pass each:

- ``quantize_rows(x, smooth)``: per row, ``absmax = max|x * smooth|`` (NaN if the row
  has one), ``scale = absmax / 127`` (1 below ``MIN_ROW_ABSMAX`` or for NaN), and
  ``q = int8(bits(x * smooth / scale + 1.5·2^23))``: the IEEE division, then the add
  that rounds half to even, whose low byte is the rounded integer.
- ``int8_gemm(q, weight_t, x_scale, w_scale, bias)``: ``acc = torch._int_mm(q, weight_t)``,
  then ``fma(fp32(acc) * x_scale[m], w_scale[n], bias[n])`` in the accumulator's own
  memory: the reference's ``mul_`` then ``addcmul`` (which fuses its multiply-add);
  ``-ffp-contract=off`` keeps the compiler from fusing anything else.
- ``weight_only_gemm(x, weight, w_scale, bias)``: W8A16 as ``_gemm_reference`` states it,
  ``fma(x @ fp32(weight)ᵀ, w_scale[n], bias[n])``: the weight's integers converted into a
  buffer each thread keeps (the reference's ``weight.float()`` allocates, and converts at
  a third of this loop's speed), the same fp32 GEMM, the epilogue in the output's memory.

- ``quantize_rows_split(x, min_absmax)`` and ``split_gemm(q, weight_t, x_scale, w_scale, bias)``:
  W8A16 as ``matmul._quantize_rows_split_reference`` / ``_split_gemm_reference`` state it
  (the same bits): per row ``s = absmax / 32639`` (1 below ``min_absmax``, NaN for a row
  with NaN or infinity, whose integers are zeros), ``v = round(x / s)`` by the same
  division and add as above, ``v = 256·hi + lo`` stacked as (2M, K) int8 (hi rows, then lo
  rows); then ``acc = torch._int_mm(q, weight_t)`` and
  ``fma((256·fp32(acc_hi) + fp32(acc_lo)) * x_scale[m], w_scale[n], bias[n])`` in the
  first M rows of the accumulator's memory. ``weight_only_gemm`` remains for K past
  ``matmul.MAX_SPLIT_IN_FEATURES``.

The extension is compiled by ``torch.utils.cpp_extension.load_inline`` once (about a
minute; then cached in torch's extensions directory) for the vector ISA torch uses on
this CPU; ``Linear8bit.from_float`` builds it when it makes a CPU layer,
so the time is spent at quantize / load time, not in the first forward. Without a
working C++ compiler ``extension()`` returns None and the callers run the PyTorch
statement, which gives the same bits, only slower.
"""

import functools
import hashlib
import logging
import os
import warnings
from pathlib import Path

import torch

_log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
constexpr int kLanes = 16;

// max |v| over a row, NaN if the row holds a NaN (as torch.amax / torch.amin).
float row_absmax(const float* x, const float* smooth, int64_t k) {
  float lane_max[kLanes] = {0};
  int lane_nan[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      float v = smooth ? x[j + l] * smooth[j + l] : x[j + l];
      float a = std::fabs(v);
      lane_max[l] = lane_max[l] < a ? a : lane_max[l];
      lane_nan[l] |= (v != v);
    }
  }
  float absmax = 0.0f;
  int nan = 0;
  for (; j < k; ++j) {
    float v = smooth ? x[j] * smooth[j] : x[j];
    float a = std::fabs(v);
    absmax = absmax < a ? a : absmax;
    nan |= (v != v);
  }
  for (int l = 0; l < kLanes; ++l) {
    absmax = absmax < lane_max[l] ? lane_max[l] : absmax;
    nan |= lane_nan[l];
  }
  return nan ? NAN : absmax;
}

template <bool kSmooth>
void quantize_row(const float* x, const float* smooth, float scale, int8_t* q, int64_t k) {
  for (int64_t j = 0; j < k; ++j) {
    float v = kSmooth ? x[j] * smooth[j] : x[j];
    float shifted = v / scale + kShift;
    int32_t bits;
    std::memcpy(&bits, &shifted, sizeof(bits));
    q[j] = static_cast<int8_t>(bits);
  }
}

}  // namespace

void check_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

std::vector<torch::Tensor> quantize_rows(torch::Tensor x, c10::optional<torch::Tensor> smooth, double min_absmax) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const int64_t m = x.size(0), k = x.size(1);
  if (smooth.has_value()) {
    check_fp32(*smooth, "smooth");
    TORCH_CHECK(smooth->numel() == k, "smooth must have K elements");
  }
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = smooth.has_value() ? smooth->data_ptr<float>() : nullptr;
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  const float lowest = static_cast<float>(min_absmax);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float absmax = row_absmax(xp + i * k, sp, k);
      const float s = absmax >= lowest ? absmax / 127.0f : 1.0f;
      scp[i] = s;
      if (sp) {
        quantize_row<true>(xp + i * k, sp, s, qp + i * k, k);
      } else {
        quantize_row<false>(xp + i * k, sp, s, qp + i * k, k);
      }
    }
  });
  return {q, scale};
}

torch::Tensor int8_gemm(torch::Tensor q, torch::Tensor weight_t, torch::Tensor x_scale, torch::Tensor w_scale,
                        c10::optional<torch::Tensor> bias) {
  auto acc = at::_int_mm(q, weight_t);
  const int64_t m = acc.size(0), n = acc.size(1);
  check_fp32(x_scale, "x_scale");
  check_fp32(w_scale, "w_scale");
  TORCH_CHECK(x_scale.numel() == m && w_scale.numel() == n, "x_scale must have M elements, w_scale N");
  if (bias.has_value()) {
    check_fp32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "bias must have N elements");
  }
  auto out = acc.view(torch::kFloat32);  // fp32 written over the int32 it was read from
  const int32_t* ap = acc.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* a = ap + i * n;
      float* o = op + i * n;
      const float s = xs[i];
      if (bp) {
        for (int64_t j = 0; j < n; ++j) o[j] = std::fma(static_cast<float>(a[j]) * s, ws[j], bp[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(a[j]) * s * ws[j];
      }
    }
  });
  return out;
}

// W8A16 as two int8 GEMMs: per row v = round(x / s), s = absmax / 32639 (a 16-bit value,
// |v| <= 32639), split v = 256 * hi + lo with hi in [-127, 127] and lo in [-128, 127]; rows
// [hi; lo] stacked as (2M, K). A row with NaN or infinity gets scale NaN and zero rows.
std::vector<torch::Tensor> quantize_rows_split(torch::Tensor x, double min_absmax) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const int64_t m = x.size(0), k = x.size(1);
  auto q = torch::empty({2 * m, k}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  const float lowest = static_cast<float>(min_absmax);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = xp + i * k;
      int8_t* hi = qp + i * k;
      int8_t* lo = qp + (m + i) * k;
      const float absmax = row_absmax(xr, nullptr, k);
      if (!(absmax <= 3.4028234663852886e38f)) {  // NaN or infinity
        scp[i] = NAN;
        std::memset(hi, 0, k);
        std::memset(lo, 0, k);
        continue;
      }
      const float s = absmax >= lowest ? absmax / 32639.0f : 1.0f;
      scp[i] = s;
      for (int64_t j = 0; j < k; ++j) {
        float shifted = xr[j] / s + kShift;
        int32_t bits;
        std::memcpy(&bits, &shifted, sizeof(bits));
        const int32_t v = bits - 0x4B400000;
        hi[j] = static_cast<int8_t>((v + 128) >> 8);
        lo[j] = static_cast<int8_t>(v);
      }
    }
  });
  return {q, scale};
}

// y[i] = fma((256 * fp32(acc[i]) + fp32(acc[M + i])) * x_scale[i], w_scale, bias) for
// acc = q @ weight_t (2M, N), in the first M rows of acc's memory.
torch::Tensor split_gemm(torch::Tensor q, torch::Tensor weight_t, torch::Tensor x_scale, torch::Tensor w_scale,
                         c10::optional<torch::Tensor> bias) {
  auto acc = at::_int_mm(q, weight_t);
  const int64_t m = acc.size(0) / 2, n = acc.size(1);
  check_fp32(x_scale, "x_scale");
  check_fp32(w_scale, "w_scale");
  TORCH_CHECK(acc.size(0) == 2 * m && x_scale.numel() == m && w_scale.numel() == n,
              "q must have 2M rows, x_scale M elements, w_scale N");
  if (bias.has_value()) {
    check_fp32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "bias must have N elements");
  }
  auto out = acc.view(torch::kFloat32).narrow(0, 0, m);
  const int32_t* ap = acc.data_ptr<int32_t>();
  float* op = acc.view(torch::kFloat32).data_ptr<float>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* ah = ap + i * n;
      const int32_t* al = ap + (m + i) * n;
      float* o = op + i * n;
      const float s = xs[i];
      if (bp) {
        for (int64_t j = 0; j < n; ++j) {
          const float t = 256.0f * static_cast<float>(ah[j]) + static_cast<float>(al[j]);
          o[j] = std::fma(t * s, ws[j], bp[j]);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float t = 256.0f * static_cast<float>(ah[j]) + static_cast<float>(al[j]);
          o[j] = t * s * ws[j];
        }
      }
    }
  });
  return out;
}

torch::Tensor weight_only_gemm(torch::Tensor x, torch::Tensor weight, torch::Tensor w_scale,
                               c10::optional<torch::Tensor> bias) {
  check_fp32(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.is_contiguous() && weight.dim() == 2,
              "weight must be a contiguous (N, K) int8 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (M, K)");
  check_fp32(w_scale, "w_scale");
  TORCH_CHECK(w_scale.numel() == n, "w_scale must have N elements");
  if (bias.has_value()) {
    check_fp32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "bias must have N elements");
  }
  // The weight's integers as fp32 in one buffer per thread, reused by every call: a
  // fresh (N, K) tensor per call costs its allocation and page faults too.
  thread_local torch::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < n * k) scratch = torch::empty({n * k}, x.options());
  float* wf = scratch.data_ptr<float>();
  const int8_t* wq = weight.data_ptr<int8_t>();
  at::parallel_for(0, n * k, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) wf[i] = static_cast<float>(wq[i]);
  });
  auto out = at::mm(x, scratch.narrow(0, 0, n * k).view({n, k}).t());
  float* op = out.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* o = op + i * n;
      if (bp) {
        for (int64_t j = 0; j < n; ++j) o[j] = std::fma(o[j], ws[j], bp[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = o[j] * ws[j];
      }
    }
  });
  return out;
}
"""

# -ffp-contract=off: no multiply-add is fused but the one written as std::fma.
_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
# Vector ISA flags per torch's CPU capability (not -march=native: the cached library
# must run on every machine of that capability that shares the cache directory).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


@functools.cache
def extension():
    """The compiled module (``quantize_rows``, ``int8_gemm``, ``weight_only_gemm``, ``quantize_rows_split``,
    ``split_gemm``), or None where it cannot be
    built (no C++ compiler or ninja): the callers then run the PyTorch statement."""
    from torch.utils import cpp_extension

    flags = _CFLAGS + _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    key = "\n".join([_SOURCE, *flags, torch.__version__])  # a new torch needs a new build
    name = "slimformer_int8_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    if not any(root.glob(f"*/{name}/{name}*.so")):
        _log.warning("slimformer: compiling the CPU int8 kernels (once per machine and torch version, about a minute)")
    try:
        return cpp_extension.load_inline(
            name,
            cpp_sources=_SOURCE,
            functions=["quantize_rows", "int8_gemm", "weight_only_gemm", "quantize_rows_split", "split_gemm"],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - any build failure means: use the PyTorch path
        warnings.warn(
            f"slimformer: the fused CPU int8 path could not be built ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); "
            "W8A8 runs on plain PyTorch ops (slower, same results)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
