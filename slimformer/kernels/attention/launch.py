"""Host-side pieces every attention launcher shares: grids, the kernels' flags and stride
arguments, mask arguments, TMA descriptors and output allocation."""

import functools
import math
import types

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from slimformer.kernels import dispatch
from slimformer.kernels.attention.tiles import ADDITIVE_MASK, BOOL_MASK, NO_MASK

MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0


def grid(num_blocks: int, heads: int, batch: int) -> tuple[int]:
    """The 1-d grid of ``tiles.tile_ids``: one program per block of every (batch, head), or
    of every (sequence, head) with ``num_blocks`` for the longest sequence."""
    programs = num_blocks * heads * batch
    if programs > MAX_PROGRAMS:
        raise ValueError(
            f"attention needs {programs} programs ({batch} batch x {heads} heads x {num_blocks} blocks), "
            f"more than CUDA's {MAX_PROGRAMS}; split the batch"
        )
    return (programs,)


def relative_bias_mask(relative_bias: torch.Tensor, centre: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A relative bias (heads, n) as the kernels' additive mask: a pointer at its centre and
    (batch, head, query, key) strides (0, head, −1, +1), so that the mask element of score
    (i, j) is ``relative_bias[h, centre + j − i]``: no (seq_q, seq_k) tensor is made."""
    return relative_bias[:, centre:], (0, relative_bias.stride(0), -1, 1)


def mask_args(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    q: torch.Tensor,
    seq_k: int,
    relative_bias: torch.Tensor | None = None,
) -> tuple[list, list, dict]:
    """The masks' pointer arguments, their stride arguments and their constexpr flags.

    ``attn_mask`` is expanded (a view, stride 0 on broadcast dims) so the kernels read
    it block by block; bool masks are viewed as uint8, which Triton loads natively. A
    ``relative_bias`` (heads, seq_q + seq_k − 1; never with an attn_mask) takes the attn_mask's
    place as an additive mask read along its diagonals (``relative_bias_mask``).
    """
    batch, heads, seq_q, _ = q.shape
    if relative_bias is not None:
        (mask, mask_strides), mask_kind = relative_bias_mask(relative_bias, seq_q - 1), ADDITIVE_MASK
    elif attn_mask is None:
        mask, mask_strides, mask_kind = None, (0, 0, 0, 0), NO_MASK
    else:
        mask = attn_mask.expand(batch, heads, seq_q, seq_k)
        mask_strides = mask.stride()
        if mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), BOOL_MASK
        else:
            mask_kind = ADDITIVE_MASK
    if key_padding_mask is None:
        kpm, kpm_strides = None, (0, 0)
    else:
        kpm, kpm_strides = key_padding_mask.view(torch.uint8), key_padding_mask.stride()
    # The kernels address a mask tile with int32 offsets from its first element.
    max_block = 128
    extent = (min(seq_q, max_block) - 1) * abs(mask_strides[2]) + (min(seq_k, max_block) - 1) * abs(mask_strides[3])
    if max(extent, (min(seq_k, max_block) - 1) * abs(kpm_strides[1])) >= 2**31:
        raise ValueError(
            f"attn_mask / key_padding_mask strides {tuple(mask_strides)} / {tuple(kpm_strides)} are too large "
            f"for the kernels' int32 offsets within a {max_block}x{max_block} tile"
        )
    flags = dict(MASK_KIND=mask_kind, HAS_KPM=kpm is not None)
    return [mask, kpm], [*mask_strides, *kpm_strides], flags


# What a launch without masks passes: varlen's, whose sequences are packed instead.
NO_MASK_ARGS = ([None, None], [0] * 6, dict(MASK_KIND=NO_MASK, HAS_KPM=False))


def varlen_mask_args(relative_bias: torch.Tensor | None, max_q: int) -> tuple[list, list, dict]:
    """Varlen's mask arguments: none, or a relative bias (heads, max_q + max_k − 1) read at
    ``max_q − 1 + j − i`` for row i and key j of every sequence."""
    if relative_bias is None:
        return NO_MASK_ARGS
    mask, strides = relative_bias_mask(relative_bias, max_q - 1)
    return [mask, None], [*strides, 0, 0], dict(MASK_KIND=ADDITIVE_MASK, HAS_KPM=False)


def window_args(window: int | None) -> dict:
    """The kernels' sliding-window arguments: none, or keys with |j − i| <= ``window``."""
    return {} if window is None else dict(window=window, HAS_WINDOW=True)


def kernel_flags(q: torch.Tensor, is_causal: bool, dropout_p: float) -> dict:
    """HAS_DROPOUT: 0 without dropout, 1 with, 2 with where the kernels' lane pairs share
    out Philox calls (``philox.dropout_mma_words``): in wgmma accumulators (sm_90's 16-bit
    dots), the layouts that ``tests/kernels/test_philox_layout.py`` proves the lane swap
    right in (on sm_80 Triton computes it in another)."""
    dropout = dropout_p > 0.0
    lane_pairs = dropout and q.dtype != torch.float32 and dispatch.device_target(q).arch // 10 == 9
    return dict(
        IS_CAUSAL=is_causal,
        HAS_DROPOUT=2 if lane_pairs else int(dropout),
        HEAD_DIM=q.shape[-1],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )


def stride_unit(*tensors: torch.Tensor) -> int:
    """The largest of 8, 4, 2, 1 elements dividing every stride but head_dim's ((batch,
    heads, seq), or varlen's (token, head)): the kernels take strides in these units, so
    Triton sees 16-byte aligned rows whenever head_dim % 8 == 0 (it only knows on its own
    that an int is a multiple of 16)."""
    strides = [stride for tensor in tensors for stride in tensor.stride()[:-1]]
    return next(unit for unit in (8, 4, 2, 1) if all(stride % unit == 0 for stride in strides))


def head_strides(unit: int, *tensors: torch.Tensor) -> list[int]:
    """The kernels' (batch, heads, seq) strides of each tensor in units of ``unit`` elements,
    flattened: those of a (batch, heads, seq, head_dim) tensor, or (0, head, token) of a
    packed (tokens, heads, head_dim) one, whose sequences the kernels find by cu_seqlens."""
    strides = []
    for tensor in tensors:
        if tensor.dim() == 3:
            strides += [0, tensor.stride(1) // unit, tensor.stride(0) // unit]
        else:
            strides += [stride // unit for stride in tensor.stride()[:3]]
    return strides


def tma_supported(x: torch.Tensor) -> bool:
    """Whether ``x``'s device has the Tensor Memory Accelerator (sm_90 and later)."""
    return x.is_cuda and dispatch.device_target(x).arch >= 90


def tma_descriptors(tensors, rows: tuple[int, ...], block_d: int) -> list[TensorDescriptor] | None:
    """Host-side TMA descriptors of (batch, heads, seq, head_dim) tensors of one dtype, each
    loading (1, 1, rows, block_d) boxes, or None where the kernels must use pointers: no
    TMA on the device, fp32 (its small tiles run on CUDA cores), or a base or a stride the
    copy engine cannot take (it needs both 16-byte aligned; broadcast dims, stride 0, are
    left to pointers too)."""
    first = tensors[0]
    if first.dtype == torch.float32 or not tma_supported(first):
        return None
    if any(x.data_ptr() % 16 for x in tensors):
        return None
    layouts = tuple((tuple(x.shape), x.stride()) for x in tensors)
    if not _tma_layouts(layouts, first.element_size(), rows, block_d):
        return None
    return [
        _descriptor(x, shape, strides, [1, 1, n, block_d]) for x, (shape, strides), n in zip(tensors, layouts, rows)
    ]


@functools.cache
def _tma_layouts(layouts: tuple, element_size: int, rows: tuple[int, ...], block_d: int) -> bool:
    """Whether every (shape, strides) of ``layouts`` can back a TMA descriptor loading
    (1, 1, n, block_d) boxes (n of ``rows``): ``TensorDescriptor``'s own checks, bar the
    base's alignment, made once per layout."""
    if any(s <= 0 or s * element_size % 16 for _, strides in layouts for s in strides[:-1]):
        return False
    for (shape, strides), n in zip(layouts, rows):
        TensorDescriptor(_Aligned(element_size), list(shape), list(strides), [1, 1, n, block_d])
    return True


class _Aligned:
    """A stand-in base for ``_tma_layouts``' check: 16-byte aligned, of ``element_size`` bytes."""

    def __init__(self, element_size: int):
        self.dtype = types.SimpleNamespace(itemsize=element_size, is_floating_point=True)

    def data_ptr(self) -> int:
        return 0


def _descriptor(base: torch.Tensor, shape, strides, block_shape: list[int]) -> TensorDescriptor:
    # TensorDescriptor's __post_init__ re-checks, each call, what _tma_layouts has checked
    # once for this layout and tma_descriptors for this base: a few µs per descriptor.
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(
        base=base, shape=list(shape), strides=list(strides), block_shape=block_shape, padding="zero"
    )
    return descriptor


def reference_dtype(q: torch.Tensor) -> torch.dtype:
    """The references' compute dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(q.dtype, torch.float32)


def empty_output(q: torch.Tensor) -> torch.Tensor:
    """An output shaped like q, (batch, heads, seq_q, head_dim), stored as (batch, seq_q,
    heads, head_dim) so that ``rearrange(out, "b h s d -> b s (h d)")`` is a view."""
    batch, heads, seq_q, head_dim = q.shape
    return torch.empty(batch, seq_q, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)


def empty_forward(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of an empty problem: zeros, and +inf as for rows with no allowed key."""
    lse = torch.full(q.shape[:3], math.inf, dtype=reference_dtype(q), device=q.device)
    return empty_output(q).zero_(), lse
