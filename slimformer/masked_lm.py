"""The fused masked-LM loss of BERT-family models: see ``slimformer.integrations.hf.masked_lm``.

This module keeps the import paths of earlier releases and of their pickles.
"""

from slimformer.integrations.hf.classes import new_mixed
from slimformer.integrations.hf.masked_lm import FusedMaskedLM, is_masked_lm, masked_lm_problem

__all__ = ["FusedMaskedLM", "fused_masked_lm_class", "is_masked_lm", "masked_lm_problem"]

fused_masked_lm_class = FusedMaskedLM.over


def _new_fused_masked_lm(original_class: type):
    # named by pickles of masked-LM models patched by earlier releases
    return new_mixed(FusedMaskedLM, original_class)
