"""pytest set-up for bench/: record the software and the device with every result."""

import torch

from bench.harness import bench_device, report_machine_info


def pytest_benchmark_update_machine_info(config, machine_info):
    """Add what the report's header needs to pytest-benchmark's ``machine_info``."""
    machine_info.update(report_machine_info())


def pytest_configure(config):
    """On CPU, time with one intra-op thread: on a small shared machine (2 cores in CI),
    threads that wait on each other turn any other load into millisecond stalls."""
    if bench_device().type == "cpu":
        torch.set_num_threads(1)
