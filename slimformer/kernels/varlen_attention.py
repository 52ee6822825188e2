"""The import path of ``varlen_attention`` in earlier releases (now in ``slimformer.kernels.attention``)."""

from slimformer.kernels.attention import varlen_attention

__all__ = ["varlen_attention"]
