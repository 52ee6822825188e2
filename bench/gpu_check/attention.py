"""Attention rows: ``sf.attention`` against SDPA's flash, cuDNN and efficient backends and
FlexAttention, bf16, forward, backward and both.

Shapes (batch, heads, seq, head_dim): BERT-base's (32, 12, 512, 64), (8, 16, 2048, 128)
and (4, 16, 8192, 64); causal and not; three variants each:

- ``dense``: no mask, no dropout;
- ``dropout``: dropout 0.1 (SDPA's flash and efficient backends, and cuDNN where it takes
  it; FlexAttention has no dropout);
- ``padding``: a key-padding mask with ~50% of the keys padded (lengths evenly spread
  over (0, seq], shuffled); SDPA gets it as a boolean mask (combined with the causal one
  where causal), FlexAttention as a block mask; ``sf.varlen_attention`` runs the same
  real tokens packed (flash-attn's varlen layout).

FlexAttention runs at BERT-base's shape only: each of its variants is an Inductor compile
that the check's budget cannot hold for every shape.

FLOPs as in docs/architecture.md: forward 4·b·h·s²·d, halved when causal; backward 2.5x
the forward; both 3.5x. With padding, the FLOPs of the real tokens only (Σ over the batch
of 4·h·len²·d), for every provider: the useful work.
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import slimformer as sf
from bench.gpu_check.cases import MODES, Case, Provider

FULL_SHAPES = ((32, 12, 512, 64), (8, 16, 2048, 128), (4, 16, 8192, 64))
DRY_SHAPES = ((2, 2, 64, 16),)
VARIANTS = ("dense", "dropout", "padding")
DROPOUT_P = 0.1
SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(mode: str, heads: int, head_dim: int, lengths: list[int], causal: bool) -> float:
    """FLOPs of one call in ``mode`` over sequences of ``lengths`` (see the module docstring)."""
    forward = sum(4 * heads * n * n * head_dim for n in lengths) / (2 if causal else 1)
    return forward * MODE_FACTOR[mode]


def padded_lengths(batch: int, seq: int) -> list[int]:
    """~50% padding: lengths seq·(i + 1/2)/batch for i < batch, shuffled with a fixed seed."""
    lengths = [max(1, round(seq * (i + 0.5) / batch)) for i in range(batch)]
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def cases(dry_run: bool, device: torch.device, copies: int) -> list[Case]:
    """Every attention case, most important first: BERT-base's shape without causality in
    each variant (the targets), then causal ones and the longer sequences."""
    shapes = DRY_SHAPES if dry_run else FULL_SHAPES
    flags = [(shape, causal, variant) for causal in (False, True) for variant in VARIANTS for shape in shapes]
    first = [f for f in flags if f[0] == shapes[0] and not f[1]]
    ordered = first + sorted((f for f in flags if f not in first), key=lambda f: (f[1], VARIANTS.index(f[2])))
    return [_case(shape, causal, variant, dry_run, device, copies) for shape, causal, variant in ordered]


def _case(shape, causal: bool, variant: str, dry_run: bool, device, copies: int) -> Case:
    batch, heads, seq, head_dim = shape
    lengths = padded_lengths(batch, seq) if variant == "padding" else [seq] * batch
    name = f"b{batch} h{heads} s{seq} d{head_dim} {'causal' if causal else 'non-causal'} {variant}"
    return Case(
        key=f"attention {name}",
        family="attention",
        label=name,
        modes=MODES,
        unit="TFLOP/s",
        work={mode: attention_flops(mode, heads, head_dim, lengths, causal) for mode in MODES},
        build=functools.partial(_providers, shape, causal, variant, lengths, dry_run, device, copies),
        params=dict(
            batch=batch,
            heads=heads,
            seq=seq,
            head_dim=head_dim,
            causal=causal,
            variant=variant,
            dropout_p=DROPOUT_P if variant == "dropout" else 0.0,
            real_tokens=sum(lengths),
            dtype="bfloat16",
        ),
    )


def _providers(shape, causal, variant, lengths, dry_run, device, copies) -> dict[str, Provider]:
    batch, heads, seq, head_dim = shape
    dtype = torch.float32 if dry_run else torch.bfloat16
    p = DROPOUT_P if variant == "dropout" else 0.0
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [
        tuple(torch.randn(shape, device=device, generator=generator).to(dtype).requires_grad_() for _ in range(3))
        for _ in range(copies)
    ]
    padding = None
    if variant == "padding":
        padding = torch.arange(seq, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    providers = {
        "slimformer": Provider(
            lambda q, k, v: sf.attention(q, k, v, dropout_p=p, is_causal=causal, key_padding_mask=padding), inputs
        )
    }
    sdpa_mask = _sdpa_mask(padding, causal, seq)
    for name, backend in SDPA_BACKENDS.items():
        providers[name] = Provider(
            functools.partial(_sdpa, backend, sdpa_mask, p, causal and padding is None), inputs, baseline=True
        )
    if p == 0.0 and shape == (DRY_SHAPES if dry_run else FULL_SHAPES)[0]:
        providers["flex"] = Provider(
            _flex(lengths if padding is not None else None, causal, shape, device, dry_run),
            inputs,
            baseline=True,
            compiles=True,
        )
    if padding is not None:
        providers["slimformer varlen"] = _varlen(inputs, padding, lengths, causal)
    return providers


def _sdpa_mask(padding: torch.Tensor | None, causal: bool, seq: int) -> torch.Tensor | None:
    """SDPA's boolean mask (True: attend) for a key-padding mask: (b, 1, 1, s), or (b, 1, s, s)
    with the causal one (SDPA takes no is_causal beside a mask)."""
    if padding is None:
        return None
    keep = ~padding[:, None, None, :]
    if causal:
        keep = keep & torch.ones(seq, seq, dtype=torch.bool, device=padding.device).tril()
    return keep


def _sdpa(backend, mask, p, is_causal, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)


@functools.cache
def _compiled_flex(backend: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, backend=backend)


def _flex(lengths, causal: bool, shape, device, dry_run: bool):
    """FlexAttention compiled (``backend="eager"`` on a dry run: the same calls, no Inductor),
    with the causal / padding block mask, or none."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, seq, _ = shape
    flex = _compiled_flex("eager" if dry_run else "inductor")
    if lengths is None and not causal:
        return lambda q, k, v: flex(q, k, v)
    real = torch.tensor(lengths if lengths is not None else [seq] * batch, device=device)

    def allowed(b, h, q_idx, kv_idx):
        keep = kv_idx < real[b]
        return keep & (q_idx >= kv_idx) if causal else keep

    block_mask = create_block_mask(allowed, batch if lengths is not None else None, None, seq, seq, device=device)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def _varlen(inputs, padding: torch.Tensor, lengths: list[int], causal: bool) -> Provider:
    """``sf.varlen_attention`` on the real tokens of ``inputs``, packed (total, heads, head_dim)."""
    device = padding.device
    real = ~padding
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.tensor(lengths, device=device).cumsum(0)
    longest = max(lengths)
    packed = [tuple(t.detach().transpose(1, 2)[real].contiguous().requires_grad_() for t in copy) for copy in inputs]
    return Provider(
        lambda q, k, v: sf.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, longest, longest, is_causal=causal),
        packed,
    )
