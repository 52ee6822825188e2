"""GEMM benchmarks: 16-bit GEMM, W8A8, W8A16, and BERT inference with quantized Linears.

GEMM ops, one table per weight shape K x N (BERT-base's 768x768, 768x3072, 3072x768
and 4096x4096), swept over M (tokens):
- ``linear``: ``slimformer.kernels.matmul.linear`` (16-bit GEMM + bias epilogue);
- ``w8a8``: what ``Linear8bit(mode="int8")`` runs per call: per-token quantization of
  the activation, then the int8 GEMM with the dequantize + bias epilogue;
- ``w8a8-gemm``: the int8 GEMM alone, on an activation quantized beforehand;
- ``w8a16``: ``Linear8bit(mode="int8-weight-only")``, int8 weights dequantized in the kernel.
The baseline of every GEMM op is provider ``torch``: ``F.linear`` in the activation
dtype (cuBLAS fp16 on a GPU), so "vs torch" is the speed-up over a 16-bit GEMM.
TFLOP/s = 2·M·K·N / median time, for every provider.

``bert``: a BertModel forward without grad (BERT-base on a GPU at sequence 128, swept
over the batch; a 2-layer BERT on CPU). Providers: ``torch`` (the HF model in the
activation dtype, SDPA attention) and ``slimformer <mode>`` (the same model after
``quantize(model, mode)``). TFLOP/s counts the Linears' 2·tokens·K·N and the
attention's 4·batch·heads·seq²·head_dim.

On CPU the activation dtype is float32 and slimformer runs its PyTorch reference path
(``torch._int_mm`` for int8): the numbers only exercise the harness.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from bench.harness import CLOCK, bench_device, device_name, measure, warm_up
from slimformer.kernels.dispatch import use_triton
from slimformer.kernels.matmul import (
    int8_linear,
    int8_matmul,
    int8_weight_only_linear,
    linear,
    quantize_per_channel,
    quantize_per_token,
)
from slimformer.quantize import quantize

pytestmark = pytest.mark.benchmark(timer=CLOCK)

DEVICE = bench_device()
if DEVICE.type == "cuda":
    DTYPE = torch.float16
    WEIGHT_SHAPES = [(768, 768), (768, 3072), (3072, 768), (4096, 4096)]
    TOKENS = [1, 16, 256, 4096, 8192]
    BERT = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    BERT_SEQ, BERT_BATCHES = 128, [1, 32]
else:
    DTYPE = torch.float32
    WEIGHT_SHAPES = [(256, 384)]
    TOKENS = [1, 16, 64, 256]  # four points: a trend to read
    BERT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
    BERT_SEQ, BERT_BATCHES = 32, [2]
GEMM_OPS = ["linear", "w8a8", "w8a8-gemm", "w8a16"]
BERT_MODES = ["fp16", "int8", "int8-weight-only"]


def implementation(provider: str, x: torch.Tensor) -> str:
    """What actually runs, so a CPU run is never mistaken for a kernel measurement."""
    if provider.startswith("slimformer"):
        return "triton" if use_triton(x) else "pytorch-reference"
    return "eager"


def gemm_step(op: str, provider: str, m: int, k: int, n: int):
    """The no-argument callable one round times, and its activation."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(DTYPE)
    bias = torch.randn(n, device=DEVICE, generator=gen).to(DTYPE)
    if provider == "torch":
        return (lambda: F.linear(x, weight, bias)), x
    q_weight, w_scale = quantize_per_channel(weight)
    if op == "linear":
        return (lambda: linear(x, weight, bias)), x
    if op == "w8a8":
        return (lambda: int8_linear(x, q_weight, w_scale, bias)), x
    if op == "w8a8-gemm":
        q, x_scale = quantize_per_token(x)
        return (lambda: int8_matmul(q, x_scale, q_weight, w_scale, bias, out_dtype=DTYPE)), x
    return (lambda: int8_weight_only_linear(x, q_weight, w_scale, bias)), x


@pytest.mark.parametrize("provider", ["slimformer", "torch"])
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", GEMM_OPS)
def test_gemm(benchmark, op, shape, m, provider):
    k, n = shape
    with torch.no_grad():
        step, x = gemm_step(op, provider, m, k, n)
        warm_up(step, DEVICE)
        benchmark.group = f"matmul {op} {k}x{n} M={m}"
        benchmark.extra_info.update(
            family="matmul",
            op=f"{op} {k}x{n}",
            mode="fwd",
            provider=provider,
            implementation=implementation(provider, x),
            sweep="tokens",
            tokens=m,
            dtype=str(DTYPE).removeprefix("torch."),
            device=device_name(DEVICE),
            work=2 * m * k * n,
            unit="TFLOP/s",
        )
        measure(benchmark, step, DEVICE)


def bert_flops(batch: int) -> int:
    """Forward FLOPs of the encoder: its Linears plus attention's two batched matmuls."""
    h, f = BERT["hidden_size"], BERT["intermediate_size"]
    layers, heads = BERT["num_hidden_layers"], BERT["num_attention_heads"]
    tokens = batch * BERT_SEQ
    linears = 2 * tokens * (4 * h * h + 2 * h * f)
    attention = 4 * batch * heads * BERT_SEQ**2 * (h // heads)
    return layers * (linears + attention)


@pytest.mark.parametrize("provider", ["torch", *(f"slimformer {mode}" for mode in BERT_MODES)])
@pytest.mark.parametrize("batch", BERT_BATCHES)
def test_bert(benchmark, batch, provider):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, attn_implementation="sdpa", **BERT)
    model = transformers.BertModel(config).eval().to(DEVICE, DTYPE)
    if provider != "torch":
        model = quantize(copy.deepcopy(model), provider.removeprefix("slimformer "))
    ids = torch.randint(1000, 30000, (batch, BERT_SEQ), device=DEVICE)
    with torch.no_grad():

        def step():
            return model(input_ids=ids).last_hidden_state

        warm_up(step, DEVICE)
        benchmark.group = f"matmul bert batch={batch}"
        benchmark.extra_info.update(
            family="matmul",
            op=f"bert {BERT['num_hidden_layers']}x{BERT['hidden_size']} seq {BERT_SEQ}",
            mode="fwd",
            provider=provider,
            implementation=implementation(provider, ids),
            sweep="batch",
            batch=batch,
            dtype=str(DTYPE).removeprefix("torch."),
            device=device_name(DEVICE),
            work=bert_flops(batch),
            unit="TFLOP/s",
        )
        measure(benchmark, step, DEVICE)
