"""slimformer's quantization as a transformers quantization method: see
``slimformer.integrations.hf.quantizer`` (importing either registers it).

This module keeps the import paths of earlier releases and of their pickles.
"""

from slimformer.integrations.hf.quantizer import SlimformerHfQuantizer, SlimformerInt8Config, record_quantization

__all__ = ["SlimformerHfQuantizer", "SlimformerInt8Config", "record_quantization"]
