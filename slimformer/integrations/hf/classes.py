"""Classes made at run time: a slimformer mixin over a transformers class.

``patch`` changes a module's class (or builds its replacement) to
``<prefix><Original>(Mixin, Original)``: the mixin's forward first in the method
order, the original's everything else, so ``isinstance`` still holds for transformers'
own checks (output capture, gradient checkpointing). Such a class exists in no module,
so a pickle names the mixin and the original class instead (``new_mixed``).
"""

import copy
import inspect

from slimformer.layers.sharing import forward_with_signature

_MADE: dict[tuple[type, type], type] = {}


class RuntimeMixin:
    """Base of the mixins: ``over(original_class)`` makes their class over a transformers class.

    The class made is ``<prefix><Original>(Mixin, Original)``, once per pair. Its
    ``forward`` is the mixin's under the original's signature (``inspect.signature``
    reads the original's, so transformers' Trainer keeps the dataset columns the model
    takes); ``_original_class`` and ``_forward_signature`` hold the original and its
    forward's signature, plus ``class_attributes(original_class)``.
    """

    prefix = "Fused"

    @classmethod
    def class_attributes(cls, original_class: type) -> dict:
        return {}

    @classmethod
    def over(cls, original_class: type) -> type:
        if (cls, original_class) not in _MADE:
            namespace = {
                "__module__": cls.__module__,
                "_mixin": cls,
                "_original_class": original_class,
                "_forward_signature": inspect.signature(original_class.forward),
                "forward": forward_with_signature(cls.forward, original_class.forward),
                **cls.class_attributes(original_class),
            }
            name = f"{cls.prefix}{original_class.__name__}"
            _MADE[cls, original_class] = type(name, (cls, original_class), namespace)
        return _MADE[cls, original_class]

    @classmethod
    def sharing(cls, module):
        """An instance of ``cls.over(type(module))`` sharing ``module``'s submodules,
        Parameters, attributes and hooks (``__init__`` not run). The module's dicts are
        copied, so that registering on one of the two objects later does not change the
        other; their contents are shared, and ``unpatch`` puts ``module`` itself back."""
        made = cls.over(type(module))
        shared = made.__new__(made)
        shared.__dict__.update(
            {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in module.__dict__.items()}
        )
        return shared

    def __reduce_ex__(self, protocol):
        # The state comes third, set once the object exists, since it may refer back to it.
        return new_mixed, (self._mixin, self._original_class), self.__dict__


def new_mixed(mixin: type[RuntimeMixin], original_class: type):
    """An empty instance of ``mixin.over(original_class)`` (``__init__`` not run), which
    unpickling then fills."""
    made = mixin.over(original_class)
    return made.__new__(made)
