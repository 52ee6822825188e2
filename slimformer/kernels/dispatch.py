"""Which implementation runs a kernel: compiled Triton, interpreted Triton, or PyTorch."""

import functools
import os
from typing import NamedTuple

import torch

# The dtypes every kernel takes as input (fp32 statistics and accumulators inside).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The PyTorch references work through big tensors in blocks of rows of about this many
# elements (4 MiB in fp32), as the kernels work in tiles, so that their temporaries (fp32
# upcasts, scores, the int64 Philox state) stay small next to the activations.
REFERENCE_BLOCK_ELEMENTS = 2**20


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s op should launch the Triton kernel.

    CUDA tensors always do. CPU tensors do only under ``TRITON_INTERPRET=1`` (read at
    call time, so tests can switch a CPU op to its PyTorch reference); otherwise the
    PyTorch reference runs inside the same autograd.Function.
    """
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device (None: cuda when available, else cpu).

    Raises ValueError naming the device when it is not a device name, or is a CUDA
    device that this torch cannot use (no GPU, or a CPU-only build).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        raise ValueError(f"device {str(device)!r} needs CUDA, which is not available here ({build}); use 'cpu'")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return resolved


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (a handful when interpreting)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


class DeviceTarget(NamedTuple):
    """What a launcher picks its block configs by: the compute capability as major · 10 +
    minor (80 = sm_80) and the shared memory a block may opt in to, in bytes."""

    arch: int
    shared_bytes: int


# What CPU tensors and interpreted launches report: sm_90 with its 227 KB, whose tables they keep.
INTERPRETED_TARGET = DeviceTarget(90, 227 * 1024)


def device_target(tensor: torch.Tensor) -> DeviceTarget:
    """The device query of every launcher that picks configs by architecture: ``tensor``'s
    CUDA device, or ``INTERPRETED_TARGET`` for CPU tensors and interpreted launches. Tests
    that emulate another device patch this one function (called as ``dispatch.device_target``)."""
    if not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETED_TARGET
    major, minor = torch.cuda.get_device_capability(tensor.device)
    shared_bytes = torch.cuda.get_device_properties(tensor.device).shared_memory_per_block_optin
    return DeviceTarget(major * 10 + minor, shared_bytes)


def reference_row_blocks(rows: int, row_elements: int) -> list[tuple[int, int]]:
    """(start, stop) of the blocks of rows a PyTorch reference works in, for rows of
    ``row_elements`` elements: about ``REFERENCE_BLOCK_ELEMENTS`` per block, at least one row."""
    step = max(1, REFERENCE_BLOCK_ELEMENTS // max(1, row_elements))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def absent_output(device: torch.device) -> torch.Tensor:
    """What a ``torch.library`` op returns for an output it does not produce (its schema
    cannot return None): a new empty fp32 tensor each time (an op's outputs must not
    alias each other); callers know from their flags to skip it."""
    return torch.empty(0, dtype=torch.float32, device=device)


def check_linear(weight, bias, in_features: int, x: torch.Tensor, weight_label: str, bias_label: str) -> None:
    """Raise ValueError / TypeError naming ``weight_label`` or ``bias_label`` unless ``weight`` is an
    (out_features, in_features) tensor and ``bias`` None or (out_features,), both on x's device
    in x's dtype."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != in_features:
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{weight_label} must have shape (out_features, {in_features}), got {shape}")
    for tensor, label in ((weight, weight_label), (bias, bias_label)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{label} must be on the input's device {x.device}, got {tensor.device}")
        if tensor.dtype != x.dtype:
            raise TypeError(f"{label} dtype must match input dtype {x.dtype}, got {tensor.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{bias_label} must have shape ({weight.shape[0]},), got {list(bias.shape)}")
