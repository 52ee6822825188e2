"""Activation memory: measuring what a forward keeps for backward (``measure``), the
per-layer training-memory report built on it (``report``), and the peak of a step on CPU or
CUDA (``peak_memory``). ``python -m slimformer.memory`` (``cli``) reports a HF BERT, eager vs
patched; it alone imports the conversion, when it runs."""

import importlib
import sys
import types

# Public name -> its module, imported on first use (PEP 562): ``python -m slimformer.memory``
# builds its parser (and answers --help) before torch is imported.
_LAZY = {
    **dict.fromkeys(["ActivationMemory", "TensorRecord", "format_bytes", "measure_activation_memory"], "measure"),
    **dict.fromkeys(["PeakMemory", "peak_memory"], "peak"),
    **dict.fromkeys(["MemoryReport", "ModelMemory", "report"], "report"),
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


class _Package(types.ModuleType):
    """Importing slimformer.memory.report (the module) would bind the package's ``report`` to it;
    the package's ``report`` is the report function, so the binding is left out."""

    def __setattr__(self, name: str, value) -> None:
        if name == "report" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
