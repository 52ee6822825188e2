"""Which implementation runs a kernel: compiled Triton, interpreted Triton, or PyTorch."""

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

# The dtypes every kernel takes as input (fp32 statistics and accumulators inside).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The PyTorch references work through big tensors in blocks of rows of about this many
# elements (4 MiB in fp32), as the kernels work in tiles, so that their temporaries (fp32
# upcasts, scores, the int64 Philox state) stay small next to the activations.
REFERENCE_BLOCK_ELEMENTS = 2**20


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.6 makes it a ``constexpr_function``, whose
    wrapper costs about 1.6 µs a call on this project's CPU (launchers call it several
    times per launch); this is its formula without the wrapper."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``): 0 for 0, as Triton's."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


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
    return _cuda_target(tensor.get_device())


@functools.cache
def _cuda_target(index: int) -> DeviceTarget:
    # read once per device: a launch asks several times, and each query costs host time
    properties = torch.cuda.get_device_properties(index)
    return DeviceTarget(properties.major * 10 + properties.minor, properties.shared_memory_per_block_optin)


def forget_device_targets() -> None:
    """Drop the cached device targets (for code that emulates another device)."""
    _cuda_target.cache_clear()


def capturing_graph(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (no host reads then).
    Asks CUDA only for a CUDA device: a CPU-only build has no capture state to ask."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


# Tensor types the eager fast path below takes as they are (Parameters are plain tensors to
# the dispatcher); any other subclass (DTensor, FakeTensor, FunctionalTensor …) keeps the op's
# own dispatch.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args: tuple) -> bool:
    """True when a call with ``args`` runs in plain eager mode: not traced or compiled
    (torch.compile, export, jit.trace, make_fx), under no torch dispatch or torch-function
    mode (FakeTensorMode, FlopCounterMode, ``with torch.device(...)``), no functorch
    transform (vmap, grad), and with no tensor subclass among the arguments."""
    # is_compiling first: dynamo reads it as True and traces none of the calls after it
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._get_tracing_state() is not None
    ):
        return False
    return all(type(arg) in _PLAIN_TENSOR_TYPES for arg in args if isinstance(arg, torch.Tensor))


class DirectOp:
    """``op`` (a ``torch.library`` custom op) as the function to call it by: in plain eager
    mode (``plain_eager``) with grad mode off, its Python implementation is called directly,
    without the dispatcher's round trip (its Python autograd, ``fill_defaults`` and
    backend wrappers: most of a custom op's 10–30 µs per call); otherwise the op itself,
    which is what tracers, modes, subclasses and ``create_graph`` backwards see.

    The direct call gives the implementation what the dispatcher would: float arguments as
    Python floats (a Triton kernel specializes on an int's type), and the version counter of
    every argument the op mutates bumped.
    """

    def __init__(self, op):
        if set(op._backend_fns) != {None}:  # None: the function the op was made from
            raise ValueError(f"{op._qualname} has device kernels of its own, which a direct call would skip")
        self.op = op
        self.implementation = op._init_fn
        arguments = op._opoverload._schema.arguments
        self._floats = tuple(i for i, arg in enumerate(arguments) if str(arg.type) == "float")
        self._mutated = tuple(
            i for i, arg in enumerate(arguments) if arg.alias_info is not None and arg.alias_info.is_write
        )

    def __call__(self, *args):
        if not torch.is_grad_enabled() and plain_eager(args):
            return self.call_directly(args)
        return self.op(*args)

    def call_directly(self, args: tuple):
        """The implementation on ``args`` (the caller has checked plain eager mode and grad mode)."""
        if self._floats:
            args = list(args)
            for index in self._floats:
                if index < len(args):
                    args[index] = float(args[index])
        output = self.implementation(*args)
        for index in self._mutated:
            torch.autograd.graph.increment_version(args[index])
        return output


@functools.cache
def direct(op) -> DirectOp:
    """``op``'s ``DirectOp`` (one per op): how an autograd formula calls its backward op."""
    return DirectOp(op)


def eager_autograd(op, backward: Callable, setup_context: Callable) -> Callable:
    """Registers ``backward`` and ``setup_context`` as ``op``'s autograd formula (what every
    tracer, mode and subclass sees) and returns the function to call the op by.

    In plain eager mode (``plain_eager``) that function calls the op's implementation
    directly (``DirectOp``): through an ``autograd.Function`` of its own running the same
    formula when there are gradients to record, under ``no_grad`` otherwise. The kernels,
    outputs and saved tensors are the op's; torch's generated autograd wrapper and the
    dispatcher's round trip are skipped (``backward`` calls its backward op through a
    ``DirectOp`` to skip it there too). Only the graph node's class differs. Anywhere else
    the op itself is called.
    """
    op.register_autograd(backward, setup_context=setup_context)
    direct_op = direct(op)

    def forward(ctx, *args):
        output = direct_op.call_directly(args)
        setup_context(ctx, args, output)
        return output

    function = type(
        f"Eager_{backward.__name__.lstrip('_')}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )

    def call(*args):
        if not plain_eager(args):
            return op(*args)
        if not torch.is_grad_enabled():
            return direct_op.call_directly(args)
        if torch._C._any_requires_grad(*args):
            return function.apply(*args)
        with torch.no_grad():
            return direct_op.call_directly(args)

    return call
