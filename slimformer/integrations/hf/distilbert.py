"""DistilBERT encoders of HuggingFace transformers (>= 5): fused transformer blocks and embeddings.

DistilBERT's ``TransformerBlock`` is BERT's post-LN encoder layer under other names, with
no dropout on the attention output (p the FFN's dropout):

    c = attention(x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv; mask)   ``attention.q_lin / k_lin / v_lin``
    y = sa_layer_norm(c Woᵀ + bo + x)                          ``attention.out_lin``, one kernel
    z = output_layer_norm(dropout_p(ffn(y)) + y)               ``ffn.lin1``, activation, ``ffn.lin2``

so it runs ``FusedBertFamilyLayer``'s forward (``slimformer.integrations.hf.bert``) over the
block's own layout: the same kernels, recompute policies, fallbacks to the original
forward (attentions asked for, a mask that is not a tensor, hooks on or replaced
submodules it does not call), quantized Linears and memory modes. ``FusedDistilBertTransformerBlock``
subclasses the block's class and shares its submodules, so Parameters, ``state_dict``
keys and hooks are the original's, and ``unpatch`` puts the original object back. The
embeddings' ``LayerNorm`` and ``dropout`` become one fused norm kernel, as BERT's, after
the same check of their forward's source. ``DistilBertForMaskedLM`` gets the fused
masked-LM loss (``slimformer.integrations.hf.masked_lm``): its ``vocab_transform``,
``activation`` and ``vocab_layer_norm`` on the labelled positions only, and
``vocab_projector`` (tied to the word embeddings) fused with the cross-entropy.

With ``unpad=True``, ``DistilBertModel`` becomes ``UnpaddedDistilBertModel``
(``slimformer.integrations.hf.unpad``), which runs on the real tokens only; it builds its
mask inline, so its blocks get the packing as a keyword argument
(``unpad.PACKING_ARGUMENT``).

Left, with the reason in the summary: activations other than gelu / gelu_new /
gelu_pytorch_tanh / relu, head dims above 256, submodules of other types, and every
class that only looks like a DistilBERT block.
"""

from torch import nn

from slimformer.integrations.hf.bert import FusedBertFamilyLayer, LayerLayout, layout_family
from slimformer.integrations.hf.unpad import UnpaddedEncoderModel

__all__ = ["FAMILY", "FusedDistilBertLayer"]

_MODULE = "transformers.models.distilbert.modeling_distilbert"
_BLOCK = (_MODULE, "TransformerBlock")
_EMBEDDINGS = frozenset({(_MODULE, "Embeddings")})
# The head layout ``slimformer.integrations.hf.masked_lm`` gives DistilBertForMaskedLM.
_HEADS = frozenset({"distilbert"})
_BASE_MODEL = (_MODULE, "DistilBertModel")

_LAYOUT = LayerLayout(
    attention="attention",
    attention_dropout="attention.dropout",
    qkv=("attention.q_lin", "attention.k_lin", "attention.v_lin"),
    out_proj="attention.out_lin",
    out_dropout=None,
    out_norm="sa_layer_norm",
    fc1="ffn.lin1",
    activation="ffn.activation",
    fc2="ffn.lin2",
    mlp_dropout="ffn.dropout",
    mlp_norm="output_layer_norm",
    containers=("attention", "ffn"),
    activation_config="activation",
)


class FusedDistilBertLayer(FusedBertFamilyLayer):
    """``FusedBertFamilyLayer``'s forward over DistilBERT's ``TransformerBlock`` (see the
    module docstring); ``patch`` makes ``FusedDistilBertTransformerBlock(FusedDistilBertLayer,
    TransformerBlock)``."""

    prefix = "FusedDistilBert"
    layout = _LAYOUT


def _looks_like_block(module: nn.Module) -> str | None:
    attention = getattr(module, "attention", None)
    looks = hasattr(attention, "q_lin") and hasattr(module, "ffn") and hasattr(module, "sa_layer_norm")
    return "a DistilBERT block" if looks else None


class DistilBertUnpadding(UnpaddedEncoderModel):
    """``UnpaddedEncoderModel`` over ``DistilBertModel``: blocks in ``transformer.layer``,
    the mask built inline, no pooler."""

    builds_mask_inline = True

    def encoder_layers(self) -> list[nn.Module]:
        return list(self.transformer.layer)


FAMILY = layout_family(
    "DistilBERT", _BLOCK, FusedDistilBertLayer, _looks_like_block, _EMBEDDINGS, _HEADS, _BASE_MODEL, DistilBertUnpadding
)
