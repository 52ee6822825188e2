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

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from slimformer._lazy import make_lazy
from slimformer._version import __version__

# Public name -> the module defining it, imported on first use (PEP 562), so that importing
# slimformer (and ``python -m slimformer.plan --help``) does not import torch.
_LAZY = {
    "memory": "slimformer.memory",
    "register_transformers_attention": "slimformer.integrations.hf.attention",
    "fused_mlp": "slimformer.kernels.activation",
    **dict.fromkeys(
        [
            "attention",
            "disentangled_attention",
            "self_attention",
            "varlen_attention",
            "varlen_disentangled_attention",
        ],
        "slimformer.kernels.attention",
    ),
    "dropout_add": "slimformer.kernels.dropout",
    "linear_cross_entropy": "slimformer.kernels.linear_cross_entropy",
    "layer_norm": "slimformer.kernels.norm",
    "rms_norm": "slimformer.kernels.norm",
    "MultiheadAttention": "slimformer.layers.attention",
    "SelfAttention": "slimformer.layers.attention",
    "Linear8bit": "slimformer.layers.linear",
    "Linear16bit": "slimformer.layers.linear",
    "FusedMLP": "slimformer.layers.mlp",
    "LayerNorm": "slimformer.layers.norm",
    "RMSNorm": "slimformer.layers.norm",
    "TransformerEncoderLayer": "slimformer.layers.transformer",
    **dict.fromkeys(["patch", "patch_summary", "unpatch"], "slimformer.patch"),
    **dict.fromkeys(["Plan", "max_batch", "max_seq", "optimizer_in_backward", "plan"], "slimformer.plan"),
    **dict.fromkeys(["fidelity_report", "load_quantized", "quantize", "save_quantized"], "slimformer.quantize"),
    "recompute": "slimformer.recompute",
    # a transformers subclass: asking for it imports transformers
    "SlimformerInt8Config": "slimformer.integrations.hf.quantizer",
}

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
        from slimformer.integrations.hf.attention import register_transformers_attention

        register_transformers_attention()
        import slimformer.integrations.hf.quantizer  # noqa: F401  (registers on import)
    except Exception as error:
        warnings.warn(
            f"slimformer could not register with transformers ({type(error).__name__}: {error}); "
            "attn_implementation='slimformer' and quant method 'slimformer' are unavailable",
            stacklevel=2,
        )


# slimformer.plan, .patch, .quantize and .recompute are modules whose public name in the
# package is their function (sf.plan(...)).
make_lazy(__name__, _LAZY, ("patch", "plan", "quantize", "recompute"))


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
