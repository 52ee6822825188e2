"""Which implementation runs a kernel: compiled Triton, interpreted Triton, or PyTorch."""

import functools
import os

import torch

# The dtypes every kernel takes as input (fp32 statistics and accumulators inside).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s op should launch the Triton kernel.

    CUDA tensors always do. CPU tensors do only under ``TRITON_INTERPRET=1`` (read at
    call time, so tests can switch a CPU op to its PyTorch reference); otherwise the
    PyTorch reference runs inside the same autograd.Function.
    """
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (a handful when interpreting)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
