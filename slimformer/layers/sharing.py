"""Building a slimformer layer around an existing torch module's Parameters, and what
every slimformer module shares."""

import copy
import functools
import inspect
import types

from torch import nn

# torch's classes as the modules defining them hold them. The global drop-in pattern
# (``torch.nn.MultiheadAttention = slimformer.MultiheadAttention``) rebinds only torch.nn's
# names, so a check against ``nn.MultiheadAttention`` would then refuse torch's own modules.
from torch.nn.modules.activation import MultiheadAttention as TorchMultiheadAttention
from torch.nn.modules.dropout import Dropout as TorchDropout
from torch.nn.modules.linear import Linear as TorchLinear
from torch.nn.modules.normalization import LayerNorm as TorchLayerNorm, RMSNorm as TorchRMSNorm
from torch.nn.modules.transformer import TransformerEncoderLayer as TorchTransformerEncoderLayer

__all__ = [
    "NotScriptable",
    "TorchDropout",
    "TorchLayerNorm",
    "TorchLinear",
    "TorchMultiheadAttention",
    "TorchRMSNorm",
    "TorchTransformerEncoderLayer",
    "any_has_call_hooks",
    "forward_with_signature",
    "has_call_hooks",
    "has_user_hooks",
    "share_parameters",
]

# nn.Module's per-call hooks (forward, forward-pre, backward), with their flags
_CALL_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def share_parameters(cls: type, module: nn.Module, torch_class: type, attributes: tuple[str, ...]) -> nn.Module:
    """A ``cls`` instance holding ``module``'s ``attributes``, Parameters, submodules and
    call hooks (no copies of tensors or modules).

    ``cls.__init__`` is not run (it would allocate new Parameters); the caller sets the
    layer's own extra attributes afterwards. Raises TypeError unless ``module`` is a
    ``torch_class`` (one of the classes above, which a slimformer module also is).
    """
    if not isinstance(module, torch_class):
        raise TypeError(f"module must be a torch.nn.{torch_class.__name__}, got {type(module).__name__}")
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    for name in attributes:
        setattr(layer, name, getattr(module, name))
    for name, parameter in module._parameters.items():
        layer.register_parameter(name, parameter)
    for name, child in module._modules.items():
        layer.add_module(name, child)
    for name in _CALL_HOOKS:
        # copies: hooks registered on ``module`` so far run on the layer too; later ones on either do not
        setattr(layer, name, copy.copy(getattr(module, name)))
    layer.train(module.training)
    return layer


def has_call_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward(-pre) or backward hooks of its own."""
    return any(getattr(module, name) for name in _CALL_HOOKS)


def any_has_call_hooks(*modules) -> bool:
    """Whether any of ``modules`` that is an ``nn.Module`` (a plain function is not) has call hooks."""
    return any(isinstance(module, nn.Module) and has_call_hooks(module) for module in modules)


def has_user_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks, other than transformers' output
    capturing hooks (inactive unless outputs such as attentions are asked for)."""
    hooks = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)
    return any(
        "output_capturing_hook" not in getattr(hook, "__qualname__", "") for table in hooks for hook in table.values()
    )


class NotScriptable:
    """Mixin: ``torch.jit.script`` of the module (or of a model holding it) says why it
    cannot work, instead of failing somewhere inside TorchScript's compiler."""

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"slimformer.{type(self).__name__} is not scriptable with torch.jit.script: it runs Triton kernels "
            "through torch.autograd.Function, which TorchScript cannot compile; use torch.compile(model) instead"
        )


def forward_with_signature(forward, original):
    """A copy of ``forward``, a mixin's ``forward(self, ...)``, that ``inspect.signature``
    reports as ``original``'s: for a class made at run time over ``original``'s class, so
    that what reads a model's parameters from its forward (transformers' Trainer choosing
    the dataset columns to keep, its model tests, PEFT) sees the original's. The mixin
    takes every call the original takes. A copy of the function rather than a wrapper: no
    extra frame, so a graph break inside it stays one break under ``torch.compile``."""
    signed = types.FunctionType(
        forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    functools.update_wrapper(signed, forward)
    signed.__kwdefaults__ = forward.__kwdefaults__
    signed.__signature__ = inspect.signature(original)
    del signed.__wrapped__  # the signature is original's, not the mixin's
    return signed
