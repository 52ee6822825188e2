"""Will it fit? ``sf.plan``: a training step's memory predicted from a few cheap
measurements, and the per-layer recompute policies that fit it in a budget.

* ``plan(model, example_batch, budget, optimizer)`` -> ``Plan`` (``slimformer.plan.planner``);
* ``max_batch(model, seq_len, budget)``, ``max_seq(model, batch, budget)``: the largest
  batch or sequence that fits, with its plan;
* ``optimizer_in_backward(model, torch.optim.AdamW, lr=...)``: the optimizer step applied
  per parameter during backward, the knob that lowers the step's floor
  (``slimformer.plan.optimizer``);
* the measurement and the prediction: ``slimformer.plan.profile``.

``python -m slimformer.plan --help``: the command line.
"""

import importlib
import sys
import types

# Public name -> its module, imported on first use (PEP 562): ``python -m slimformer.plan``
# builds its parser (and answers --help) before torch is imported.
_LAZY = {
    **dict.fromkeys(["OPTIMIZERS", "InBackwardOptimizer", "OptimizerCost", "optimizer_in_backward"], "optimizer"),
    **dict.fromkeys(
        ["Plan", "ladder", "max_batch", "max_seq", "parse_budget", "plan", "plannable_layers", "profile"],
        "planner",
    ),
    "synthetic_batch": "planner",
    **dict.fromkeys(["MemoryProfile", "Prediction"], "profile"),
}

__all__ = [
    "OPTIMIZERS",
    "InBackwardOptimizer",
    "MemoryProfile",
    "OptimizerCost",
    "Plan",
    "Prediction",
    "ladder",
    "max_batch",
    "max_seq",
    "optimizer_in_backward",
    "parse_budget",
    "plan",
    "plannable_layers",
    "profile",
    "synthetic_batch",
]


class _Package(types.ModuleType):
    """Importing slimformer.plan.profile (the module) would bind the package's ``profile`` to it;
    the package's ``profile`` is the planner's function, so the binding is left out."""

    def __setattr__(self, name: str, value) -> None:
        if name == "profile" and isinstance(value, types.ModuleType):
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
