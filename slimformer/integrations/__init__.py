"""Integrations of slimformer with model libraries: ``hf`` for HuggingFace transformers.

An integration module recognises one model family's modules by their exact classes
(named by module and class, so that the library is never imported for the check),
verifies what slimformer cannot see from the class alone (a forward's source, the
submodules' types), and builds the replacement. ``slimformer.patch`` asks every family
in its registry through a ``ModelFamily``; integrations import kernels and layers, and
never ``slimformer.patch``.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = ["ModelFamily"]


@dataclass(frozen=True)
class ModelFamily:
    """What one model family's integration tells ``slimformer.patch``.

    Every function is asked about each module ``patch`` visits and answers None for a
    module that is not of its family; otherwise (the new object, None) or (None, why
    the module is left, as the summary prints it).

    replace(module): the module to put in ``module``'s place.
    replace_children(module): {child attribute: replacement} for children fused
        together while ``module`` itself stays (BERT's embeddings: LayerNorm, dropout).
    fuse_loss(model): the class that ``model`` (a model with a loss head) changes to,
        in place, so that its loss skips the vocabulary logits.
    unpad(model): with ``patch(unpad=True)``, the class that ``model`` (a base model
        whose layers are already swapped) changes to, in place, to run on its real
        tokens only.
    change_class(module): the class that ``module`` changes to, in place, once the
        swaps are made (MPNet's encoder: its position bias for the fused layers);
        ``class_change`` says what it changes, for the summary.
    """

    name: str
    replace: Callable[[nn.Module], tuple[nn.Module | None, str | None] | None]
    replace_children: Callable[[nn.Module], tuple[dict[str, nn.Module], str | None] | None] | None = None
    fuse_loss: Callable[[nn.Module], tuple[type | None, str | None] | None] | None = None
    unpad: Callable[[nn.Module], tuple[type | None, str | None] | None] | None = None
    change_class: Callable[[nn.Module], tuple[type | None, str | None] | None] | None = None
    class_change: str = ""
