"""Phase 1: what the machine is, and the two ceilings the speed figures are judged against.

- copy bandwidth: ``dst.copy_(src)`` of a large buffer, bytes read + written per second;
- matmul: a bf16 ``M x M x M`` product's TFLOP/s (2·M³ FLOPs), random inputs.

Each is the median of CUDA-event timed repetitions after a warm-up (on a CPU, a smaller
fp32 product and copy, timed on the host).
"""

import os
import platform
import shutil
import socket
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

from bench.gpu_check.timing import Clock
from bench.harness import device_slug as _device_slug, git_revision


def _driver_version() -> str:
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def describe(device: torch.device) -> dict:
    """Device, software and revision, as the report's header shows them."""
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": git_revision(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(props.L2_cache_size / 2**20, 1),
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()})", cuda=None)
    return info


def device_slug(info: dict) -> str:
    """``nvidia-h200`` for "NVIDIA H200", ``cpu`` for a CPU: the report's file names."""
    return "cpu" if info.get("cuda") is None else _device_slug(info["device"], "cuda")


def ceilings(clock: Clock, dry_run: bool) -> dict:
    """{"copy_gbps": bytes read + written per second / 1e9, "matmul_tflops": ...}."""
    device = clock.device
    copy_bytes = (64 if dry_run else 4096) * 2**20
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_s = _median_seconds(clock, lambda: dst.copy_(src))
    size, dtype = (256, torch.float32) if dry_run else (8192, torch.bfloat16)
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    matmul_s = _median_seconds(clock, lambda: a @ b)
    return {
        "copy_gbps": 2 * copy_bytes / copy_s / 1e9,
        "copy_bytes": copy_bytes,
        "matmul_tflops": 2 * size**3 / matmul_s / 1e12,
        "matmul_shape": f"{size}x{size}x{size} {str(dtype).removeprefix('torch.')}",
    }


def _median_seconds(clock: Clock, fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    clock.synchronize()
    if not clock.cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    clock.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
