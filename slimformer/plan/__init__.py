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

from slimformer._lazy import make_lazy

# Public name -> its module, imported on first use (PEP 562): ``python -m slimformer.plan``
# builds its parser (and answers --help) before torch is imported.
_LAZY = {
    **dict.fromkeys(
        ["OPTIMIZERS", "InBackwardOptimizer", "OptimizerCost", "optimizer_in_backward"], "slimformer.plan.optimizer"
    ),
    **dict.fromkeys(
        ["Plan", "ladder", "max_batch", "max_seq", "parse_budget", "plan", "plannable_layers", "profile"],
        "slimformer.plan.planner",
    ),
    "synthetic_batch": "slimformer.plan.planner",
    **dict.fromkeys(["MemoryProfile", "Prediction"], "slimformer.plan.profile"),
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


make_lazy(__name__, _LAZY, ("profile",))
