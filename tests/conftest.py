"""Test set-up: interpret Triton kernels on CPU unless a GPU is present.

TRITON_INTERPRET must be set before anything imports triton, since ``triton.jit``
decides at decoration time whether a kernel is compiled or interpreted.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Each xdist worker gets its share of the cores: with torch's default of one thread
    # per core in every worker, their spinning OpenMP threads slow small ops many times over.
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    # and so do the processes the tests start (gloo ranks, the compile report, the CLI)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def _patch_the_language_once_per_launch():
    """Triton 3.6's interpreter patches triton.language for each launch (restoring it at
    the end), and again, to the same effect, on every call of a ``@triton.jit`` helper
    inside the kernel: ``inspect.getmembers`` over the package each time, a large share of
    an interpreted kernel test's time. The repeat is skipped where every language
    module the helper sees is already patched in this launch; a helper that sees another
    (triton's own, which see ``triton.language.core``) still patches it."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    in_launch: set[int] = set()  # ids of the language modules patched in the running launch

    class LaunchScope(interpreter._LangPatchScope):
        def restore(self):
            super().restore()
            in_launch.clear()

    def patch_lang_once(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if in_launch and langs <= in_launch:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's patch holds
        scope = patch_lang(fn)
        if not in_launch:  # the launch's own patch (GridExecutor), restored when it ends
            scope.__class__ = LaunchScope
        in_launch.update(langs)
        return scope

    interpreter._patch_lang = patch_lang_once


def _numpy_dtypes_from_one_table():
    """Triton 3.6's interpreter builds its 20-entry triton -> numpy dtype table anew on
    each lookup (once or more per interpreted op: 8% of an attention test). The same
    lookups, from a table kept between calls."""
    import triton.language as tl
    from triton.runtime import interpreter

    get_np_dtype = interpreter._get_np_dtype
    table = {}

    def get_np_dtype_from_table(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return get_np_dtype(element)
        if element not in table:
            table[element] = get_np_dtype(element)
        return table[element]

    interpreter._get_np_dtype = get_np_dtype_from_table


def _tuple_type_names_on_demand():
    """Every interpreted op makes tensors whose shape is a ``triton.language.tuple``, and
    Triton 3.6 formats each one's type name (``[:constexpr[128],:constexpr[64]]``) on
    creation, though the interpreter never reads it. The name, formatted when read."""
    from triton.language import core

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    core.tuple_type.__init__ = __init__
    core.tuple_type.name = property(
        lambda self: "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]"
    )


def _no_overflow_checks_whose_assert_is_off():
    """Every integer ``+``, ``-`` and ``*`` on 32-bit (or narrower) values builds an overflow
    check: both operands cast to int64, the operation again, two compares, an ``and`` and a
    ``device_assert`` (ten interpreted ops for one, a third of an interpreted attention
    test). Triton 3.6's interpreter runs without ``debug`` (``InterpreterOptions()``), so
    that ``device_assert`` returns without reading its condition. The check is skipped
    where its assert is off, which is all it did; with ``debug`` on it runs as before."""
    from triton.language.semantic import TritonSemantic

    sanitize_overflow = TritonSemantic.binary_op_sanitize_overflow_impl

    def sanitize_overflow_if_asserts_are_on(self, lhs, rhs, binary_op):
        if self.builder.options.debug:
            sanitize_overflow(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow_if_asserts_are_on


def _shapes_built_once_per_shape():
    """Every interpreted op makes a ``tl.tensor`` and mostly a ``tl.block_type``, and Triton 3.6
    builds their shapes anew each time: the tensor's as a ``tl.tuple`` of constexprs (with a
    tuple type of constexpr types), the block type's by unwrapping, validating and
    formatting its shape into a name. Broadcasting then compares shapes by turning the
    other side into a ``tl.tuple`` too. Together a quarter of an interpreted kernel test.

    Here each distinct shape's values are built once, by Triton's own code, and shared:
    tensors of one shape hold one shape tuple (the interpreter never mutates one;
    ``tl.tuple._setitem`` is the compiler's), block types of one element type and shape one
    validated shape, numel and name. A shape compares with itself, or with a list or tuple
    of ints, without the conversion; shapes with constexprs take Triton's path."""
    import builtins
    import math

    from triton.language import core

    block_type_init, tuple_eq = core.block_type.__init__, core.tuple.__eq__
    tensor_shapes = {}  # shape (ints) -> (tl.tuple of constexprs, numel as constexpr)
    block_shapes = {}  # (element type name, shape) -> (shape, numel, name) as block_type.__init__ sets them

    def tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        shape = builtins.tuple(type.shape) if type.is_block() else ()
        if shape not in tensor_shapes:
            tensor_shapes[shape] = (core.tuple([core.constexpr(s) for s in shape]), core.constexpr(math.prod(shape)))
        self.shape, self.numel = tensor_shapes[shape]

    def block_init(self, element_ty, shape):
        if not all(type(d) is int for d in shape):  # constexprs: Triton unwraps them
            return block_type_init(self, element_ty, shape)
        key = (element_ty.name, builtins.tuple(shape))
        if key not in block_shapes:
            block_type_init(self, element_ty, shape)  # validates, raises on a bad shape
            block_shapes[key] = (self.shape, self.numel, self.name)
        self.element_ty = element_ty
        self.shape, self.numel, self.name = block_shapes[key]

    def shape_eq(self, other):
        if other is self:
            return core.constexpr(True)
        if type(other) in (list, builtins.tuple) and all(type(v) is int for v in other):
            return core.constexpr(self.values == list(other))
        return tuple_eq(self, other)

    core.tensor.__init__ = tensor_init
    core.block_type.__init__ = block_init
    core.tuple.__eq__ = shape_eq


def _interpreter_is_triton_3_6() -> bool:
    """The patches above replace internals read from Triton 3.6's interpreter; another
    Triton runs its interpreter as it is (slower, never wrong)."""
    import triton

    return triton.__version__.startswith("3.6.")


if _INTERPRETING and _interpreter_is_triton_3_6():
    _no_overflow_checks_whose_assert_is_off()
    _shapes_built_once_per_shape()
    _patch_the_language_once_per_launch()
    _numpy_dtypes_from_one_table()
    _tuple_type_names_on_demand()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    if getattr(config.option, "loadgroup", False):
        _keep_xdist_groups_on_one_worker(items)


def _keep_xdist_groups_on_one_worker(items):
    """Make ``--dist loadgroup`` (the Makefile's command) keep each ``xdist_group`` on one
    worker, so that module fixtures which compile models are built once, not once per
    worker. pytest-xdist marks a group by appending ``@name`` to ``item._nodeid``, which
    pytest 9.2 no longer reads (the node id lives in ``item._id``; pytest-xdist#1386), so
    the groups were silently dealt out test by test. The suffix is written where pytest
    reads it; where xdist's own suffix took effect, nothing changes."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9.2: xdist's own suffix works
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) for mark in marks}
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Run a CPU test through the interpreted Triton kernel and through the PyTorch reference."""
    if request.param == "triton":
        if not _INTERPRETING:
            pytest.skip("Triton kernels are compiled for the GPU in this session; see the gpu tests")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param
