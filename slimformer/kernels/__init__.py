"""Functions on tensors: Triton kernels, their launchers, PyTorch references and custom ops (docs/architecture.md)."""
