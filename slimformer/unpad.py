"""Unpadded BERT-family encoders: see ``slimformer.integrations.hf.unpad``.

This module keeps the import paths of earlier releases and of their pickles.
"""

from slimformer.integrations.hf.classes import new_mixed
from slimformer.integrations.hf.unpad import (
    PackedSequences,
    UnpaddedEncoderModel,
    is_unpaddable_base_model,
    pack_padding_mask,
    pad_tokens,
    unpad_tokens,
)

__all__ = [
    "PackedSequences",
    "UnpaddedEncoderModel",
    "is_unpaddable_base_model",
    "pack_padding_mask",
    "pad_tokens",
    "unpad_tokens",
    "unpadded_class",
]

unpadded_class = UnpaddedEncoderModel.over


def _new_unpadded(original_class: type):
    # named by pickles of unpadded models from earlier releases
    return new_mixed(UnpaddedEncoderModel, original_class)
