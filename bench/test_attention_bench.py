"""Attention benchmarks: slimformer's fused attention against each SDPA backend; forward, backward, both.

Ops, one per head dim and causality (``d128 causal``, ``d64 non-causal``, ...), each swept
over the sequence length. On a GPU the batch holds 16384 tokens (batch = 16384 // seq, at
least 1) and heads = 2048 // head_dim, so every point does the same projection-sized
work and only the attention's s² part grows; inputs are bf16. On CPU a tiny fp32 case
(batch 1, 2 heads, head dim 32) only exercises the harness.

Providers: ``slimformer`` (``slimformer.kernels.attention.attention``) and
``F.scaled_dot_product_attention`` pinned to one backend with ``sdpa_kernel``:
``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn`` and ``sdpa-math`` (on CPU only the math
backend). A backend that cannot run a configuration is skipped with its reason, and so is
the math backend where its score matrices would not fit comfortably in free GPU memory
(``MATH_MEMORY_FRACTION``). q, k and v are contiguous (batch, heads, seq, head_dim)
tensors without masks or dropout. Modes: ``fwd`` is the training forward (inputs require
grad), ``bwd`` the backward of a retained forward, ``full`` forward + backward; gradients
of q, k and v are taken with ``torch.autograd.grad``, so nothing accumulates between rounds.

TFLOP/s divides ``attention_flops`` (docs/architecture.md: forward 4·b·h·s²·d, halved if causal,
backward 2.5x forward; the same for every provider) by the median time.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.harness import CLOCK, bench_device, device_name, measure, warm_up
from slimformer.kernels.attention import attention
from slimformer.kernels.dispatch import use_triton

pytestmark = pytest.mark.benchmark(timer=CLOCK)

DEVICE = bench_device()
# TOKENS = batch · seq (batch at least 1), WIDTH = heads · head_dim.
if DEVICE.type == "cuda":
    TOKENS, WIDTH, HEAD_DIMS, DTYPE = 16384, 2048, [64, 128], torch.bfloat16
    SEQ = [512, 1024, 2048, 4096, 8192, 16384]
    PROVIDERS = ["slimformer", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"]
else:
    TOKENS, WIDTH, HEAD_DIMS, DTYPE = 64, 64, [32], torch.float32
    SEQ = [32, 64, 128, 256]  # four points: a trend to read
    PROVIDERS = ["slimformer", "sdpa-math"]
MODES = ["fwd", "bwd", "full"]
SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-math": SDPBackend.MATH,
}
# The math backend materialises fp32 scores (it upcasts 16-bit inputs), probabilities and,
# in backward, their gradient: about 3 · 4 bytes per score. Skip it beyond this share of
# the free GPU memory.
MATH_BYTES_PER_SCORE = 3 * 4
MATH_MEMORY_FRACTION = 0.4


def shape(seq: int, head_dim: int) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of one benchmark."""
    return max(1, TOKENS // seq), WIDTH // head_dim, seq, head_dim


def attention_flops(mode: str, batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> int:
    """FLOPs of one call in ``mode``: forward 4·b·h·s²·d (two s x s x d matmuls), halved when
    causal (half the scores are masked); backward 2.5x forward (five such matmuls, the
    forward's QKᵀ recomputed among them, counted as in FlashAttention); full = 3.5x forward."""
    fwd = 4 * batch * heads * seq * seq * head_dim // (2 if causal else 1)
    return {"fwd": fwd, "bwd": fwd * 5 // 2, "full": fwd * 7 // 2}[mode]


def attention_function(provider: str):
    """``fn(q, k, v, causal)`` of ``provider``."""
    if provider == "slimformer":
        return lambda q, k, v, causal: attention(q, k, v, is_causal=causal)
    backend = SDPA_BACKENDS[provider]

    def sdpa(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


def make_inputs(batch: int, heads: int, seq: int, head_dim: int) -> tuple:
    """q, k, v: contiguous (batch, heads, seq, head_dim), requiring grad."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return tuple(
        torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=gen).to(DTYPE).requires_grad_()
        for _ in range(3)
    )


def make_step(fn, inputs: tuple, causal: bool, mode: str):
    """The callable one round times: ``fn``'s forward, backward (of a retained forward) or both."""
    if mode == "fwd":
        return lambda: fn(*inputs, causal)
    out = fn(*inputs, causal)
    dout = torch.randn_like(out)
    if mode == "bwd":
        return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*inputs, causal), inputs, dout)


def math_memory_skip(batch: int, heads: int, seq: int) -> str | None:
    """Why the math backend would not fit comfortably in free GPU memory, or None."""
    if DEVICE.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(DEVICE)
    free += torch.cuda.memory_reserved(DEVICE) - torch.cuda.memory_allocated(DEVICE)  # cached, reusable
    needed = MATH_BYTES_PER_SCORE * batch * heads * seq * seq
    if needed <= MATH_MEMORY_FRACTION * free:
        return None
    return (
        f"needs ~{needed / 2**30:.1f} GiB for its score matrices, more than "
        f"{MATH_MEMORY_FRACTION:.0%} of the {free / 2**30:.1f} GiB of free GPU memory"
    )


def sdpa_failure(err: Exception, caught: list[warnings.WarningMessage]) -> str:
    """One line saying why an SDPA backend failed: its error and the reasons SDPA warned of."""
    first_line = next(iter(str(err).splitlines()), "")
    reasons = [" ".join(str(w.message).split()) for w in caught]
    because = f" ({'; '.join(dict.fromkeys(reasons))})" if reasons else ""
    return f"{type(err).__name__}: {first_line}{because}"[:400]


def implementation(provider: str, q: torch.Tensor) -> str:
    """What actually runs, so a CPU run is never mistaken for a kernel measurement."""
    if provider == "slimformer":
        return "triton" if use_triton(q) else "pytorch-reference"
    return SDPA_BACKENDS[provider].name.lower()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("seq", SEQ, ids=lambda seq: f"seq{seq}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda head_dim: f"d{head_dim}")
def test_attention(benchmark, head_dim, causal, mode, seq, provider):
    op = f"d{head_dim} {'causal' if causal else 'non-causal'}"
    batch, heads, seq, head_dim = shape(seq, head_dim)
    where = f"{provider}, {op}, seq {seq}, {mode}"
    if provider == "sdpa-math" and (too_big := math_memory_skip(batch, heads, seq)):
        pytest.skip(f"{where}: the math backend {too_big}")

    inputs = make_inputs(batch, heads, seq, head_dim)
    failure = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = make_step(attention_function(provider), inputs, causal, mode)
            warm_up(step, DEVICE)
        except Exception as err:
            if provider == "slimformer":
                raise
            failure = sdpa_failure(err, caught)
    if failure is not None:  # outside the handler, so the error's frames and tensors are freed first
        pytest.skip(f"{where}: backend unavailable: {failure}")

    benchmark.group = f"attention {op} {mode} seq={seq}"
    benchmark.extra_info.update(
        family="attention",
        op=op,
        mode=mode,
        provider=provider,
        implementation=implementation(provider, inputs[0]),
        sweep="seq",
        seq=seq,
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        causal=causal,
        dtype=str(DTYPE).removeprefix("torch."),
        device=device_name(DEVICE),
        work=attention_flops(mode, batch, heads, seq, head_dim, causal),
        unit="TFLOP/s",
    )
    measure(benchmark, step, DEVICE)
