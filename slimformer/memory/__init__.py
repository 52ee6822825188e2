"""Activation memory: measuring what a forward keeps for backward (``measure``), the
per-layer training-memory report built on it (``report``), and the peak of a step on CPU or
CUDA (``peak_memory``). ``python -m slimformer.memory`` (``cli``) reports a HF BERT, eager vs
patched; it alone imports the conversion, when it runs."""

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
