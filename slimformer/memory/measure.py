"""Activation memory: the bytes a forward leaves alive for its backward.

One call of the forward is measured two independent ways:

* **saved**: every tensor autograd saves for backward (the built-in ops and
  ``ctx.save_for_backward``) passes through the pack hook of
  ``torch.autograd.graph.saved_tensors_hooks``, which notes the tensor's storage and
  returns the tensor itself, so behaviour is unchanged.
* **alive**: a ``TorchDispatchMode`` notes a weak reference to every new storage an
  aten op returns (not the views or in-place results of its inputs). The storages
  still alive after the forward, while the outputs (and so the autograd graph) are
  still held, are what the forward left behind. This also catches tensors an
  ``autograd.Function`` keeps as ``ctx`` attributes, which the hooks never see. It
  counts anything else the forward keeps reachable too (a lazily built cache, say),
  so measure a warmed-up model.

Both count whole storages (a view counts its base once) that are alive when the
forward returns, and leave out what the forward did not add: parameters and
buffers of the module called, extra tensors given as ``exclude``, the tensor inputs
and the outputs. Tensors made outside aten (``torch.from_numpy``) are invisible to
the second method.
"""

import contextlib
import dataclasses
import gc
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ActivationMemory", "TensorRecord", "format_bytes", "measure_activation_memory"]

_StorageKey = tuple[int, int]  # (data pointer, bytes)


@dataclass(frozen=True)
class TensorRecord:
    """One storage kept for backward: shape and dtype of the first tensor seen on it,
    and the bytes of the whole storage."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes a forward left alive for backward, by both methods (see the module docstring)."""

    saved_bytes: int  # storages autograd saved (saved_tensors_hooks)
    alive_bytes: int  # storages the forward created that are still alive (weak references)
    saved: tuple[TensorRecord, ...]
    alive: tuple[TensorRecord, ...]

    def per_token(self, tokens: int, hidden: int) -> float:
        """The larger of the two measurements in bytes per token per hidden unit."""
        if tokens <= 0 or hidden <= 0:
            raise ValueError(f"tokens and hidden must be positive, got tokens={tokens}, hidden={hidden}")
        return max(self.saved_bytes, self.alive_bytes) / (tokens * hidden)

    def __str__(self) -> str:
        return (
            f"saved {format_bytes(self.saved_bytes)} in {len(self.saved)} storages, "
            f"alive {format_bytes(self.alive_bytes)} in {len(self.alive)} storages"
        )


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``format_bytes(16640) == '16.25 KiB'``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    scaled, exponent = float(n), 0
    while abs(scaled) >= 1024 and exponent < len(units) - 1:
        scaled, exponent = scaled / 1024, exponent + 1
    return f"{n} B" if exponent == 0 else f"{scaled:.2f} {units[exponent]}"


def _key(storage: torch.UntypedStorage) -> _StorageKey:
    return storage.data_ptr(), storage.nbytes()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, looking inside lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name))


class _StorageLog:
    """Weak references to the storages of the tensors added, in order of first sight."""

    def __init__(self) -> None:
        self._seen: dict[_StorageKey, tuple[weakref.ref, TensorRecord]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = _key(storage)
        if key[1] == 0 or (key in self._seen and self._seen[key][0]() is not None):
            return
        self._seen.pop(key, None)  # a dead storage whose address was reused
        record = TensorRecord(tuple(tensor.shape), tensor.dtype, key[1])
        self._seen[key] = weakref.ref(storage), record

    def alive(self, excluded: set[_StorageKey]) -> tuple[TensorRecord, ...]:
        """Records of the storages still alive and not in ``excluded``."""
        return tuple(record for key, (ref, record) in self._seen.items() if ref() is not None and key not in excluded)


class _LogNewStorages(TorchDispatchMode):
    """Adds to a ``_StorageLog`` every tensor an aten op returns on a storage that none of
    the op's inputs has (views and in-place results of older storages are not new)."""

    def __init__(self, log: _StorageLog) -> None:
        super().__init__()
        self._log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            if _key(tensor.untyped_storage()) not in inputs:
                self._log.add(tensor)
        return out


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _not_added(fn: Callable, exclude: Iterable[torch.Tensor], inputs: Any, out: Any) -> set[_StorageKey]:
    """Storages the forward did not add: ``fn``'s parameters and buffers, ``exclude``,
    the inputs and the outputs."""
    owned = ()
    if isinstance(fn, torch.nn.Module):
        owned = itertools.chain(fn.parameters(), fn.buffers())
    tensors = itertools.chain(owned, _tensors(tuple(exclude)), _tensors(inputs), _tensors(out))
    return {_key(t.untyped_storage()) for t in tensors}


def measure_activation_memory(
    fn: Callable, *args: Any, exclude: Iterable[torch.Tensor] = (), **kwargs: Any
) -> ActivationMemory:
    """Call ``fn(*args, **kwargs)`` once and measure what it leaves alive for backward.

    ``fn`` may return tensors, or lists, tuples, dicts (HF ``ModelOutput``) or
    dataclasses of them. When ``fn`` is an ``nn.Module`` its parameters and buffers are
    not counted; pass any other long-lived tensors it uses as ``exclude`` (e.g. the
    parameters of the model a function closes over). The outputs are dropped, so the
    graph is freed, before this returns. Works on any device.

    Model inputs held in a dict (a tokenizer's output, what ``memory.report`` takes)
    are keyword arguments: ``measure_activation_memory(model, **inputs)``. A call with
    one dict as the only argument that ``fn`` rejects raises a TypeError saying so.
    """
    with _collections_of_new_objects_only():
        return _measure(fn, args, kwargs, exclude)


@contextlib.contextmanager
def _collections_of_new_objects_only():
    """Inside, ``gc.collect()`` scans only the objects made inside: those alive before are
    frozen (``gc.freeze``). A full collection of a process holding torch and transformers
    takes ~0.3 s; the forward's own objects, a few ms. Someone else's freeze is left as is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _measure(fn: Callable, args: tuple, kwargs: dict, exclude: Iterable[torch.Tensor]) -> ActivationMemory:
    saved, created = _StorageLog(), _StorageLog()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), _LogNewStorages(created):
        try:
            out = fn(*args, **kwargs)
        except Exception as error:
            if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
                name = getattr(fn, "__name__", type(fn).__name__)
                raise TypeError(
                    f"{name} failed when given one dict as its positional argument ({type(error).__name__}: "
                    f"{error}); to pass a dict of model inputs as keyword arguments, as slimformer.memory.report "
                    "does, call measure_activation_memory(model, **inputs)"
                ) from error
            raise
    gc.collect()  # garbage cycles the forward made are not alive
    excluded = _not_added(fn, exclude, (args, kwargs), out)
    saved_records, alive_records = saved.alive(excluded), created.alive(excluded)
    del out
    gc.collect()
    return ActivationMemory(
        saved_bytes=sum(r.nbytes for r in saved_records),
        alive_bytes=sum(r.nbytes for r in alive_records),
        saved=saved_records,
        alive=alive_records,
    )
