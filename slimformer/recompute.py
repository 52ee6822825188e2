"""``sf.recompute(model, policy)``: one recompute policy for every slimformer layer of a model.

The policies, what each recomputes and why every one gives the same gradients:
``slimformer.layers.policies``.
"""

from torch import nn

# re-exported: their import path in earlier releases, and the one model code reads
from slimformer.layers.policies import POLICIES, check_policy

__all__ = ["POLICIES", "check_policy", "recompute"]


def recompute(model: nn.Module, policy: str) -> nn.Module:
    """Set ``policy`` on every slimformer layer in ``model`` (in place); returns ``model``.

    A layer takes part when it has a ``recompute`` attribute that is a policy name; it
    can be switched between steps. Raises ValueError for an unknown policy or a model
    without such layers.
    """
    check_policy(policy)
    layers = [module for module in model.modules() if getattr(module, "recompute", None) in POLICIES]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no slimformer layer with a recompute policy")
    for layer in layers:
        layer.recompute = policy
    return model
