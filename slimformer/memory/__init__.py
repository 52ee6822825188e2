"""Activation memory: measuring what a forward keeps for backward (``measure``), and the
per-layer training-memory report built on it (``report``; ``python -m slimformer.memory``),
and the peak of a step on CPU or CUDA (``peak_memory``)."""

from slimformer.memory.measure import ActivationMemory, TensorRecord, format_bytes, measure_activation_memory
from slimformer.memory.peak import PeakMemory, peak_memory
from slimformer.memory.report import MemoryReport, ModelMemory, report

__all__ = [
    "ActivationMemory",
    "MemoryReport",
    "ModelMemory",
    "PeakMemory",
    "TensorRecord",
    "format_bytes",
    "measure_activation_memory",
    "peak_memory",
    "report",
]
