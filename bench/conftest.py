"""pytest set-up for bench/: record the software and the device with every result."""

import torch
import triton

from bench.harness import bench_device, device_name


def pytest_benchmark_update_machine_info(config, machine_info):
    """Add what the report's header needs to pytest-benchmark's ``machine_info``."""
    device = bench_device()
    machine_info.update(
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        bench_device=device_name(device),
        bench_device_type=device.type,
        torch_threads=torch.get_num_threads(),
    )


def pytest_configure(config):
    """On CPU, time with one intra-op thread: on a small shared machine (2 cores in CI),
    threads that wait on each other turn any other load into millisecond stalls."""
    if bench_device().type == "cpu":
        torch.set_num_threads(1)
