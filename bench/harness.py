"""What every benchmark in bench/ shares: the device, its name, and how a step is timed.

A benchmark builds a *step*, a no-argument callable (one forward, one backward or both),
and hands it to ``measure``. pytest-benchmark times a round by reading its timer before
and after the target; the timer here is ``CLOCK``, which advances only by the time
measured around the step (test modules opt in with
``pytestmark = pytest.mark.benchmark(timer=CLOCK)``):

- CUDA: each round first writes a 1 GiB buffer, which evicts L2 (so inputs come from
  HBM, as in a model), then makes the GPU sleep for 1.5x the host's time per call of
  the step (measured once, before the rounds, and recorded as ``host_us``), then
  brackets the step with CUDA events and waits for them. The host queues the whole step
  while the GPU sleeps, so the round's time is the step's GPU time, free of host
  synchronisation and launch overhead however slow the host is. (Without the sleep, a
  step whose host time exceeds the buffer's write, as slimformer's norms on an H200,
  measured the host.)
- CPU: the host time of the step.

Nothing here touches the GPU at import time.
"""

import functools
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable

import torch

from tools.results import ROOT

ROUNDS = 100
WARMUP = 5
_FLUSH_BYTES = 1 << 30


def bench_device() -> torch.device:
    """The device benchmarks run on: the current CUDA device when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def report_machine_info() -> dict:
    """What the report's header says about the software and the benchmark device."""
    import triton

    device = bench_device()
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "bench_device": device_name(device),
        "bench_device_type": device.type,
        "torch_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
    }


def device_name(device: torch.device) -> str:
    """The GPU's name (``NVIDIA H100 80GB HBM3``) or the CPU model (``AMD EPYC``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class StepClock:
    """A pytest-benchmark timer that advances only by the measured time of ``timed`` steps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def __repr__(self) -> str:
        return "bench.harness.CLOCK"

    def timed(self, step: Callable[[], object], device: torch.device, host_s: float = 0.0) -> Callable[[], None]:
        """The target of one round: runs ``step`` once and adds its time to the clock
        (on CUDA behind a sleep covering ``host_s``, the host's time per call)."""
        if device.type != "cuda":

            def host_timed() -> None:
                start = time.perf_counter()
                step()
                self.seconds += time.perf_counter() - start

            return host_timed

        flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        sleep_cycles = gpu_sleep_covering(device, host_s)

        def gpu_timed() -> None:
            flush.zero_()
            torch.cuda._sleep(sleep_cycles)
            start.record()
            step()
            end.record()
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3

        return gpu_timed


CLOCK = StepClock()
_SLEEP_MARGIN_US = 200.0
_HOST_CALLS = 10


def gpu_sleep_covering(device: torch.device, host_s: float) -> int:
    """Cycles of a ``torch.cuda._sleep`` long enough for the host to queue a step that takes
    it ``host_s`` per call: 1.5x that, plus a margin."""
    return int(_sleep_cycles_per_us(device) * (1.5 * host_s * 1e6 + _SLEEP_MARGIN_US))


@functools.cache
def _sleep_cycles_per_us(device: torch.device) -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per microsecond on ``device``, measured."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # the first call loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def host_seconds_per_call(step: Callable[[], object], device: torch.device) -> float:
    """The host's time per call of ``step``: calls queued back to back, without a sync."""
    start = time.perf_counter()
    for _ in range(_HOST_CALLS):
        step()
    seconds = (time.perf_counter() - start) / _HOST_CALLS
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seconds


def warm_up(step: Callable[[], object], device: torch.device, times: int = WARMUP) -> None:
    """Run ``step`` a few times so compilation, autotuning and allocation happen before timing."""
    for _ in range(times):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(step: Callable[[], object], device: torch.device) -> float | None:
    """Memory one run of ``step`` allocates at its peak beyond what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def measure(benchmark, step: Callable[[], object], device: torch.device, rounds: int = ROUNDS) -> None:
    """Record ``step``'s peak memory in ``benchmark.extra_info``, then time ``rounds`` rounds of it.

    ``step`` must be warmed up already (``warm_up``), so no round pays for compilation.
    """
    benchmark.extra_info["peak_memory_mib"] = peak_memory_mib(step, device)
    host_s = 0.0
    if device.type == "cuda":  # on a CPU the rounds time the host itself
        host_s = host_seconds_per_call(step, device)
        benchmark.extra_info["host_us"] = host_s * 1e6
    benchmark.pedantic(CLOCK.timed(step, device, host_s), rounds=rounds, warmup_rounds=1)


def device_slug(device: str, device_type: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; a CPU model gets a ``cpu-`` prefix."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"cpu-{slug}" if device_type == "cpu" else slug


def git_revision() -> str:
    """Short commit hash, marked when the working tree has uncommitted changes; 'unknown' outside
    git. ``SLIMFORMER_REVISION`` overrides it, for a tree without its .git (a machine that was
    sent a copy of the working tree)."""
    if os.environ.get("SLIMFORMER_REVISION"):
        return os.environ["SLIMFORMER_REVISION"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        revision, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + (" (with uncommitted changes)" if changes else "")
