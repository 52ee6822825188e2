"""Activation memory: measuring what a forward keeps for backward (``measure``), the
per-layer training-memory report built on it (``report``), and the peak of a step on CPU or
CUDA (``peak_memory``). ``python -m slimformer.memory`` (``cli``) reports a HF BERT, eager vs
patched; it alone imports the conversion, when it runs."""

from slimformer._lazy import make_lazy

# Public name -> its module, imported on first use (PEP 562): ``python -m slimformer.memory``
# builds its parser (and answers --help) before torch is imported.
_LAZY = {
    **dict.fromkeys(
        ["ActivationMemory", "TensorRecord", "format_bytes", "measure_activation_memory"], "slimformer.memory.measure"
    ),
    **dict.fromkeys(["PeakMemory", "peak_memory"], "slimformer.memory.peak"),
    **dict.fromkeys(["MemoryReport", "ModelMemory", "report"], "slimformer.memory.report"),
}

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


make_lazy(__name__, _LAZY, ("report",))
