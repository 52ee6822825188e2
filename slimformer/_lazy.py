"""Package attributes imported on first use (PEP 562).

``import slimformer`` and ``python -m slimformer.plan --help`` must not import torch, so a
package's public names come from their modules when first asked for. A package can name a
function after the module that defines it (``sf.plan``, ``sf.memory.report``): importing the
module binds the package's attribute to the module, so such a package leaves that binding
out, and the name stays the function.
"""

import importlib
import sys
import types

__all__ = ["make_lazy"]


class _LazyPackage(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__.get("_functions_over_modules", ()) and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def make_lazy(package: str, lazy: dict[str, str], functions_over_modules: tuple[str, ...] = ()) -> None:
    """Gives the package ``package`` its lazy attributes: ``lazy`` maps each public name to the
    module (absolute) that defines it, or that is it where the module has no such attribute
    (``sf.memory``); ``functions_over_modules`` are the names that stay functions."""
    module = sys.modules[package]
    module.__dict__["_functions_over_modules"] = functions_over_modules
    module.__class__ = _LazyPackage

    def __getattr__(name: str):
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        defining = importlib.import_module(lazy[name])
        value = getattr(defining, name, defining)
        module.__dict__[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *module.__dict__.get("__all__", ())})

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
