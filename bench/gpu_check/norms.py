"""Norm rows: ``sf.LayerNorm`` / ``sf.RMSNorm`` normalising dropout(x) + residual, against
torch eager (``norm(F.dropout(x) + residual)``) and ``torch.compile`` of it, bf16,
16384 rows × 768 / 1024 / 4096, dropout 0.1, forward, backward and both.

The slimformer layers run as a model runs them: memory-efficient (the output is saved,
not the input), their memory mode decided once, at the first call.

GB/s = the bytes an ideal fused kernel moves (``norm_bytes``) / time, the same for every
provider, so each figure is a share of the measured copy bandwidth.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

import slimformer as sf
from bench.gpu_check.cases import MODES, Case, Provider

FULL = dict(rows=16384, hidden=(768, 1024, 4096))
DRY = dict(rows=64, hidden=(32, 48))
OPS = ("LayerNorm", "RMSNorm")
DROPOUT_P = 0.1
EPS = 1e-5


def norm_bytes(op: str, mode: str, rows: int, hidden: int, itemsize: int) -> int:
    """Bytes an ideal kernel reads and writes: with act = rows · hidden · itemsize,
    forward reads x and the residual and writes y (3 act), backward reads dy and the saved
    y and writes dx and d(residual), which differ under dropout (4 act); plus the weight
    (and bias) read, their gradients written, and the fp32 row statistics (rstd; LayerNorm
    also the mean in forward)."""
    act, vectors = rows * hidden * itemsize, (2 if op == "LayerNorm" else 1) * hidden * itemsize
    stats = 4 * rows * (2 if op == "LayerNorm" else 1)
    forward = 3 * act + vectors + stats
    backward = 4 * act + 2 * vectors + 4 * rows
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def cases(dry_run: bool, device: torch.device, copies: int) -> list[Case]:
    """LayerNorm at each hidden size, then RMSNorm."""
    sizes = DRY if dry_run else FULL
    dtype = torch.float32 if dry_run else torch.bfloat16
    return [
        Case(
            key=f"norm {op} {sizes['rows']}x{hidden}",
            family="norm",
            label=f"{op} {sizes['rows']} x {hidden}, residual + dropout {DROPOUT_P}",
            modes=MODES,
            unit="GB/s",
            work={mode: norm_bytes(op, mode, sizes["rows"], hidden, dtype.itemsize) for mode in MODES},
            build=functools.partial(_providers, op, sizes["rows"], hidden, dtype, dry_run, device, copies),
            params=dict(
                op=op, rows=sizes["rows"], hidden=hidden, dropout_p=DROPOUT_P, dtype=str(dtype).removeprefix("torch.")
            ),
        )
        for op in OPS
        for hidden in sizes["hidden"]
    ]


def _providers(op, rows, hidden, dtype, dry_run, device, copies) -> dict[str, Provider]:
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [
        tuple(
            torch.randn(rows, hidden, device=device, generator=generator).to(dtype).requires_grad_() for _ in range(2)
        )
        for _ in range(copies)
    ]
    ours = (sf.LayerNorm if op == "LayerNorm" else sf.RMSNorm)(hidden, eps=EPS, device=device, dtype=dtype)
    eager = DropoutAddNorm(
        (nn.LayerNorm if op == "LayerNorm" else nn.RMSNorm)(hidden, eps=EPS, device=device, dtype=dtype)
    )
    backend = "eager" if dry_run else "inductor"
    return {
        "slimformer": Provider(
            lambda x, residual: ours(x, residual, dropout_p=DROPOUT_P), inputs, params=tuple(ours.parameters())
        ),
        "torch": Provider(eager, inputs, params=tuple(eager.parameters()), baseline=True),
        "torch.compile": Provider(
            torch.compile(eager, dynamic=False, backend=backend),
            inputs,
            params=tuple(eager.parameters()),
            baseline=True,
            compiles=True,
        ),
    }


class DropoutAddNorm(nn.Module):
    """torch's statement of the fused op: norm(dropout(x) + residual)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(F.dropout(x, DROPOUT_P, training=True) + residual)
