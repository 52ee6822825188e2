"""How the GPU check times a step: device time without the host's overhead, and the host's
time per call beside it.

A *step* is a no-argument callable (a forward, a backward of a retained graph, or both).
``measure`` runs it in four parts:

1. the first call, synchronised: its wall time (``first_call_s``) includes the Triton or
   Inductor compile when no earlier process left the kernel in the on-disk cache;
2. a few warm-up calls;
3. host time: ``HOST_CALLS`` calls queued back to back, no sync: the Python, dispatch and
   launch time one call costs the host (``host_us``);
4. device time, per round: an L2 flush (a write of twice the L2 size), then a GPU sleep
   long enough for the host to queue the whole step behind it, then the step between two
   CUDA events. The GPU never waits for the host inside the events, so the round's time
   is the step's kernels alone, inputs coming from HBM as in a model. The rounds rotate
   over the input copies the caller built, and the result is the 20/50/80th percentiles.

On a CPU (``--dry-run``) both times are the host's wall time.
"""

import contextlib
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from bench.harness import gpu_sleep_covering

HOST_CALLS = 10
WARMUP_CALLS = 2


@dataclass
class Timing:
    """One provider's times for one step. Times in microseconds."""

    p20_us: float
    p50_us: float
    p80_us: float
    min_us: float
    max_us: float
    host_us: float  # host time per call, queued without synchronisation
    rounds: int
    first_call_s: float  # wall time of the first call (compile included when not cached)

    def to_json(self) -> dict:
        return asdict(self)


class CaseTimeout(Exception):
    """A case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the main thread once ``seconds`` have passed (a kernel that
    hangs on the GPU is not interrupted, but every host-side loop is)."""

    def expired(signum, frame):
        raise CaseTimeout(f"ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Clock:
    """Times steps on ``device``: holds the L2 flush buffer and the GPU's sleep rate."""

    def __init__(self, device: torch.device, max_rounds: int = 30, min_rounds: int = 5, round_budget_s: float = 0.6):
        self.device = device
        self.max_rounds, self.min_rounds, self.round_budget_s = max_rounds, min_rounds, round_budget_s
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self._flush = torch.empty(2 * max(l2, 1 << 20), dtype=torch.uint8, device=device)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(self, steps: Sequence[Callable[[], object]]) -> Timing:
        """Time ``steps`` (one per input copy, rotated over the rounds; see the module docstring)."""
        start = time.perf_counter()
        steps[0]()
        self.synchronize()
        first_call_s = time.perf_counter() - start
        for i in range(WARMUP_CALLS):
            steps[i % len(steps)]()
        self.synchronize()

        start = time.perf_counter()
        for i in range(HOST_CALLS):
            steps[i % len(steps)]()
        host_s = (time.perf_counter() - start) / HOST_CALLS
        self.synchronize()
        wall_s = (time.perf_counter() - start) / HOST_CALLS
        rounds = int(min(self.max_rounds, max(self.min_rounds, self.round_budget_s / max(wall_s, 1e-6))))
        times_us = self._device_rounds(steps, rounds, host_s) if self.cuda else self._host_rounds(steps, rounds)
        return _timing(times_us, host_s * 1e6, first_call_s)

    def _device_rounds(self, steps, rounds: int, host_s: float) -> list[float]:
        sleep = gpu_sleep_covering(self.device, host_s)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
        for i, (start, end) in enumerate(events):
            self._flush.zero_()
            torch.cuda._sleep(sleep)
            start.record()
            steps[i % len(steps)]()
            end.record()
        self.synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end in events]

    def _host_rounds(self, steps, rounds: int) -> list[float]:
        times = []
        for i in range(rounds):
            start = time.perf_counter()
            steps[i % len(steps)]()
            times.append((time.perf_counter() - start) * 1e6)
        return times


def _timing(times_us: list[float], host_us: float, first_call_s: float) -> Timing:
    ordered = sorted(times_us)
    p20, p50, p80 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.2, 0.5, 0.8))
    return Timing(p20, statistics.median(ordered), p80, ordered[0], ordered[-1], host_us, len(ordered), first_call_s)
