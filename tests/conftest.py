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
