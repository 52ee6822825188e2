"""MLP and GEMM rows.

- MLP (training, bf16): ``sf.FusedMLP`` 768 → 3072 → 768, GELU, dropout 0.1, on 16384
  tokens (as saved by default, and with ``recompute_fc1``), against torch eager
  (Linear, GELU, Dropout, Linear); forward and forward + backward. FLOPs: the two GEMMs,
  4·T·d·f forward and twice that backward.
- Inference GEMMs (fp16, 4096 tokens = BERT-base at batch 32 × 128): at BERT-base's
  Linear shapes, slimformer's fp16 ``linear``, W8A8 (``int8_linear``: per-token dynamic
  activation quantization, int8 GEMM, scales and bias in the epilogue) and W8A16
  (``int8_weight_only_linear``) against cuBLAS fp16 (``F.linear``) and ``torch._int_mm``
  (the bare int8 × int8 → int32 product of pre-quantized inputs: no quantization, no
  scales: shown for reference, not compared with); and the fp16 Linear with its GELU in the
  epilogue against cuBLAS + ``F.gelu``. FLOPs 2·M·K·N.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

import slimformer as sf
from bench.gpu_check.cases import Case, Provider
from slimformer.kernels.matmul import (
    int8_linear,
    int8_weight_only_linear,
    linear,
    quantize_per_channel,
    quantize_per_token,
)

FULL = dict(tokens=16384, d_model=768, d_ff=3072, gemm_tokens=4096)
DRY = dict(tokens=64, d_model=32, d_ff=64, gemm_tokens=32)
DROPOUT_P = 0.1
MLP_MODES = ("fwd", "fwd+bwd")


def cases(dry_run: bool, device: torch.device, copies: int) -> list[Case]:
    sizes = DRY if dry_run else FULL
    d, f, m = sizes["d_model"], sizes["d_ff"], sizes["gemm_tokens"]
    mlp_flops = 4 * sizes["tokens"] * d * f
    gemm_cases = [
        _gemm_case("gemm", f"Linear {k} → {n}, {m} tokens", _gemm_providers, m, k, n, device, copies)
        for k, n in ((d, f), (f, d), (d, d))
    ]
    gelu_case = _gemm_case(
        "epilogue", f"Linear {d} → {f} + GELU, {m} tokens", _gelu_providers, m, d, f, device, copies, activation="gelu"
    )
    mlp_case = Case(
        key=f"mlp {sizes['tokens']}x{d}x{f}",
        family="mlp",
        label=f"MLP {d} → {f} → {d}, GELU, dropout {DROPOUT_P}, {sizes['tokens']} tokens",
        modes=MLP_MODES,
        unit="TFLOP/s",
        work={"fwd": mlp_flops, "fwd+bwd": 3 * mlp_flops},
        build=functools.partial(_mlp_providers, sizes["tokens"], d, f, dry_run, device, copies),
        params=dict(
            tokens=sizes["tokens"], d_model=d, d_ff=f, dropout_p=DROPOUT_P, dtype="float32" if dry_run else "bfloat16"
        ),
    )
    return [mlp_case, *gemm_cases, gelu_case]


def _gemm_case(family: str, label: str, providers, m: int, k: int, n: int, device, copies: int, **params) -> Case:
    return Case(
        key=f"{family} {m}x{k}x{n}",
        family=family,
        label=label,
        modes=("inference",),
        unit="TFLOP/s",
        work={"inference": 2 * m * k * n},
        build=functools.partial(providers, m, k, n, device, copies),
        params=dict(m=m, k=k, n=n, dtype="float16", **params),
    )


def _mlp_providers(tokens, d, f, dry_run, device, copies) -> dict[str, Provider]:
    dtype = torch.float32 if dry_run else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [
        (torch.randn(tokens, d, device=device, generator=generator).to(dtype).requires_grad_(),) for _ in range(copies)
    ]
    torch.manual_seed(0)
    saved = sf.FusedMLP(d, f, activation="gelu", dropout=DROPOUT_P, device=device, dtype=dtype)
    recomputed = sf.FusedMLP(d, f, activation="gelu", dropout=DROPOUT_P, recompute_fc1=True, device=device, dtype=dtype)
    recomputed.load_state_dict(saved.state_dict())
    eager = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Dropout(DROPOUT_P), nn.Linear(f, d)).to(device, dtype)
    return {
        "slimformer": Provider(saved, inputs, params=tuple(saved.parameters())),
        "slimformer recompute_fc1": Provider(recomputed, inputs, params=tuple(recomputed.parameters())),
        "torch": Provider(eager, inputs, params=tuple(eager.parameters()), baseline=True),
    }


def _weights(m, k, n, device, copies):
    """fp16 activations (one per copy), an (n, k) weight scaled to keep outputs O(1), a bias."""
    generator = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(m, k, device=device, generator=generator).half() for _ in range(copies)]
    weight = (torch.randn(n, k, device=device, generator=generator) / k**0.5).half()
    bias = torch.randn(n, device=device, generator=generator).half()
    return xs, weight, bias


def _gemm_providers(m, k, n, device, copies) -> dict[str, Provider]:
    xs, weight, bias = _weights(m, k, n, device, copies)
    q_weight, w_scale = quantize_per_channel(weight)
    q_xs = [(quantize_per_token(x)[0],) for x in xs]
    q_weight_t = q_weight.t()
    inputs = [(x,) for x in xs]
    return {
        "slimformer fp16": Provider(lambda x: linear(x, weight, bias), inputs),
        "slimformer W8A8": Provider(lambda x: int8_linear(x, q_weight, w_scale, bias), inputs),
        "slimformer W8A16": Provider(lambda x: int8_weight_only_linear(x, q_weight, w_scale, bias), inputs),
        "cuBLAS fp16": Provider(lambda x: F.linear(x, weight, bias), inputs, baseline=True),
        # a reference, not a baseline: a bare product of inputs quantized beforehand, no scales
        "torch._int_mm": Provider(lambda q: torch._int_mm(q, q_weight_t), q_xs),
    }


def _gelu_providers(m, k, n, device, copies) -> dict[str, Provider]:
    xs, weight, bias = _weights(m, k, n, device, copies)
    inputs = [(x,) for x in xs]
    return {
        "slimformer fp16 + GELU epilogue": Provider(lambda x: linear(x, weight, bias, activation="gelu"), inputs),
        "cuBLAS fp16 + F.gelu": Provider(lambda x: F.gelu(F.linear(x, weight, bias)), inputs, baseline=True),
    }
