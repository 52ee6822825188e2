"""Dropout randomness shared by every kernel: seeds and Triton's Philox in PyTorch.

Dropout masks are never stored. Forward draws one int64 seed tensor from torch's
generator (so ``torch.manual_seed`` reproduces it); each element's keep decision is
``tl.rand(seed, offset) >= p`` with ``offset`` its flat index in the tensor, so the
backward pass regenerates the very same mask from the saved seed.

``philox_uniform`` reproduces ``tl.rand`` bit for bit (Philox-4x32, 10 rounds, the
first output word mapped to [0, 1) the way ``triton.language.random`` does), so the
PyTorch reference path draws the same masks as the Triton kernels on any device.
"""

import torch

_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_LOW32 = 0xFFFFFFFF
_INT32_TO_UNIT = 4.6566127342e-10  # the largest scale keeping (2**31 - 1) * scale < 1 in fp32


def new_dropout_seed(device: torch.device) -> torch.Tensor:
    """A fresh int64 seed (shape ()) from torch's generator on ``device``, no host sync."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    # uint32 * uint32 fits in 64 bits; int64 wraps with the same bit pattern, so the
    # high word is recovered by shifting and masking, whatever the sign bit became.
    product = a * b
    return (product >> 32) & _LOW32, product & _LOW32


def philox_uniform(seed: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offsets)`` in PyTorch: fp32 uniforms in [0, 1), shape of ``offsets``.

    seed: int64 tensor, shape (); offsets: int64 tensor, any shape, values >= 0.
    """
    seed = seed.to(torch.int64)
    key0, key1 = seed & _LOW32, (seed >> 32) & _LOW32
    c0, c1 = offsets & _LOW32, (offsets >> 32) & _LOW32
    c2 = torch.zeros_like(offsets)
    c3 = torch.zeros_like(offsets)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ key0, lo_b, hi_a ^ c3 ^ key1, lo_a
        key0 = (key0 + _PHILOX_KEY_A) & _LOW32
        key1 = (key1 + _PHILOX_KEY_B) & _LOW32
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * torch.tensor(_INT32_TO_UNIT, dtype=torch.float32)


def dropout_keep_mask(seed: torch.Tensor, offsets: torch.Tensor, p: float) -> torch.Tensor:
    """Bool keep-mask ``uniform >= p`` for the elements at ``offsets`` (same as the kernels)."""
    return philox_uniform(seed, offsets) >= torch.tensor(p, dtype=torch.float32)
