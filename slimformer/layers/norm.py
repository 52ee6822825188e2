"""Drop-in LayerNorm and RMSNorm on the fused Triton kernels.

Both subclass the torch modules they replace (same constructor, same state_dict,
``isinstance`` still true) and add, as keyword-only extras, the memory-efficient mode
and the fused dropout + residual add of ``slimformer.kernels.norm``.

The memory-efficient mode (the default) keeps the output instead of the input for
backward. Whether the weights allow rebuilding the input from the output is decided
when the layer gets its weights (construction, ``reset_parameters``,
``load_state_dict``, ``from_torch``) and cached, so a training step never syncs with
the host; call ``refresh_memory_mode()`` after changing the weights by hand.
"""

from torch import nn

from slimformer.kernels.norm import layer_norm, output_rebuilds_input, rms_norm
from slimformer.layers.sharing import share_parameters


def _refresh_after_load(module, incompatible_keys) -> None:
    # A module-level function (not a lambda) keeps the layer picklable.
    module.refresh_memory_mode()


class _MemoryModeMixin:
    """Shared by both layers: the cached memory mode, ``from_torch`` and the repr.

    ``saves_output`` is True when memory_efficient was asked for and the weights allow
    rebuilding the input from the output.
    """

    _copied_attributes = ("normalized_shape", "eps", "elementwise_affine")

    def _init_memory_mode(self, memory_efficient: bool) -> None:
        self.memory_efficient = memory_efficient
        self.register_load_state_dict_post_hook(_refresh_after_load)
        self.refresh_memory_mode()

    def refresh_memory_mode(self) -> bool:
        """Re-decide (one host sync) whether backward may rebuild the input from the output.

        Weights on the meta device have no values to judge: the layer saves its input
        until real weights are loaded (``load_state_dict`` decides again)."""
        weight = self.weight
        if weight is not None and weight.is_meta:
            self.saves_output = False
        else:
            self.saves_output = self.memory_efficient and output_rebuilds_input(weight, getattr(self, "bias", None))
        return self.saves_output

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "memory_efficient"):  # torch's __init__ calls this before ours runs
            self.refresh_memory_mode()

    @classmethod
    def from_torch(cls, module: nn.Module, *, memory_efficient: bool = True):
        """The slimformer layer for ``module``, sharing its Parameters (no copies)."""
        layer = share_parameters(cls, module, cls._torch_class, cls._copied_attributes)
        layer._init_memory_mode(memory_efficient)
        return layer

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, memory_efficient={self.memory_efficient}, saves_output={self.saves_output}"


class LayerNorm(_MemoryModeMixin, nn.LayerNorm):
    """``torch.nn.LayerNorm`` on the fused kernel.

    Same arguments as torch, plus ``memory_efficient`` (save the output, not the input,
    when the weights allow it). ``forward(input, residual=None, *, dropout_p=0.0,
    return_residual=False)`` normalises dropout(input) + residual; with only ``input``
    it is exactly ``nn.LayerNorm.forward``.
    """

    _torch_class = nn.LayerNorm

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
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._init_memory_mode(memory_efficient)

    def forward(self, input, residual=None, *, dropout_p: float = 0.0, return_residual: bool = False):
        return layer_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            residual=residual,
            dropout_p=dropout_p,
            memory_efficient=self.saves_output,
            return_residual=return_residual,
        )


class RMSNorm(_MemoryModeMixin, nn.RMSNorm):
    """``torch.nn.RMSNorm`` on the fused kernel; extras as in ``slimformer.LayerNorm``."""

    _torch_class = nn.RMSNorm

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
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._init_memory_mode(memory_efficient)

    def forward(self, input, residual=None, *, dropout_p: float = 0.0, return_residual: bool = False):
        return rms_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.eps,
            residual=residual,
            dropout_p=dropout_p,
            memory_efficient=self.saves_output,
            return_residual=return_residual,
        )
