"""slimformer: fused Triton kernels and drop-in layers for memory-lean Transformers."""

from slimformer._version import __version__

from slimformer import memory
from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import attention, self_attention
from slimformer.kernels.dropout import dropout_add
from slimformer.kernels.linear_cross_entropy import linear_cross_entropy
from slimformer.kernels.norm import layer_norm, rms_norm
from slimformer.kernels.varlen_attention import varlen_attention
from slimformer.layers.attention import MultiheadAttention, SelfAttention, register_transformers_attention
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.layers.mlp import FusedMLP
from slimformer.layers.norm import LayerNorm, RMSNorm
from slimformer.layers.transformer import TransformerEncoderLayer
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.quantize import fidelity_report, load_quantized, quantize, save_quantized
from slimformer.recompute import recompute

__all__ = [
    "__version__",
    "FusedMLP",
    "LayerNorm",
    "Linear16bit",
    "Linear8bit",
    "MultiheadAttention",
    "RMSNorm",
    "SelfAttention",
    "TransformerEncoderLayer",
    "attention",
    "dropout_add",
    "fidelity_report",
    "fused_mlp",
    "layer_norm",
    "linear_cross_entropy",
    "load_quantized",
    "memory",
    "patch",
    "patch_summary",
    "quantize",
    "recompute",
    "register_transformers_attention",
    "rms_norm",
    "save_quantized",
    "self_attention",
    "unpatch",
    "varlen_attention",
]
