"""MPNet encoders of HuggingFace transformers (>= 5): fused layers with the relative position
bias inside the attention kernel, and fused embeddings.

MPNet's ``MPNetLayer`` is BERT's post-LN encoder layer under other names, plus a learned
relative position bias added to every score:

    c = attention(x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv; mask, bias)   ``attention.attn.q / k / v``
    y = attention.LayerNorm(dropout_p(c Woᵀ + bo) + x)              ``attention.attn.o``
    z = output.LayerNorm(dropout_p(fused_mlp(y)) + y)               ``intermediate``, ``output``

HF's ``MPNetEncoder`` builds that bias as a (batch, heads, seq, seq) tensor every forward,
``relative_attention_bias(bucket(j − i))``, and every layer adds it to its scores. Patched,
the encoder's ``compute_position_bias`` returns a ``RelativePositionBias`` instead: each
fused layer gathers the table at the 2 · seq − 1 offsets once (HF's own bucket function, so
the same values bit for bit) and hands that (heads, 2 · seq − 1) vector to
``slimformer.attention``, whose kernels read it along each tile's diagonals and add the
gradient of every score into it; the table's gradient then flows through the gather. Nothing
(seq, seq)-sized exists in forward or backward. A layer that must run its original forward
(attentions asked for, hooks, replaced submodules) gets HF's tensor, built for that call.

The rest is the BERT-family layer's (``slimformer.integrations.hf.bert``): the same
kernels, recompute policies, quantized Linears and memory modes; the embeddings' LayerNorm
and dropout one fused kernel; ``MPNetForMaskedLM``'s loss fused with its decoder (RoBERTa's
``lm_head`` layout).

With ``unpad=True``, ``MPNetModel`` becomes ``UnpaddedMPNetModel``
(``slimformer.integrations.hf.unpad``, ``MPNetUnpadding``): the real tokens only, every
sequence reading the bias at its own offsets through ``sf.varlen_attention``. A batch with
padding between two tokens of a row runs padded: the padded model's offsets count it.

Left, with the reason in the summary: activations other than gelu / gelu_new /
gelu_pytorch_tanh / relu, head dims above 256, submodules of other types, and every class
that only looks like an MPNet layer or encoder.
"""

import sys

import torch
from torch import nn

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.bert import (
    FusedBertFamilyLayer,
    LayerLayout,
    fuse_embeddings,
    fuse_layer,
    fused_loss,
    layer_problem,
    refuse_packed,
)
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.integrations.hf.unpad import (
    PACKING_ARGUMENT,
    PackedSequences,
    UnpaddedEncoderModel,
    has_padding_between_tokens,
)

__all__ = ["FAMILY", "FusedMPNetLayerMixin", "RelativePositionBias"]

_MODULE = "transformers.models.mpnet.modeling_mpnet"
_LAYER = (_MODULE, "MPNetLayer")
_ENCODER = (_MODULE, "MPNetEncoder")
_EMBEDDINGS = frozenset({(_MODULE, "MPNetEmbeddings")})
_HEADS = frozenset({"lm_head"})
_BASE_MODEL = (_MODULE, "MPNetModel")

_LAYOUT = LayerLayout(
    attention="attention.attn",
    attention_dropout="attention.attn.dropout",
    qkv=("attention.attn.q", "attention.attn.k", "attention.attn.v"),
    out_proj="attention.attn.o",
    out_dropout="attention.dropout",
    out_norm="attention.LayerNorm",
    fc1="intermediate.dense",
    activation="intermediate.intermediate_act_fn",
    fc2="output.dense",
    mlp_dropout="output.dropout",
    mlp_norm="output.LayerNorm",
    containers=("attention", "attention.attn", "intermediate", "output"),
    activation_config=None,  # MPNet's layers keep no config: the activation's class names it
)


class RelativePositionBias:
    """What a patched ``MPNetEncoder`` hands its layers for one forward instead of HF's
    (batch, heads, seq, seq) bias: its table and bucket function, gathered per offset on
    demand (once per length, shared by the layers, so the table's gradient sums over them)."""

    def __init__(self, encoder: nn.Module, hidden_states: torch.Tensor) -> None:
        self.encoder, self.hidden_states = encoder, hidden_states
        self._per_offset: dict[int, torch.Tensor] = {}

    def per_offset(self, seq: int) -> torch.Tensor:
        """(heads, 2 · seq − 1): the bias of key j for query i at index j − i + seq − 1."""
        if seq not in self._per_offset:
            offsets = torch.arange(-(seq - 1), seq, device=self.encoder.relative_attention_bias.weight.device)
            buckets = self.encoder.relative_position_bucket(
                offsets, num_buckets=self.encoder.config.relative_attention_num_buckets
            )
            self._per_offset[seq] = self.encoder.relative_attention_bias(buckets).t()
        return self._per_offset[seq]

    def materialize(self) -> torch.Tensor:
        """HF's own (batch, heads, seq, seq) bias, for a layer that runs its original forward."""
        return type(self.encoder)._original_class.compute_position_bias(self.encoder, self.hidden_states)


class RelativeBiasMPNetEncoder(RuntimeMixin):
    """``MPNetEncoder`` whose position bias is a ``RelativePositionBias`` (see the module
    docstring); ``patch`` makes ``RelativeBiasMPNetEncoder(RelativeBiasMPNetEncoder, MPNetEncoder)``."""

    prefix = "RelativeBias"

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        if position_ids is not None or num_buckets != self.config.relative_attention_num_buckets:
            return super().compute_position_bias(x, position_ids, num_buckets)
        return RelativePositionBias(self, x)


class FusedMPNetLayerMixin(FusedBertFamilyLayer):
    """``FusedBertFamilyLayer``'s forward over ``MPNetLayer`` with the relative position bias
    in the attention kernel; returns the layer's tuple, as the original does."""

    prefix = "Fused"
    layout = _LAYOUT

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        packing = kwargs.pop(PACKING_ARGUMENT, None)
        if packing is not None:
            attention_mask = packing
        if isinstance(position_bias, RelativePositionBias):
            reason = "attentions were asked for" if output_attentions else None
            reason = reason or self._call_reason(attention_mask, (), kwargs) or self._unfused_reason()
            if reason is None:
                packed = isinstance(attention_mask, PackedSequences)
                seq = attention_mask.max_seqlen if packed else hidden_states.shape[1]
                return (self._fused(hidden_states, attention_mask, position_bias.per_offset(seq)),)
            refuse_packed(attention_mask, reason)
            position_bias = position_bias.materialize()
        # a bias tensor from an unpatched encoder, or a call the fused forward cannot take
        return super(FusedBertFamilyLayer, self).forward(
            hidden_states, attention_mask, position_bias, output_attentions=output_attentions, **kwargs
        )


def _class_name(module: nn.Module) -> tuple[str, str]:
    kind = getattr(type(module), "_original_class", type(module))
    return kind.__module__, kind.__name__


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    if (type(module).__module__, type(module).__name__) == _LAYER:
        problem = layer_problem(module, _LAYOUT)
        return (None, problem) if problem else (fuse_layer(module, FusedMPNetLayerMixin), None)
    attention = getattr(module, "attention", None)
    if hasattr(getattr(attention, "attn", None), "o") and hasattr(module, "intermediate"):
        return None, f"{type(module).__name__} is not an MPNet layer verified to compute MPNetLayer's forward"
    return None


def _encoder_class(module: nn.Module) -> tuple[type | None, str | None] | None:
    if (type(module).__module__, type(module).__name__) != _ENCODER:
        return None
    if all(isinstance(layer, FusedMPNetLayerMixin) for layer in module.layer):
        return RelativeBiasMPNetEncoder.over(type(module)), None
    return None, "its layers are not all fused: the position bias stays HF's (batch, heads, seq, seq) tensor"


class MPNetUnpadding(UnpaddedEncoderModel):
    """``UnpaddedEncoderModel`` over ``MPNetModel``, whose forward hands its encoder no
    keyword arguments and builds the layers' mask inline: the packed call runs its steps
    itself, the embeddings (position ids from the padding index, as RoBERTa's) and the
    encoder given the packing as its mask (the layers read the relative bias at the
    longest sequence's offsets); the pooler then reads position 0 as BERT's does."""

    def padded_reason(self, arguments: dict, extra: dict) -> str | None:
        reason = super().padded_reason(arguments, extra)
        if reason is None and has_padding_between_tokens(arguments["attention_mask"]):
            # the packed sequence's offsets j - i would leave out the padding the padded
            # model counts between two tokens (one more host sync, MPNet's only)
            reason = "padding between tokens (MPNet's relative positions count it)"
        return reason

    def packed_forward(self, arguments: dict, extra: dict, packing: PackedSequences):
        embedding_output = self.embeddings(
            input_ids=arguments.get("input_ids"),
            position_ids=arguments["position_ids"],
            inputs_embeds=arguments.get("inputs_embeds"),
        )
        hidden_states = extra.get("output_hidden_states", arguments.get("output_hidden_states"))
        if hidden_states is None:
            hidden_states = self.config.output_hidden_states
        return self.encoder(
            embedding_output, attention_mask=packing, output_hidden_states=bool(hidden_states), return_dict=True
        )

    def _padded_position_ids(self, arguments: dict, packing: PackedSequences) -> torch.Tensor:
        embeddings = self.embeddings
        if arguments.get("input_ids") is not None:
            positions = sys.modules[type(embeddings).__module__].create_position_ids_from_input_ids
            return positions(arguments["input_ids"], embeddings.padding_idx)
        return embeddings.create_position_ids_from_inputs_embeds(arguments["inputs_embeds"])


def _unpadded(model: nn.Module) -> tuple[type | None, str | None] | None:
    if _class_name(model) != _BASE_MODEL:
        return None
    if all(isinstance(layer, FusedMPNetLayerMixin) for layer in model.encoder.layer):
        return MPNetUnpadding.over(type(model)), None
    return None, "unpad: its layers are not all fused"


FAMILY = ModelFamily(
    "MPNet",
    _replacement,
    replace_children=lambda module: fuse_embeddings(module, _EMBEDDINGS),
    fuse_loss=lambda model: fused_loss(model, _HEADS),
    unpad=_unpadded,
    change_class=_encoder_class,
    class_change="relative position bias computed inside the attention kernels",
)
