"""The peak memory of a piece of work (a training step, say): the number that decides OOM.

``with peak_memory(device) as peak: ...`` then ``peak.bytes``: the most memory that was
allocated at any moment inside the block, above what was allocated when it began.

* CUDA: ``torch.cuda.max_memory_allocated`` (its peak statistic is reset on entry).
* CPU: PyTorch keeps no statistics for its CPU allocator, so a ``TorchDispatchMode``
  counts the bytes of live tensor storages: every aten op's output on a storage not
  seen before adds its bytes, and a finalizer on that storage takes them off when it
  is freed. It sees every tensor an op returns (including the temporaries inside
  composite ops, autograd's gradients and the optimizer's state), but not the scratch
  buffers a kernel allocates and frees inside itself (a BLAS packing buffer, say), nor
  tensors made outside aten (``torch.from_numpy``). The mode costs a few microseconds
  per op, so time the work separately.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimformer.memory.measure import _tensors

__all__ = ["PeakMemory", "peak_memory"]


@dataclass
class PeakMemory:
    """``bytes`` is filled in when the ``peak_memory`` block exits; inside the block,
    ``current_bytes()`` and ``peak_so_far()`` tell what is allocated now and what was at
    most until now, above the block's start."""

    device: str
    bytes: int = 0  # the peak, above what was allocated on entry
    method: str = ""  # how it was measured: "max_memory_allocated" or "live tensor storages"
    _current: Callable[[], int] = field(default=lambda: 0, repr=False)
    _peak: Callable[[], int] = field(default=lambda: 0, repr=False)
    _split: Callable[[], tuple[int, int]] = field(default=lambda: (0, 0), repr=False)
    _moment: Callable[[], int] = field(default=lambda: 0, repr=False)

    def current_bytes(self) -> int:
        return self._current()

    def peak_so_far(self) -> int:
        return self._peak()

    def split(self) -> tuple[int, int]:
        """(allocated now, the most allocated since the last ``split`` or the block's start),
        above the block's start; the next interval starts now. ``peak_so_far`` and ``bytes``
        still cover the whole block."""
        return self._split()

    def moment(self) -> int:
        """The most allocated since the last ``moment`` or ``split`` call, above the block's
        start: called after each op, the op's own peak."""
        return self._moment()


class _LiveStorageBytes(TorchDispatchMode):
    """Running total and peak of the bytes of the storages that aten ops created while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.interval_peak = 0  # since the last split
        self.moment_peak = 0  # since the last moment() or split
        self._sizes: dict[int, int] = {}  # data pointer -> bytes, of the live storages counted

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for tensor in _tensors(out):
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._sizes:
                continue
            if inputs is None:  # views and in-place results of older storages are not new
                inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            if key in inputs:
                continue
            self._sizes[key] = size
            weakref.finalize(storage, self._freed, key)
            self.live += size
            self.peak = max(self.peak, self.live)
            self.interval_peak = max(self.interval_peak, self.live)
            self.moment_peak = max(self.moment_peak, self.live)
        return out

    def split(self) -> tuple[int, int]:
        interval, self.interval_peak, self.moment_peak = self.interval_peak, self.live, self.live
        return self.live, interval

    def moment(self) -> int:
        top, self.moment_peak = self.moment_peak, self.live
        return top


@contextlib.contextmanager
def peak_memory(device: torch.device | str) -> Iterator[PeakMemory]:
    """Measure the peak allocation inside the block on ``device`` (CPU or CUDA), see the
    module docstring. Yields a ``PeakMemory`` whose ``bytes`` is set on exit."""
    device = torch.device(device)
    result = PeakMemory(str(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        # torch's peak statistic restarts at each moment() and split(); the block's and the
        # interval's peaks are kept here across those resets
        whole, interval = [0], [0]

        def since_reset() -> int:
            top = torch.cuda.max_memory_allocated(device) - before
            torch.cuda.reset_peak_memory_stats(device)
            whole[0], interval[0] = max(whole[0], top), max(interval[0], top)
            return top

        def split() -> tuple[int, int]:
            since_reset()
            top, interval[0] = interval[0], torch.cuda.memory_allocated(device) - before
            return interval[0], top

        result._current = lambda: torch.cuda.memory_allocated(device) - before
        result._peak = lambda: max(whole[0], torch.cuda.max_memory_allocated(device) - before)
        result._split = split
        result._moment = since_reset
        yield result
        torch.cuda.synchronize(device)
        result.bytes = result._peak()
        result.method = "max_memory_allocated"
    elif device.type == "cpu":
        tracker = _LiveStorageBytes()
        result._current = lambda: tracker.live
        result._peak = lambda: tracker.peak
        result._split = tracker.split
        result._moment = tracker.moment
        with tracker:
            yield result
        result.bytes = tracker.peak
        result.method = "live tensor storages"
    else:
        raise ValueError(f"device must be cpu or cuda, got {device}")
