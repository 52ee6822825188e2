"""DeBERTa rows: ``sf.disentangled_attention`` against HF DeBERTa-v2's eager attention math,
bf16, forward, backward and both.

Shape: DeBERTa-v3-base's attention at seq 512, (batch, heads, seq, head_dim) = (8, 12, 512,
64), position_buckets 256 (512 position rows), both terms; variants ``dense``, ``dropout``
(0.1) and ``padding`` (~50% of the keys, ``attention.padded_lengths``). Providers:

- ``slimformer``: the fused kernel (q, k, v and both position tensors get gradients);
- ``HF eager``: what ``DisentangledSelfAttention`` computes from the same tensors: the
  c2p and p2c products, their gathers at the bucketed positions, the masked softmax,
  dropout and PV, as its eager code does them (the baseline);
- ``sf.attention (no positions)``: plain attention on the same q, k, v, to read the
  kernel's cost per tile relative to FlashAttention-2's.

FLOPs as HF counts its GEMMs: forward 4·b·h·s²·d (QKᵀ, PV) plus 2 · 2·b·h·s·P·d (the c2p
and p2c products against all P position rows); backward 2.5x, both 3.5x.
"""

import functools
import math

import torch

import slimformer as sf
from bench.gpu_check.attention import DROPOUT_P, MODE_FACTOR, padded_lengths
from bench.gpu_check.cases import MODES, Case, Provider
from slimformer.kernels.attention.disentangled import relative_position_index

FULL_SHAPE, DRY_SHAPE = (8, 12, 512, 64), (2, 2, 64, 16)
FULL_BUCKETS, DRY_BUCKETS = 256, 16
VARIANTS = ("dense", "dropout", "padding")


def disentangled_flops(mode: str, batch: int, heads: int, seq: int, head_dim: int, rows: int) -> float:
    forward = 4 * batch * heads * seq * seq * head_dim + 4 * batch * heads * seq * rows * head_dim
    return forward * MODE_FACTOR[mode]


def cases(dry_run: bool, device: torch.device, copies: int) -> list[Case]:
    shape, buckets = (DRY_SHAPE, DRY_BUCKETS) if dry_run else (FULL_SHAPE, FULL_BUCKETS)
    return [_case(shape, buckets, variant, device, dry_run, copies) for variant in VARIANTS]


def _case(shape, buckets: int, variant: str, device, dry_run: bool, copies: int) -> Case:
    batch, heads, seq, head_dim = shape
    name = f"deberta b{batch} h{heads} s{seq} d{head_dim} buckets{buckets} {variant}"
    return Case(
        key=f"disentangled {name}",
        family="attention",
        label=name,
        modes=MODES,
        unit="TFLOP/s",
        work={mode: disentangled_flops(mode, batch, heads, seq, head_dim, 2 * buckets) for mode in MODES},
        build=functools.partial(_providers, shape, buckets, variant, device, dry_run, copies),
        params=dict(
            batch=batch,
            heads=heads,
            seq=seq,
            head_dim=head_dim,
            position_buckets=buckets,
            variant=variant,
            dropout_p=DROPOUT_P if variant == "dropout" else 0.0,
            dtype="bfloat16",
        ),
    )


def _providers(shape, buckets: int, variant: str, device, dry_run: bool, copies: int) -> dict[str, Provider]:
    batch, heads, seq, head_dim = shape
    dtype = torch.float32 if dry_run else torch.bfloat16
    p = DROPOUT_P if variant == "dropout" else 0.0
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(*size):
        return torch.randn(size, device=device, generator=generator).to(dtype).requires_grad_()

    inputs = [
        (
            *(tensor(*shape) for _ in range(3)),
            tensor(heads, 2 * buckets, head_dim),
            tensor(heads, 2 * buckets, head_dim),
        )
        for _ in range(copies)
    ]
    padding = None
    if variant == "padding":
        lengths = torch.tensor(padded_lengths(batch, seq), device=device)
        padding = torch.arange(seq, device=device)[None, :] >= lengths[:, None]
    scale = 1.0 / math.sqrt(3 * head_dim)
    positions = dict(position_buckets=buckets, max_relative_positions=2 * buckets)

    def fused(q, k, v, pk, pq):
        return sf.disentangled_attention(
            q, k, v, pk, pq, **positions, key_padding_mask=padding, dropout_p=p, scale=scale
        )

    index = relative_position_index(seq, seq, buckets, buckets, 2 * buckets, device).long()
    rows, cols = torch.meshgrid(torch.arange(seq, device=device), torch.arange(seq, device=device), indexing="ij")
    gather_at = index[rows - cols + seq - 1].expand(batch * heads, seq, seq)
    hf_eager = functools.partial(_hf_eager, gather_at, padding, p, scale)
    plain = [x[:3] for x in inputs]
    return {
        "slimformer": Provider(fused, inputs),
        "HF eager": Provider(hf_eager, inputs, baseline=True),
        "sf.attention (no positions)": Provider(
            lambda q, k, v: sf.attention(q, k, v, dropout_p=p, key_padding_mask=padding, scale=scale), plain
        ),
    }


def _hf_eager(gather_at, padding, p, scale, q, k, v, pk, pq):
    """DisentangledSelfAttention's eager computation on given q, k, v and position tensors."""
    batch, heads, seq, head_dim = q.shape
    q3, k3, v3 = (x.reshape(batch * heads, seq, head_dim) for x in (q, k, v))
    pk3, pq3 = (x.repeat(batch, 1, 1) for x in (pk, pq))
    scores = torch.bmm(q3, k3.mT * scale)
    scores = scores + torch.gather(torch.bmm(q3, pk3.mT), -1, gather_at) * scale
    scores = scores + torch.gather(torch.bmm(k3, pq3.mT), -1, gather_at.mT).mT * scale
    scores = scores.view(batch, heads, seq, seq)
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.nn.functional.dropout(torch.softmax(scores, -1), p)
    return torch.bmm(probs.view(batch * heads, seq, seq), v3).view(batch, heads, seq, head_dim)
