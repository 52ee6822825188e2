"""ALBERT encoders of HuggingFace transformers (>= 5): fused layers and embeddings.

ALBERT's ``AlbertLayer`` is BERT's post-LN encoder layer under other names, with no
dropout after the MLP (p the hidden dropout):

    c = attention(x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv; mask)   ``attention.query / key / value``
    y = attention.LayerNorm(dropout_p(c Woᵀ + bo) + x)         ``attention.dense``, one kernel
    z = full_layer_layer_norm(ffn_output(act(ffn(y))) + y)     the fused MLP, one norm kernel

so it runs ``FusedBertFamilyLayer``'s forward (``slimformer.integrations.hf.bert``) over the
layer's own layout: the same kernels, recompute policies, fallbacks to the original
forward, quantized Linears and memory modes. ``FusedAlbertLayer`` subclasses the layer's
class and shares its submodules, so Parameters, ``state_dict`` keys and hooks are the
original's, and ``unpatch`` puts the original object back.

**One layer, applied many times.** ``AlbertTransformer`` runs its ``num_hidden_groups``
layer groups ``num_hidden_layers`` times in all (ALBERT-base: one layer, twelve times), so
the one fused layer object runs at every application: each application keeps its own
tensors for backward (a recompute policy acts on each), and the shared weights' gradients
sum over the applications as in HF. ``slimformer.memory``'s report counts each
application of a layer.

The embeddings' ``LayerNorm`` and ``dropout`` (over the embedding size, before
``embedding_hidden_mapping_in`` projects to the hidden size) become one fused norm
kernel, as BERT's, after the same check of their forward's source. ``AlbertForMaskedLM``
gets the fused masked-LM loss (``slimformer.integrations.hf.masked_lm``): its
``predictions.dense``, activation and ``LayerNorm`` on the labelled positions only, and
``predictions.decoder`` (tied to the word embeddings) fused with the cross-entropy.

With ``unpad=True``, ``AlbertModel`` becomes ``UnpaddedAlbertModel``
(``slimformer.integrations.hf.unpad``), which runs on the real tokens only (every
application of the shared layer); it builds its mask inline, so its layers get the
packing as a keyword argument (``unpad.PACKING_ARGUMENT``), and its pooler (a Linear,
then tanh) reads the rows at position 0.

Left, with the reason in the summary: activations other than gelu / gelu_new /
gelu_pytorch_tanh / relu, head dims above 256, submodules of other types, and every
class that only looks like an ALBERT layer. ``chunk_size_feed_forward`` is not needed (the fused MLP keeps less than a chunked one)
and is ignored, as for BERT.
"""

from torch import nn

from slimformer.integrations.hf.bert import FusedBertFamilyLayer, LayerLayout, layout_family
from slimformer.integrations.hf.unpad import UnpaddedEncoderModel

__all__ = ["FAMILY", "FusedAlbertLayerMixin"]

_MODULE = "transformers.models.albert.modeling_albert"
_LAYER = (_MODULE, "AlbertLayer")
_EMBEDDINGS = frozenset({(_MODULE, "AlbertEmbeddings")})
# The head layout ``slimformer.integrations.hf.masked_lm`` gives AlbertForMaskedLM.
_HEADS = frozenset({"albert"})
_BASE_MODEL = (_MODULE, "AlbertModel")

_LAYOUT = LayerLayout(
    attention="attention",
    attention_dropout="attention.attention_dropout",
    qkv=("attention.query", "attention.key", "attention.value"),
    out_proj="attention.dense",
    out_dropout="attention.output_dropout",
    out_norm="attention.LayerNorm",
    fc1="ffn",
    activation="activation",
    fc2="ffn_output",
    mlp_dropout=None,  # AlbertLayer.dropout exists, but its forward never calls it
    mlp_norm="full_layer_layer_norm",
    containers=("attention",),
    activation_config="hidden_act",
)


class FusedAlbertLayerMixin(FusedBertFamilyLayer):
    """``FusedBertFamilyLayer``'s forward over ALBERT's ``AlbertLayer`` (see the module
    docstring); ``patch`` makes ``FusedAlbertLayer(FusedAlbertLayerMixin, AlbertLayer)``."""

    prefix = "Fused"
    layout = _LAYOUT


def _looks_like_layer(module: nn.Module) -> str | None:
    attention = getattr(module, "attention", None)
    looks = hasattr(attention, "query") and hasattr(module, "ffn_output") and hasattr(module, "full_layer_layer_norm")
    return "an ALBERT layer" if looks else None


class AlbertUnpadding(UnpaddedEncoderModel):
    """``UnpaddedEncoderModel`` over ``AlbertModel``: layers in the layer groups, the mask
    built inline, a pooler that is a Linear followed by ``pooler_activation``."""

    builds_mask_inline = True

    def encoder_layers(self) -> list[nn.Module]:
        return [layer for group in self.encoder.albert_layer_groups for layer in group.albert_layers]

    def pooled(self, first):
        return self.pooler_activation(self.pooler(first))


FAMILY = layout_family(
    "ALBERT", _LAYER, FusedAlbertLayerMixin, _looks_like_layer, _EMBEDDINGS, _HEADS, _BASE_MODEL, AlbertUnpadding
)
