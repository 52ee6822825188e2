"""The memory part of the report: what each norm keeps for backward in a real chain.

Each layer sits in ``Linear -> norm -> Linear`` (the place a Transformer puts it) and
``slimformer.memory`` measures the bytes the forward leaves for backward. The norm's
own share is that minus the same chain with no norm, in bytes per token per hidden
unit: torch's LayerNorm keeps its input (one activation) plus two fp32 statistics per
row, the memory-efficient slimformer norms only rstd.
"""

import torch
from torch import nn

import slimformer as sf
from slimformer.memory import measure_activation_memory

TOKENS, HIDDEN = 512, 768

NORMS = {
    "none (Linear -> Linear)": lambda: nn.Identity(),
    "torch.nn.LayerNorm": lambda: nn.LayerNorm(HIDDEN),
    "slimformer.LayerNorm": lambda: sf.LayerNorm(HIDDEN),
    "slimformer.LayerNorm(memory_efficient=False)": lambda: sf.LayerNorm(HIDDEN, memory_efficient=False),
    "torch.nn.RMSNorm": lambda: nn.RMSNorm(HIDDEN),
    "slimformer.RMSNorm": lambda: sf.RMSNorm(HIDDEN),
}


def _kept_bytes(norm: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    chain = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), norm, nn.Linear(HIDDEN, HIDDEN)).to(device, dtype)
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    kept = measure_activation_memory(chain, x)
    return max(kept.saved_bytes, kept.alive_bytes)


def norm_memory_table(device: torch.device, dtype: torch.dtype) -> tuple[list[str], list[list[str]]]:
    """(columns, rows): kept bytes of the chain and of the norm alone, per token per hidden unit."""
    kept = {name: _kept_bytes(make(), device, dtype) for name, make in NORMS.items()}
    baseline = kept["none (Linear -> Linear)"]
    per_unit = TOKENS * HIDDEN
    rows = [[name, f"{total / per_unit:.2f}", f"{(total - baseline) / per_unit:.3f}"] for name, total in kept.items()]
    columns = ["layer in Linear -> layer -> Linear", "chain B/token/hidden", "layer's own B/token/hidden"]
    return columns, rows
