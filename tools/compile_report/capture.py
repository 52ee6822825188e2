"""Capture the Triton launches slimformer's launchers make on a GPU, without a GPU.

``emulate_cuda(device)`` runs the public ops on CPU tensors as if they lived on an
H100 or A100: ``Tensor.is_cuda`` is True (so ops pick their Triton launcher and every
``is_cuda``-dependent flag takes its GPU value), ``multiprocessor_count`` and
``torch.cuda.get_device_properties`` / ``get_device_capability`` answer for the emulated
device, and ``JITFunction.run`` records the launch instead of running it.
Autotuned kernels record every config that survives the autotuner's pruning (each one
is compiled and benchmarked on a GPU); ``triton.heuristics`` wrappers run unchanged.

Each recorded launch is specialised by the JIT's own binder and ``_pack_args``, with the
CUDA backend of the emulated target: pointer arguments are 16-byte aligned when
``data_ptr() % 16 == 0`` (CPU tensors are 64-byte aligned like CUDA's 256-byte aligned
allocations, so views at an offset keep the alignment they would have on the GPU), ints
divisible by 16 get ``tt.divisibility``, ints equal to 1 become constexprs, and the
options are what ``backend.parse_options`` makes of the launch's keyword arguments
(num_warps, num_stages, ...). ``compile_launch`` then builds exactly
``ASTSource(fn, signature, constexprs, attrs)`` with those options, as
``JITFunction._do_compile`` does.

The JIT decides at decoration time whether a kernel is interpreted, so all this needs a
process where TRITON_INTERPRET is unset before slimformer is imported.
"""

import contextlib
import importlib
import importlib.util
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature


@dataclass(frozen=True)
class Device:
    """An emulated CUDA device: what launchers may ask about it, and its limits."""

    name: str
    arch: int  # compute capability, 90 = sm_90
    multiprocessors: int
    max_shared_bytes: int  # opt-in shared memory per block
    clock_ghz: float  # boost clock, for the instruction-issue model
    dense_16bit_tflops: float  # published fp16/bf16 tensor-core peak (dense)
    hbm_tbytes_per_s: float  # published memory bandwidth
    registers_per_sm: int = 65536
    l2_cache_mib: int = 40

    @property
    def target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    @property
    def sm(self) -> str:
        return f"sm{self.arch}"


H100 = Device("NVIDIA H100 80GB HBM3", 90, 132, 227 * 1024, 1.755, 989.0, 3.35, l2_cache_mib=50)
A100 = Device("NVIDIA A100-SXM4-80GB", 80, 108, 163 * 1024, 1.410, 312.0, 2.039)
# compute capability 8.6 (8.9 has the same 99 KB per block): RTX 30xx/40xx, A10, L4
A10 = Device("NVIDIA A10", 86, 72, 99 * 1024, 1.695, 125.0, 0.6, l2_cache_mib=6)
DEVICES = {"sm90": H100, "sm80": A100, "sm86": A10}


@dataclass
class Launch:
    """One kernel launch as the JIT would specialise it (JSON-serialisable).

    ``constexprs`` and ``attrs`` are keyed by argument path (JSON lists of ints), dtype
    constexprs are stored as ``{"tl_dtype": name}``; ``option_kwargs`` are the launch's
    keyword arguments that are not kernel parameters (num_warps, num_stages, ...).
    """

    module: str
    kernel: str
    source_file: str
    signature: dict
    constexprs: list
    attrs: list
    option_kwargs: dict
    grid: list
    arch: int
    case: str = ""
    phase: str = ""  # "fwd" or "bwd"
    note: str = ""  # e.g. "autotune config 2/5"
    arg_values: dict = field(default_factory=dict)  # scalar args (ints, floats), for derived figures
    tensor_bytes: dict = field(default_factory=dict)  # pointer arg -> bytes of the memory it spans

    def key(self) -> str:
        """Identity of the compiled binary: same key, same cubin."""
        return json.dumps(
            [self.module, self.kernel, self.signature, self.constexprs, self.attrs, self.option_kwargs, self.arch],
            sort_keys=True,
        )

    def named_constexprs(self) -> dict:
        """{parameter name: value} of the top-level constexprs (dtypes as their names)."""
        names = list(self.signature)
        return {names[path[0]]: decode_constexpr(value) for path, value in self.constexprs if len(path) == 1}

    def to_json(self) -> dict:
        return asdict(self)


def _encode(value):
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, tl.constexpr):
        return _encode(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record constexpr value {value!r} of type {type(value).__name__}")


def decode_constexpr(value):
    """A recorded constexpr as the compiler takes it: ``{"tl_dtype": name}`` back to its ``tl.dtype``."""
    if isinstance(value, dict) and "tl_dtype" in value:
        return tl.dtype(value["tl_dtype"])
    return value


def _record_launch(fn: JITFunction, args, kwargs, grid, device: Device) -> Launch:
    """What ``JITFunction.run`` computes before compiling, for ``device``'s backend."""
    from triton import knobs
    from triton.compiler.compiler import make_backend

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    backend = make_backend(device.target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    if callable(grid):
        grid = grid(bound_args)
    scalars = {
        name: value
        for name, value in bound_args.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and signature.get(name) != "constexpr"
    }
    tensors = {
        name: _unique_bytes(getattr(value, "base", value))  # a TMA descriptor's tensor
        for name, value in bound_args.items()
        if isinstance(getattr(value, "base", value), torch.Tensor)
    }
    option_kwargs = {k: _encode(v) for k, v in kwargs.items() if k not in signature}
    return Launch(
        module=fn.fn.__module__,
        kernel=fn.fn.__name__,
        source_file=os.path.abspath(fn.fn.__code__.co_filename),
        signature=signature,
        constexprs=[[list(path), _encode(value)] for path, value in constexprs.items()],
        attrs=[[list(path), value] for path, value in attrs.items()],
        option_kwargs=option_kwargs,
        grid=[int(g) for g in grid],
        arch=device.arch,
        arg_values=scalars,
        tensor_bytes=tensors,
    )


def _unique_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements a (possibly broadcast) view covers."""
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            count *= size
    return count * tensor.element_size()


def _fake_properties(device: Device) -> SimpleNamespace:
    return SimpleNamespace(
        name=device.name,
        major=device.arch // 10,
        minor=device.arch % 10,
        multi_processor_count=device.multiprocessors,
        shared_memory_per_block_optin=device.max_shared_bytes,
        shared_memory_per_multiprocessor=device.max_shared_bytes + 1024,
        regs_per_multiprocessor=device.registers_per_sm,
        warp_size=32,
        total_memory=80 * 2**30,
        L2_cache_size=device.l2_cache_mib * 2**20,
    )


@contextlib.contextmanager
def _patched(obj, name, value) -> Iterator[None]:
    """Set ``obj.name`` for the block; restore (or remove) it after."""
    missing = object()
    old = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


class _EmulatedDriver:
    """What launchers may ask Triton's active driver, answered for an emulated device."""

    def __init__(self, device: Device):
        self.device = device
        self.utils = SimpleNamespace(get_device_properties=self._properties)

    def _properties(self, _device=0) -> dict:
        return dict(
            max_shared_mem=self.device.max_shared_bytes,
            multiprocessor_count=self.device.multiprocessors,
            max_num_regs=self.device.registers_per_sm,
            warpSize=32,
            sm_clock_rate=int(self.device.clock_ghz * 1e6),
        )

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self.device.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, _device=None) -> int:
        return 0

    def get_device_capability(self, _device=None) -> tuple[int, int]:
        return self.device.arch // 10, self.device.arch % 10


@contextlib.contextmanager
def emulated_driver(device: Device) -> Iterator[None]:
    """Triton's ``driver.active`` answers for ``device`` within the block."""
    from triton.runtime.driver import driver

    saved = driver._active
    driver.set_active(_EmulatedDriver(device))
    try:
        yield
    finally:
        driver._active = saved


@contextlib.contextmanager
def emulated_device(device: Device) -> Iterator[None]:
    """Within the block, CPU tensors say they are CUDA tensors and every device query a
    launcher may make (torch.cuda properties and capability, the SM count, Triton's
    driver) answers for ``device``."""
    properties = _fake_properties(device)
    patches = [
        (torch.Tensor, "is_cuda", property(lambda self: True)),
        (torch.cuda, "get_device_properties", lambda *a, **k: properties),
        (torch.cuda, "get_device_capability", lambda *a, **k: (device.arch // 10, device.arch % 10)),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
    ]
    # Launchers size grids by the SM count (``dispatch.multiprocessor_count``, which says
    # a handful for a CPU tensor): answer the emulated device's, wherever it was imported.
    from slimformer.kernels import dispatch

    original_count = dispatch.multiprocessor_count
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("slimformer") and m is not None]:
        for name, value in list(vars(module).items()):
            if value is original_count:
                patches.append((module, name, lambda _device: device.multiprocessors))
    # the device target is read once per device index and cached: forget it on the way in
    # and out, so that neither the emulated device's nor the real one's answer outlives its block
    stack = contextlib.ExitStack()
    stack.callback(dispatch.forget_device_targets)
    with stack:
        dispatch.forget_device_targets()
        for obj, name, value in patches:
            stack.enter_context(_patched(obj, name, value))
        stack.enter_context(emulated_driver(device))
        yield


@contextlib.contextmanager
def emulate_cuda(device: Device, sink: Callable[[Launch], None]) -> Iterator[None]:
    """Within the block, ops on CPU tensors take their CUDA launch path on ``device``
    (``emulated_device``) and every kernel launch is recorded into ``sink``, never run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("launch capture needs compiled (not interpreted) Triton: unset TRITON_INTERPRET")
    note = {"value": ""}

    def run(self, *args, grid, warmup, **kwargs):
        launch = _record_launch(self, args, kwargs, grid, device)
        launch.note = note["value"]
        sink(launch)

    def autotuned_run(self, *args, **kwargs):
        # Every config the autotuner would compile and time for these arguments.
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        try:
            for i, config in enumerate(configs):
                note["value"] = f"autotune config {i + 1}/{len(configs)}"
                if config.pre_hook is not None:  # e.g. sets a TMA descriptor's block shape
                    config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            note["value"] = ""
            self.nargs = None

    with _patched(JITFunction, "run", run), _patched(Autotuner, "run", autotuned_run), emulated_device(device):
        yield


@contextlib.contextmanager
def stub_launches(device: Device) -> Iterator[None]:
    """As ``emulate_cuda``, but every kernel launch returns at once, unrecorded: what is left
    of a call is its host side up to the launch (the launch itself, Triton's cached
    ``CompiledKernel.run`` and the driver's few µs, is not counted)."""

    def skip(self, *args, **kwargs):
        return None

    with _patched(JITFunction, "run", skip), _patched(Autotuner, "run", skip), emulated_device(device):
        yield


class TorchTraffic(TorchDispatchMode):
    """Bytes the PyTorch ops slimformer itself runs read and write (the memsets, reductions
    and casts around its kernels); ops of the caller and of autograd are not counted."""

    _FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "randn", "randn_like",
             "randint", "normal_", "uniform_", "random_", "detach", "alias", "lift_fresh", "set_"}  # fmt: skip
    _WRITE_ONLY = {"fill_", "zero_"}
    # The launches are recorded, not run, so every tensor a kernel writes holds garbage and
    # so would the products of these: their outputs are left unwritten (shapes from the
    # meta device), which saves minutes of CPU GEMMs in bf16 (a 300 x 768 x 30522 loss).
    _GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_int_mm"}

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = Counter()
        self._package = os.path.dirname(importlib.import_module("slimformer").__file__)

    def _called_from_slimformer(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self._package):
                return True
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        custom = _maybe_get_opdef(func) if func.namespace == "slimformer" else None
        if custom is not None:
            # one of slimformer's own ops: what it moves is its kernels' and its torch calls', counted there
            with self:
                return custom._init_fn(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self._GEMMS:
            meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            meta = func(*meta_args, **meta_kwargs)  # checks the shapes as the op would
            out = kwargs.get("out")
            if out is None:
                out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device)
        else:
            out = func(*args, **kwargs)
        if func.is_view or name in self._FREE or not self._called_from_slimformer():
            return out
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in self._WRITE_ONLY:
            inputs = []
        elif name == "copy_":
            inputs = inputs[1:]
        traffic = sum(_unique_bytes(t) for t in inputs) + sum(_unique_bytes(t) for t in outputs)
        self.bytes += traffic
        self.ops[name] += traffic
        return out


@dataclass
class Capture:
    """The launches of one case on one device and the PyTorch-op traffic around them, per phase."""

    launches: list
    torch_bytes: dict  # phase -> bytes
    torch_ops: dict  # phase -> {op name: bytes}


def capture(device: Device, forward: Callable[[], Callable[[], None] | None], case: str = "") -> Capture:
    """The launches ``forward()`` and then the backward it returns (if any) make on
    ``device``, in order, labelled with ``case`` and their phase ("fwd" / "bwd")."""
    launches: list[Launch] = []
    traffic = {"fwd": TorchTraffic(), "bwd": TorchTraffic()}
    with emulate_cuda(device, launches.append):
        with traffic["fwd"]:
            backward = forward()
        n_forward = len(launches)
        if backward is not None:
            with traffic["bwd"]:
                backward()
    for i, launch in enumerate(launches):
        launch.case = case
        launch.phase = "fwd" if i < n_forward else "bwd"
    return Capture(launches, {p: t.bytes for p, t in traffic.items()}, {p: dict(t.ops) for p, t in traffic.items()})


def load_module_from_file(name: str, path: str, device: Device):
    """Import a module that is not on the path (a reference kernel kept elsewhere) on the
    emulated ``device``, as some modules query the device at import."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with emulated_device(device):
        spec.loader.exec_module(module)
    return module


def load_kernel(launch: Launch) -> JITFunction:
    """The JITFunction a launch was recorded from (imported by module, else from its file)."""
    try:
        module = importlib.import_module(launch.module)
    except ImportError:
        device = next(d for d in DEVICES.values() if d.arch == launch.arch)
        module = load_module_from_file(launch.module, launch.source_file, device)
    kernel = getattr(module, launch.kernel)
    while not isinstance(kernel, JITFunction):  # unwrap triton.autotune / triton.heuristics
        kernel = kernel.fn
    return kernel


def _source_of_launch(launch: Launch):
    """(ASTSource, target, backend, options) of ``launch``, specialised as the JIT does."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", launch.arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({k: decode_constexpr(v) for k, v in launch.option_kwargs.items()})
    constexprs = {tuple(path): decode_constexpr(value) for path, value in launch.constexprs}
    attrs = {tuple(path): value for path, value in launch.attrs}
    return ASTSource(load_kernel(launch), launch.signature, constexprs, attrs), target, backend, options


def compile_launch(launch: Launch):
    """Compile ``launch`` exactly as the JIT would on its device. Returns the CompiledKernel."""
    source, target, _, options = _source_of_launch(launch)
    return triton.compile(source, target=target, options=options.__dict__)


def ttgir_of_launch(launch: Launch) -> str:
    """The TTGIR ``compile_launch`` would produce (its asm["ttgir"]), from the same passes
    but stopping there: no LLVM, PTX or ptxas, a fraction of the time, for checks of the
    layouts Triton assigns."""
    from triton._C.libtriton import ir

    source, target, backend, options = _source_of_launch(launch)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = source.make_ir(target, options, codegen, backend.get_module_map(), context)
    stages, metadata = {}, {}
    backend.add_stages(stages, options, source.language)
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return str(module)
