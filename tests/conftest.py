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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


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
