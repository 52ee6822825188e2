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

from slimformer.plan.optimizer import OPTIMIZERS, InBackwardOptimizer, OptimizerCost, optimizer_in_backward
from slimformer.plan.planner import (
    Plan,
    ladder,
    max_batch,
    max_seq,
    parse_budget,
    plan,
    plannable_layers,
    profile,
    synthetic_batch,
)
from slimformer.plan.profile import MemoryProfile, Prediction

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
