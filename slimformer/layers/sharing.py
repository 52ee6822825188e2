"""Building a slimformer layer around an existing torch module's Parameters."""

from torch import nn


def share_parameters(cls: type, module: nn.Module, torch_class: type, attributes: tuple[str, ...]) -> nn.Module:
    """A ``cls`` instance holding ``module``'s ``attributes``, Parameters and submodules (no copies).

    ``cls.__init__`` is not run (it would allocate new Parameters); the caller sets the
    layer's own extra attributes afterwards. Raises TypeError unless ``module`` is a
    ``torch_class``.
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
    layer.train(module.training)
    return layer
