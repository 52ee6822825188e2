"""Drop-in LayerNorm and RMSNorm on the fused Triton kernels.

Both subclass the torch modules they replace (same constructor, same state_dict,
``isinstance`` still true) and add, as keyword-only extras, the memory-efficient mode
and the fused dropout + residual add of ``slimformer.kernels.norm``.

The memory-efficient mode (the default) keeps the output instead of the input for
backward. Whether the weights allow rebuilding the input from the output is re-decided
whenever they change (an optimizer step, ``load_state_dict``, an in-place edit under
``no_grad``: see ``slimformer.layers.memory_modes.MemoryModes``), for every layer at once with
one host sync per step; call ``refresh_memory_mode()`` after writing through ``.data``.
float64 layers run the PyTorch reference in float64, on any device.
"""

import torch
from torch import nn

from slimformer.kernels.norm import check_eps, check_normalized_shape, default_rms_norm_eps, fused_norm
from slimformer.layers.memory_modes import MEMORY_MODES
from slimformer.layers.sharing import (
    NotScriptable,
    TorchDropout,
    TorchLayerNorm,
    TorchRMSNorm,
    has_call_hooks,
    share_parameters,
)


class _MemoryModeMixin(NotScriptable):
    """Shared by both layers: the memory mode, ``from_torch`` and the repr.

    ``saves_output`` is True when memory_efficient was asked for and the current weights
    allow rebuilding the input from the output (weights on the meta device do not).
    """

    _copied_attributes = ("normalized_shape", "eps", "elementwise_affine")

    def _init_memory_mode(self, memory_efficient: bool) -> None:
        if not isinstance(memory_efficient, bool):
            raise TypeError(f"memory_efficient must be a bool, got {type(memory_efficient).__name__}")
        self.memory_efficient = memory_efficient
        MEMORY_MODES.track(self)

    @property
    def saves_output(self) -> bool:
        return self.memory_efficient and MEMORY_MODES.rebuilds_input(self)

    def _rebuilds_input(self) -> bool:
        # Only a call that records a graph needs (and pays for) the decision.
        return self.memory_efficient and torch.is_grad_enabled() and MEMORY_MODES.rebuilds_input(self)

    def refresh_memory_mode(self) -> bool:
        """Re-decide now (one host sync) whether backward may rebuild the input from the
        output; needed only after writing the weights through ``.data``. Under FSDP2 it
        is a collective over the norm's mesh: call it on every rank."""
        MEMORY_MODES.refresh(self)
        return self.saves_output

    @classmethod
    def from_torch(cls, module: nn.Module, *, memory_efficient: bool = True):
        """The slimformer layer for ``module``, sharing its Parameters (no copies)."""
        layer = share_parameters(cls, module, cls._torch_class, cls._copied_attributes)
        layer._init_memory_mode(memory_efficient)
        return layer

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, memory_efficient={self.memory_efficient}, saves_output={self.saves_output}"


class LayerNorm(_MemoryModeMixin, TorchLayerNorm):
    """``torch.nn.LayerNorm`` on the fused kernel.

    Same arguments as torch, plus ``memory_efficient`` (save the output, not the input,
    when the weights allow it). ``forward(input, residual=None, *, dropout_p=0.0,
    return_residual=False)`` normalises dropout(input) + residual; with only ``input``
    it is exactly ``nn.LayerNorm.forward``.
    """

    _torch_class = TorchLayerNorm

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        memory_efficient: bool = True,
    ):
        check_normalized_shape(normalized_shape)
        check_eps(eps)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._init_memory_mode(memory_efficient)

    def forward(self, input, residual=None, *, dropout_p: float = 0.0, return_residual: bool = False):
        return fused_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            is_rms=False,
            residual=residual,
            dropout_p=dropout_p,
            memory_efficient=self._rebuilds_input(),
            return_residual=return_residual,
        )


class RMSNorm(_MemoryModeMixin, TorchRMSNorm):
    """``torch.nn.RMSNorm`` on the fused kernel; extras as in ``slimformer.LayerNorm``."""

    _torch_class = TorchRMSNorm

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        memory_efficient: bool = True,
    ):
        check_normalized_shape(normalized_shape)
        if eps is not None:
            check_eps(eps)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._init_memory_mode(memory_efficient)

    def forward(self, input, residual=None, *, dropout_p: float = 0.0, return_residual: bool = False):
        eps = default_rms_norm_eps(input) if self.eps is None else self.eps
        return fused_norm(
            input,
            self.normalized_shape,
            self.weight,
            None,
            eps,
            is_rms=True,
            residual=residual,
            dropout_p=dropout_p,
            memory_efficient=self._rebuilds_input(),
            return_residual=return_residual,
        )


class LayerNormDropout(LayerNorm):
    """``dropout(LayerNorm(x))`` in one kernel, for a LayerNorm whose output goes straight
    into a dropout (the last two steps of BERT-family embeddings).

    Made by ``fuse_with_dropout(norm, dropout)`` together with the ``DropoutInNorm`` that
    takes the dropout's place: this module applies that dropout's ``p`` (when it is in
    training mode) to its output, with the mask regenerated from a seed in backward,
    and the dropout module passes its input through. With p > 0 backward keeps the
    input x (the output has zeros, so x̂ cannot be rebuilt from it) and no mask; with
    p = 0 it keeps the output as ``LayerNorm``'s memory-efficient mode does. When
    either module has forward or backward hooks, or p >= 1, the two run unfused (this
    one as ``LayerNorm``, the dropout as ``nn.Dropout``), so hooks see what they would
    see in the original model.
    """

    def forward(self, input):
        if not self.fuses_dropout():
            return super().forward(input)
        dropout = self._dropout
        dropout_p = float(dropout.p) if dropout.training else 0.0
        return fused_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            is_rms=False,
            dropout_p=dropout_p,
            memory_efficient=self._rebuilds_input(),
            dropout_after=True,
        )

    def fuses_dropout(self) -> bool:
        """Whether this call applies the dropout (no hooks on either module, p < 1)."""
        return self._dropout.p < 1 and not (has_call_hooks(self) or has_call_hooks(self._dropout))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropout_p={self._dropout.p}"


class DropoutInNorm(TorchDropout):
    """The place of a dropout that the ``LayerNormDropout`` before it applies: returns its
    input unchanged, or runs ``nn.Dropout`` when that LayerNorm does not fuse it. Keeps
    ``p`` and the train/eval mode, which the LayerNorm reads."""

    def forward(self, input):
        return input if self._norm.fuses_dropout() else super().forward(input)


def fuse_with_dropout(norm: nn.LayerNorm, dropout: nn.Dropout) -> tuple[LayerNormDropout, DropoutInNorm]:
    """The ``LayerNormDropout`` and ``DropoutInNorm`` to put in the places of ``norm`` and
    ``dropout``, sharing their Parameters, attributes and hooks (no copies)."""
    if type(norm) is not TorchLayerNorm:
        raise TypeError(f"norm must be a torch.nn.LayerNorm, got {type(norm).__name__}")
    if type(dropout) is not TorchDropout:
        raise TypeError(f"dropout must be a torch.nn.Dropout, got {type(dropout).__name__}")
    norm_dropout = LayerNormDropout.from_torch(norm)
    dropout_in_norm = share_parameters(DropoutInNorm, dropout, TorchDropout, ("p", "inplace"))
    # plain attributes, not submodules: the module tree and state_dict stay the original's
    object.__setattr__(norm_dropout, "_dropout", dropout_in_norm)
    object.__setattr__(dropout_in_norm, "_norm", norm_dropout)
    return norm_dropout, dropout_in_norm
