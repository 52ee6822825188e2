"""Block configs of the attention kernels: one table per architecture, and the picker.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M indexes queries and BLOCK_N
keys in every kernel. A table row is (largest BLOCK_D, plain config, masked config, dropout
config): "masked" launches (attn_mask or key_padding_mask, with or without dropout) hold
more per-element state, "dropout" launches (dropout alone) make their keep bits in the
score tile's registers. Every entry was picked by compiling the runtime specialisations
(``make compile-report``; the reasons, spills and instruction counts of each choice are in
bench/results/compile-sm90.md, compile-sm80.md and compile-sm90-varlen.md): the dots on the
architecture's tensor cores, at least two pipeline stages, shared memory within the
device's limit, and no register spills where some config avoids them (unless the spill
lies outside the loops and the spill-free tile costs more per tile).
"""

import functools
from typing import NamedTuple

import torch

from slimformer.kernels.dispatch import INTERPRETED_TARGET, next_power_of_2

KERNELS = ("fwd", "dkdv", "dkdv_dq", "dq")  # "dkdv_dq": dK/dV adding dQ with atomics
CONFIG_KINDS = ("plain", "masked", "dropout")
SM80_SHARED_BYTES = 163 * 1024  # opt-in shared memory per block; sm_90 has 227 KB


class ConfigTable(NamedTuple):
    """The configs of one architecture."""

    tensor_core: dict  # kernel -> rows (largest BLOCK_D, plain, masked, dropout), 16-bit inputs
    fp32: tuple  # rows (largest BLOCK_D, config): fp32 dots run exactly, on CUDA cores
    grouped: dict  # dK/dV kernel -> rows (largest BLOCK_D, config) of plain GQA launches
    grouped_dropout: dict  # BLOCK_M / BLOCK_N caps of GQA dK/dV launches with dropout at BLOCK_D >= 128
    varlen: dict  # (kernel, BLOCK_D, kind) -> config where varlen's per-sequence bounds spill the dense one


# sm_90 (H100, wgmma). dK/dV's dots have BLOCK_N rows (wgmma needs 64 per warpgroup); at
# d256 its dk, dv, k and v only fit 32 x 32 tiles on mma.sync.
SM90 = ConfigTable(
    tensor_core={
        "fwd": (
            (64, (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)),
            (128, (128, 128, 8, 3), (64, 16, 4, 2), (128, 128, 8, 3)),
            (256, (128, 32, 8, 3), (128, 16, 8, 2), (128, 32, 8, 3)),
        ),
        "dkdv": (
            (64, (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2)),
            (128, (32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 2)),
            (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
        ),
        "dkdv_dq": (
            (64, (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2)),
            (128, (32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 2)),
            (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
        ),
        "dq": (
            (64, (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 2)),
            (128, (128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)),
            (256, (128, 32, 8, 2), (128, 16, 8, 2), (128, 32, 8, 2)),
        ),
    },
    fp32=((256, (32, 32, 8, 1)),),
    # the loop over a group's query heads keeps more live: fewer query rows
    grouped={
        "dkdv": ((64, (32, 128, 8, 2)), (128, (16, 128, 8, 2)), (256, (32, 32, 8, 2))),
        "dkdv_dq": ((64, (16, 128, 8, 2)), (128, (16, 128, 8, 2)), (256, (32, 32, 8, 2))),
    },
    grouped_dropout=dict(BLOCK_M=16),
    varlen={
        ("fwd", 128, "plain"): (128, 128, 8, 2),
        ("fwd", 128, "dropout"): (128, 64, 8, 2),
        ("dkdv", 128, "dropout"): (16, 128, 8, 2),
        ("dkdv_dq", 128, "dropout"): (16, 128, 8, 2),  # holds more than dkdv: its tiles too
    },
)

# sm_80 (A100, mma.sync): its accumulators live in registers, so smaller tiles than sm_90's.
SM80 = ConfigTable(
    tensor_core={
        "fwd": (
            (64, (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3)),
            (128, (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
            (256, (64, 32, 4, 3), (64, 32, 8, 2), (64, 32, 8, 3)),
        ),
        "dkdv": (
            (64, (32, 128, 8, 2), (16, 128, 8, 2), (16, 128, 8, 2)),
            (128, (32, 64, 8, 2), (32, 64, 8, 2), (32, 64, 8, 2)),
            (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
        ),
        # 16 query rows hold the transient fp32 dQ tile without spills
        "dkdv_dq": (
            (64, (16, 128, 8, 2), (16, 128, 8, 2), (16, 128, 8, 2)),
            (128, (16, 64, 8, 2), (16, 64, 8, 2), (16, 64, 8, 2)),
            (256, (32, 32, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
        ),
        "dq": (
            (64, (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 2)),
            (128, (128, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)),
            (256, (64, 32, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2)),
        ),
    },
    fp32=((256, (32, 32, 8, 1)),),
    grouped={},  # its plain dK/dV tiles do not spill with GQA
    grouped_dropout=dict(BLOCK_M=16, BLOCK_N=64),
    varlen={("dkdv", 256, "plain"): (64, 32, 8, 2), ("dq", 128, "dropout"): (64, 32, 4, 2)},
)

# 99 KB of shared memory per block (compute capability 8.6 / 8.9: RTX 30xx / 40xx, A10, L4):
# sm_80's table where it fits.
SMALL_SHARED = SM80._replace(
    tensor_core={
        **SM80.tensor_core,
        "fwd": (
            (64, (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3)),
            (128, (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
            (256, (32, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 3)),
        ),
        "dq": (
            (64, (128, 64, 8, 2), (128, 32, 8, 2), (128, 16, 8, 2)),
            (128, (128, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)),
            (256, (32, 32, 4, 2), (64, 16, 8, 2), (32, 32, 4, 2)),
        ),
    },
    fp32=((128, (32, 32, 8, 1)), (256, (16, 16, 4, 1))),
    varlen={("dq", 128, "dropout"): (64, 32, 4, 2)},
)


def config_table(arch: int, shared_bytes: int) -> ConfigTable:
    """The table of a device of compute capability ``arch`` (major · 10 + minor) with
    ``shared_bytes`` of shared memory per block: the 99 KB one below sm_80's 163 KB, else
    sm_80's for 8.x and sm_90's for the rest."""
    if shared_bytes < SM80_SHARED_BYTES:
        return SMALL_SHARED
    return SM80 if arch // 10 == 8 else SM90


def config_kind(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, dropout_p: float) -> str:
    """Which of ``CONFIG_KINDS`` a launch takes: "masked" with any mask, else "dropout" with
    dropout, else "plain"."""
    if attn_mask is not None or key_padding_mask is not None:
        return "masked"
    return "dropout" if dropout_p > 0.0 else "plain"


def launch_kind(attn_mask, relative_bias, window, key_padding_mask, dropout_p: float) -> str:
    """``config_kind`` of a launch: a relative bias reads as an attn_mask does, and a sliding
    window makes every tile an edge tile (compares, as a mask's)."""
    if window is not None:
        return "masked"
    return config_kind(attn_mask if relative_bias is None else relative_bias, key_padding_mask, dropout_p)


def block_config(
    head_dim: int,
    dtype: torch.dtype,
    kernel: str,
    kind: str,
    arch: int = INTERPRETED_TARGET.arch,
    shared_bytes: int = INTERPRETED_TARGET.shared_bytes,
    grouped: bool = False,
    varlen: bool = False,
) -> dict:
    """Launch options (BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of ``kernel`` (one of
    ``KERNELS``) for a launch of ``kind`` (``config_kind``) on a device of compute capability
    ``arch`` with ``shared_bytes`` per block (``dispatch.device_target``); ``grouped``: a
    dK/dV launch with fewer kv heads than query heads (GQA); ``varlen``: packed sequences.

    BLOCK_D is the head dim padded to a power of two >= 16, as ``tl.dot`` and ``tl.arange``
    need; the padding lanes load as zeros. A new dict each call, looked up once per
    distinct argument tuple (every launch asks).
    """
    return dict(_block_config(head_dim, dtype, kernel, kind, arch, shared_bytes, grouped, varlen))


@functools.cache
def _block_config(head_dim, dtype, kernel, kind, arch, shared_bytes, grouped, varlen) -> dict:
    block_d = max(16, next_power_of_2(head_dim))
    table = config_table(arch, shared_bytes)
    if dtype == torch.float32:
        _, config = next(row for row in table.fp32 if block_d <= row[0])
    elif grouped and kind == "plain" and kernel in table.grouped:
        _, config = next(row for row in table.grouped[kernel] if block_d <= row[0])
    else:
        _, *configs = next(row for row in table.tensor_core[kernel] if block_d <= row[0])
        config = configs[CONFIG_KINDS.index(kind)]
        if varlen:
            config = table.varlen.get((kernel, block_d, kind), config)
    block_m, block_n, num_warps, num_stages = config
    if grouped and kind == "dropout" and block_d >= 128 and kernel in ("dkdv", "dkdv_dq"):
        block_m = table.grouped_dropout["BLOCK_M"]
        block_n = min(block_n, table.grouped_dropout.get("BLOCK_N", block_n))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages)
