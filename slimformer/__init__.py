"""slimformer: fused Triton kernels and drop-in layers for memory-lean Transformers.

Where transformers is installed, slimformer's attention is registered with it as
"slimformer" (``register_transformers_attention``) and its quantization as quant method
"slimformer" (``SlimformerInt8Config``) as soon as both are imported, in either order, so
that ``attn_implementation="slimformer"`` and ``from_pretrained`` of a slimformer-quantized
checkpoint work without a call. Importing
slimformer does not import transformers: that would add about 2 s (``transformers`` and
``transformers.modeling_utils``, which holds the registry) to every import. When
transformers is not imported yet, a finder on ``sys.meta_path`` waits for
``transformers.modeling_utils`` to be loaded, registers right after, and removes itself.
"""

import importlib.abc
import importlib.util
import sys
import warnings

from slimformer import memory
from slimformer._version import __version__
from slimformer.integrations.hf.attention import register_transformers_attention
from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import (
    attention,
    disentangled_attention,
    self_attention,
    varlen_attention,
    varlen_disentangled_attention,
)
from slimformer.kernels.dropout import dropout_add
from slimformer.kernels.linear_cross_entropy import linear_cross_entropy
from slimformer.kernels.norm import layer_norm, rms_norm
from slimformer.layers.attention import MultiheadAttention, SelfAttention
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.layers.mlp import FusedMLP
from slimformer.layers.norm import LayerNorm, RMSNorm
from slimformer.layers.transformer import TransformerEncoderLayer
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.plan import Plan, max_batch, max_seq, optimizer_in_backward, plan
from slimformer.quantize import fidelity_report, load_quantized, quantize, save_quantized
from slimformer.recompute import recompute

__all__ = [
    "__version__",
    "FusedMLP",
    "LayerNorm",
    "Linear16bit",
    "Linear8bit",
    "MultiheadAttention",
    "Plan",
    "RMSNorm",
    "SelfAttention",
    "SlimformerInt8Config",
    "TransformerEncoderLayer",
    "attention",
    "disentangled_attention",
    "dropout_add",
    "fidelity_report",
    "fused_mlp",
    "layer_norm",
    "linear_cross_entropy",
    "load_quantized",
    "max_batch",
    "max_seq",
    "memory",
    "optimizer_in_backward",
    "patch",
    "patch_summary",
    "plan",
    "quantize",
    "recompute",
    "register_transformers_attention",
    "rms_norm",
    "save_quantized",
    "self_attention",
    "unpatch",
    "varlen_attention",
    "varlen_disentangled_attention",
]

_REGISTRY_MODULE = "transformers.modeling_utils"


def _register_with_transformers() -> None:
    """slimformer's attention as attn_implementation "slimformer", and its quantization as
    quant method "slimformer" (``SlimformerInt8Config``: a saved int8 checkpoint then loads
    into int8 layers through ``from_pretrained``)."""
    # An optional integration: a transformers this registration does not fit must still import.
    try:
        register_transformers_attention()
        import slimformer.integrations.hf.quantizer  # noqa: F401  (registers on import)
    except Exception as error:
        warnings.warn(
            f"slimformer could not register with transformers ({type(error).__name__}: {error}); "
            "attn_implementation='slimformer' and quant method 'slimformer' are unavailable",
            stacklevel=2,
        )


def __getattr__(name: str):
    # SlimformerInt8Config subclasses a transformers class: imported when asked for, so that
    # importing slimformer does not import transformers
    if name == "SlimformerInt8Config":
        from slimformer.integrations.hf.quantizer import SlimformerInt8Config

        return SlimformerInt8Config
    raise AttributeError(f"module 'slimformer' has no attribute {name!r}")


class _RegisterAfterLoading(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``transformers.modeling_utils`` through the other finders, once, and registers
    slimformer's attention right after the module has run; the module keeps its own loader."""

    def find_spec(self, name, path, target=None):
        if name != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _register_with_transformers()


if _REGISTRY_MODULE in sys.modules:
    _register_with_transformers()
elif importlib.util.find_spec("transformers") is not None:
    sys.meta_path.insert(0, _RegisterAfterLoading())
