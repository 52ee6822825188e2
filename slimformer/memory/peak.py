"""The peak memory of a piece of work (a training step, say): the number that decides OOM.

``with peak_memory(device) as peak: ...`` then ``peak.bytes``: the most memory the
device's allocator had allocated at any moment inside the block, above what it had
allocated when the block began. Both devices are read off their allocator, never by
summing tensor sizes, so what an op allocates and frees inside itself counts (the
temporaries of slimformer's custom ops, the PyTorch references they run on CPU), and
so does what autograd allocates as it really runs (the in-place sum of a tied weight's
two gradients).

* CUDA: the caching allocator's statistics, ``torch.cuda.max_memory_allocated`` (its
  peak statistic is reset on entry and at each ``mark``). Reading them syncs nothing.
  With ``moments=True`` a ``torch.profiler`` records the allocator's events too (the
  block sizes it hands out), for the moments between marks.
* CPU: PyTorch keeps no statistics for its CPU allocator, but reports every allocation
  and free to ``torch.profiler`` (``profile_memory=True``): the block runs under the
  profiler and the peak is replayed from those events when it exits. Allocations made
  on threads the profiler does not follow (inside an OpenMP region) and scratch that a
  library allocates with its own ``malloc`` (a BLAS packing buffer) are not reported.
  The profiler costs a few microseconds per op, so time the work separately; it cannot
  run twice at once, so CPU blocks do not nest, nor run under another profiler.

``peak.mark(label)`` inside the block splits it: after the block, ``peak.marks`` holds
one ``Mark`` per call (what was allocated at the mark, the most since the previous one,
the allocator's events in between).
"""

import bisect
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Mark", "PeakMemory", "peak_memory"]

_MARK = "slimformer.peak_memory.mark."  # the record_function name of a mark, then its index

METHODS = {
    "cuda": "max_memory_allocated",
    "cpu": "CPU allocator events (torch.profiler)",
}


@dataclass(frozen=True)
class Mark:
    """One ``PeakMemory.mark`` call, all bytes above the block's start: ``live``, allocated
    at the mark; ``top``, the most allocated since the previous mark (or the start);
    ``moments``, the total after each allocation since then (empty where the allocator's
    events were not recorded); ``events``, those events as (address, signed bytes)."""

    label: Any
    live: int
    top: int
    moments: tuple[int, ...] = ()
    events: tuple[tuple[int, int], ...] = ()


@dataclass
class PeakMemory:
    """``bytes`` and ``marks`` are filled in when the ``peak_memory`` block exits. On CUDA,
    ``current_bytes()`` and ``peak_so_far()`` also answer inside the block (above the
    block's start); on CPU the allocator's events are only read at the exit, so they
    raise there: mark the moment instead and read ``marks`` after the block."""

    device: str
    bytes: int = 0  # the peak, above what was allocated on entry
    method: str = ""  # how it was measured: a value of METHODS
    marks: list[Mark] = field(default_factory=list)
    _mark: Callable[[Any], None] = field(default=lambda label: None, repr=False)
    _current: Callable[[], int] | None = field(default=None, repr=False)
    _peak: Callable[[], int] | None = field(default=None, repr=False)

    def mark(self, label: Any = None) -> None:
        """Split the block here (see ``Mark``)."""
        self._mark(label)

    def current_bytes(self) -> int:
        return self._live(self._current, "current_bytes")

    def peak_so_far(self) -> int:
        return self._live(self._peak, "peak_so_far")

    def _live(self, read: Callable[[], int] | None, name: str) -> int:
        if read is None:
            raise RuntimeError(
                f"peak_memory({self.device!r}).{name}() inside the block: the CPU allocator's events are read when "
                "the block exits; call peak.mark(label) here and read peak.marks after the block"
            )
        return read()


@dataclass(frozen=True)
class _Allocation:
    """One allocator event: when (profiler ns), where (address), signed bytes (negative: a free)."""

    time_ns: int
    address: int
    nbytes: int


def _allocator_events(prof, device: torch.device) -> list[_Allocation]:
    """The allocation events of ``device`` that the profiler recorded, in time order."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if _same_device(fields.device, device):
                found.append(_Allocation(event.start_time_ns, fields.ptr, fields.alloc_size))
    return sorted(found, key=lambda a: a.time_ns)


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    return wanted.type == "cpu" or (wanted.index if wanted.index is not None else 0) == actual.index


def _mark_times(prof) -> dict[int, int]:
    """Mark index -> profiler ns of its record_function."""
    times, stack = {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.name.startswith(_MARK):
            times[int(event.name.removeprefix(_MARK))] = event.start_time_ns
    return times


def replay(events: Sequence[_Allocation], cuts: Sequence[int], labels: Sequence[Any]) -> tuple[int, list[Mark]]:
    """(the peak, one ``Mark`` per label) from the allocator's ``events`` in order, mark i
    falling after the first ``cuts[i]`` of them; bytes above the total before the first event."""
    live = peak = 0
    marks, done = [], 0
    for cut, label in zip(cuts, labels):
        top, moments, seen = live, [], []
        for event in events[done:cut]:
            live += event.nbytes
            seen.append((event.address, event.nbytes))
            if event.nbytes > 0:
                moments.append(live)
                top = max(top, live)
        marks.append(Mark(label, live, top, tuple(moments), tuple(seen)))
        peak, done = max(peak, top), cut
    for event in events[done:]:
        live += event.nbytes
        peak = max(peak, live)
    return peak, marks


class _CudaStats:
    """The CUDA caching allocator's statistics for one device, above a starting point.
    ``api`` is ``torch.cuda`` (a stand-in in the CPU tests of this logic)."""

    def __init__(self, device: torch.device, api=None):
        self.api = api if api is not None else torch.cuda
        self.device = device
        self.api.synchronize(device)
        self.api.reset_peak_memory_stats(device)
        self.before = self.api.memory_allocated(device)
        self.whole = 0  # the block's peak across the resets at each mark

    def current(self) -> int:
        return self.api.memory_allocated(self.device) - self.before

    def peak(self) -> int:
        return max(self.whole, self.api.max_memory_allocated(self.device) - self.before)

    def split(self) -> tuple[int, int]:
        """(allocated now, the most since the last split), then the peak statistic restarts."""
        top = self.api.max_memory_allocated(self.device) - self.before
        live = self.current()
        self.api.reset_peak_memory_stats(self.device)
        self.whole = max(self.whole, top)
        return live, top

    def finish(self) -> int:
        self.api.synchronize(self.device)
        return self.peak()


def cuda_marks(
    splits: Sequence[tuple[Any, int, int]], events: Sequence[_Allocation], times: Sequence[int | None]
) -> list[Mark]:
    """Marks from the statistics read at each (label, live, top) and, where the profiler
    recorded the allocator's events, the moments between them: the events up to each mark's
    time, kept only where they add up to what the statistics say was allocated (else the
    mark's moments are its top alone)."""
    marks, done, before = [], 0, 0
    times_ns = [e.time_ns for e in events]
    for (label, live, top), at in zip(splits, times):
        cut = done if at is None else bisect.bisect_left(times_ns, at)
        segment = events[done:cut]
        running, moments = before, []
        for event in segment:
            running += event.nbytes
            if event.nbytes > 0:
                moments.append(running)
        agrees = bool(segment) and running == live and max(moments, default=before) <= top
        pairs = tuple((e.address, e.nbytes) for e in segment) if agrees else ()
        marks.append(Mark(label, live, top, tuple(moments) if agrees else (top,), pairs))
        done, before = cut, live
    return marks


@contextlib.contextmanager
def peak_memory(device: torch.device | str, *, moments: bool = False, _cuda_api=None) -> Iterator[PeakMemory]:
    """Measure the peak allocation inside the block on ``device`` (CPU or CUDA), see the
    module docstring. Yields a ``PeakMemory`` whose ``bytes`` and ``marks`` are set on
    exit. ``moments``: on CUDA, also record the allocator's events between marks (always
    on CPU). ``_cuda_api`` stands in for ``torch.cuda`` in tests of the CUDA logic."""
    device = torch.device(device)
    result = PeakMemory(str(device))
    if device.type == "cuda":
        stats = _CudaStats(device, _cuda_api)
        splits: list[tuple[Any, int, int]] = []
        profiler = _profiler() if moments else contextlib.nullcontext()

        def mark(label: Any) -> None:
            if moments:
                _emit_mark(len(splits))
            splits.append((label, *stats.split()))

        result._mark, result._current, result._peak = mark, stats.current, stats.peak
        with profiler as prof:
            yield result
            result.bytes = stats.finish()
        marked = _mark_times(prof) if moments else {}
        events = _allocator_events(prof, device) if moments else []
        times = [marked.get(i) if moments else None for i in range(len(splits))]
        result.marks = cuda_marks(splits, events, times)
        result.method = METHODS["cuda"]
    elif device.type == "cpu":
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError(
                "peak_memory('cpu') reads the CPU allocator through torch.profiler, which is already running "
                "(another peak_memory('cpu') block or a profiler): CPU blocks cannot nest"
            )
        labels: list[Any] = []

        def mark(label: Any) -> None:
            _emit_mark(len(labels))
            labels.append(label)

        result._mark = mark
        with _profiler() as prof:
            yield result
        events = _allocator_events(prof, device)
        at = _mark_times(prof)
        times_ns = [e.time_ns for e in events]
        cuts = [bisect.bisect_left(times_ns, at[i]) for i in range(len(labels))]
        result.bytes, result.marks = replay(events, cuts, labels)
        result.method = METHODS["cpu"]
    else:
        raise ValueError(f"device must be cpu or cuda, got {device}")


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return _Quiet(profile(activities=[ProfilerActivity.CPU], profile_memory=True))


class _Quiet:
    """A profiler whose start and stop print nothing: kineto writes a line to stderr at each
    (its USDT log, which KINETO_LOG_LEVEL does not switch off), and a measurement should not
    print. Only those two calls run with stderr closed."""

    def __init__(self, profiler):
        self.profiler = profiler

    def __enter__(self):
        with _stderr_closed():
            return self.profiler.__enter__()

    def __exit__(self, *exc_info):
        with _stderr_closed():
            return self.profiler.__exit__(*exc_info)


@contextlib.contextmanager
def _stderr_closed():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _emit_mark(index: int) -> None:
    """A zero-length record_function: its time places the mark among the allocator's events."""
    with torch.profiler.record_function(f"{_MARK}{index}"):
        pass
