"""DeBERTa-v2 and -v3 encoders of HuggingFace transformers (>= 5): fused layers with the
disentangled attention in one kernel (``slimformer.kernels.attention.disentangled``).

``DebertaV2Layer`` is BERT's post-LN encoder layer under other names, whose attention
adds content→position and position→content scores from the relative-position embeddings
that the encoder normalises once and hands to every layer:

    pk, pq = pos_key_proj(e), pos_query_proj(e)    (key_proj, query_proj if share_att_key)
    c = disentangled_attention(q(x), k(x), v(x), pk, pq; padding, buckets)
    y = attention.output.LayerNorm(dropout_p(c Woᵀ + bo) + x)
    z = output.LayerNorm(dropout_p(fused_mlp(y)) + y)

with e = ``pos_dropout(rel_embeddings)[: 2 · span]``. HF builds and keeps several (batch,
heads, seq, seq) tensors per layer (the c2p and p2c products, their gathers, the scores,
the probabilities, the dropout mask); the fused layer keeps q, k, v, o, the log-sum-exp
and the (2 · span, hidden) projections of e, and nothing (seq, seq)-sized exists in
forward or backward. ``DebertaV2ForMaskedLM``'s loss is fused with its decoder
(``slimformer.integrations.hf.masked_lm``, either head: ``config.legacy`` or not). The
rest is the BERT-family layer's (``slimformer.integrations.hf.bert``):
the same kernels, recompute policies (``qkv`` recomputes the projections and the attention,
also those of e), quantized Linears and memory modes.

Patched, the encoder (``Disentangled<Encoder>``) hands its layers a ``PaddingMask`` and
``RelativePositions`` in place of HF's (batch, 1, seq, seq) mask and (1, seq, seq)
relative positions; a layer that must run its original forward (attentions asked for,
``query_states``, hooks, replaced submodules) gets HF's tensors, built for that call. HF's
padded query rows attend to every key with equal weight (all their scores are
``finfo.min``); the kernel gives them that too (``query_padding_mask``), so every output
position equals HF's.

A config without relative attention (``relative_attention=False``, as in transformers' own
test config, ``pos_att_type="none"``) has plain attention layers and no relative-position
embeddings: they run the same kernel with no position term, which keeps HF's padded query
rows, and the scale HF gives them, 1 / sqrt(head_dim · (1 + the c2p / p2c named in
pos_att_type)).

With ``unpad=True``, ``DebertaV2Model`` becomes ``UnpaddedDebertaV2Model``
(``DebertaV2Unpadding``): the real tokens only, every sequence at its own relative positions
through ``varlen_disentangled_attention``. A batch with padding between two tokens of a row
runs padded (the padded model's relative positions count that padding), as does a model
with v2-xlarge's conv layer.

Left, with the reason in the summary: ``DebertaV2Embeddings`` (its mask multiply sits
between the LayerNorm and the dropout), DeBERTa-v1 (``DebertaLayer``: a fused in_proj and
another position layout), activations other than gelu / gelu_new / gelu_pytorch_tanh /
relu, head dims above 256, position terms other than c2p and p2c with relative attention,
and classes that only look like a DeBERTa-v2 layer or encoder.
"""

import torch
from einops import rearrange
from torch import nn

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.bert import (
    FusedBertFamilyLayer,
    LayerLayout,
    fuse_layer,
    fused_loss,
    layer_problem,
    refuse_packed,
)
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.integrations.hf.unpad import PackedSequences, UnpaddedEncoderModel, has_padding_between_tokens
from slimformer.kernels.attention.disentangled import disentangled_attention, varlen_disentangled_attention

__all__ = ["FAMILY", "FusedDebertaV2LayerMixin", "PaddingMask", "RelativePositions"]

_MODULE = "transformers.models.deberta_v2.modeling_deberta_v2"
_LAYER = (_MODULE, "DebertaV2Layer")
_ENCODER = (_MODULE, "DebertaV2Encoder")
_POSITION_TERMS = ("c2p", "p2c")

_LAYOUT = LayerLayout(
    attention="attention.self",
    attention_dropout="attention.self.dropout",
    qkv=("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
    out_proj="attention.output.dense",
    out_dropout="attention.output.dropout",
    out_norm="attention.output.LayerNorm",
    fc1="intermediate.dense",
    activation="intermediate.intermediate_act_fn",
    fc2="output.dense",
    mlp_dropout="output.dropout",
    mlp_norm="output.LayerNorm",
    containers=("attention", "attention.self", "attention.output", "intermediate", "output"),
    activation_config=None,  # DisentangledSelfAttention keeps no config: the activation's class names it
)


class PaddingMask:
    """What a patched encoder hands its layers instead of HF's (batch, 1, seq, seq) mask
    built from a (batch, seq) padding mask (nonzero = token)."""

    def __init__(self, encoder: nn.Module, mask: torch.Tensor) -> None:
        self.encoder, self.mask = encoder, mask
        self.padding = mask == 0

    def materialize(self) -> torch.Tensor:
        """HF's own mask, for a layer that runs its original forward."""
        return type(self.encoder)._original_class.get_attention_mask(self.encoder, self.mask)


class RelativePositions:
    """What a patched encoder hands its layers instead of HF's (1, seq, seq) relative positions."""

    def __init__(self, encoder: nn.Module, hidden_states: torch.Tensor) -> None:
        self.encoder, self.hidden_states = encoder, hidden_states

    def materialize(self) -> torch.Tensor:
        return type(self.encoder)._original_class.get_rel_pos(self.encoder, self.hidden_states)


def _materialized(value):
    return value.materialize() if isinstance(value, (PaddingMask, RelativePositions)) else value


class DisentangledDebertaV2Encoder(RuntimeMixin):
    """``DebertaV2Encoder`` whose mask and relative positions are ``PaddingMask`` and
    ``RelativePositions`` (see the module docstring)."""

    prefix = "Disentangled"

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, PackedSequences):
            return self._packed_forward(hidden_states, attention_mask)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)

    def _packed_forward(self, hidden_states, packing: PackedSequences):
        """HF's encoder loop on packed (1, total, hidden) tokens: every layer's output, as
        ``output_hidden_states=True`` gives them (DebertaV2Model asks for them always)."""
        from transformers.modeling_outputs import BaseModelOutput

        rel_embeddings = self.get_rel_embedding()
        positions = RelativePositions(self, hidden_states) if self.relative_attention else None
        states = [hidden_states]
        for layer in self.layer:
            states.append(layer(states[-1], packing, relative_pos=positions, rel_embeddings=rel_embeddings)[0])
        return BaseModelOutput(last_hidden_state=states[-1], hidden_states=tuple(states))

    def get_attention_mask(self, attention_mask):
        if attention_mask.dim() == 2:
            return PaddingMask(self, attention_mask)
        return super().get_attention_mask(attention_mask)

    def get_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
        if query_states is None and relative_pos is None:
            return RelativePositions(self, hidden_states) if self.relative_attention else None
        return super().get_rel_pos(hidden_states, query_states, relative_pos)


class FusedDebertaV2LayerMixin(FusedBertFamilyLayer):
    """``FusedBertFamilyLayer``'s forward over ``DebertaV2Layer`` with the disentangled
    attention kernel; returns the layer's (output, None), as the original does."""

    prefix = "Fused"
    layout = _LAYOUT

    def forward(
        self,
        hidden_states,
        attention_mask,
        query_states=None,
        relative_pos=None,
        rel_embeddings=None,
        output_attentions=False,
    ):
        reason = self._deberta_call_reason(attention_mask, query_states, relative_pos, output_attentions)
        reason = reason or self._unfused_reason()
        if reason is not None:
            refuse_packed(attention_mask, reason)
            return super(FusedBertFamilyLayer, self).forward(
                hidden_states,
                _materialized(attention_mask),
                query_states=query_states,
                relative_pos=_materialized(relative_pos),
                rel_embeddings=rel_embeddings,
                output_attentions=output_attentions,
            )
        mask = attention_mask.mask if isinstance(attention_mask, PaddingMask) else attention_mask
        return self._fused(hidden_states, mask, rel_embeddings), None

    def _deberta_call_reason(self, attention_mask, query_states, relative_pos, output_attentions) -> str | None:
        """Why this call, by its arguments, must run the original forward, or None."""
        if output_attentions:
            return "attentions were asked for"
        if query_states is not None:
            return "query_states were passed (the enhanced mask decoder)"
        if not (attention_mask is None or isinstance(attention_mask, (PaddingMask, PackedSequences))):
            return "its attention_mask is not the encoder's padding mask"
        if self.attention.self.relative_attention and not isinstance(relative_pos, RelativePositions):
            return "its relative positions are not the encoder's"
        return None

    def _self_attention(self, x, attn_mask, padding, rel_embeddings=None):
        """(batch, seq, hidden) context, before the output projection."""
        attn = self.attention.self
        terms = sum(term in attn.pos_att_type for term in _POSITION_TERMS)
        kwargs = dict(
            position_buckets=attn.position_buckets if attn.relative_attention else -1,
            max_relative_positions=attn.max_relative_positions if attn.relative_attention else -1,
            dropout_p=attn.dropout.p if attn.training else 0.0,
            scale=1.0 / (attn.attention_head_size * (1 + terms)) ** 0.5,
        )
        positions = self._positions(attn, rel_embeddings)
        if isinstance(attn_mask, PackedSequences):  # x is (1, total, hidden): every real token, packed
            q, k, v = (rearrange(t, "1 t (h d) -> t h d", d=attn.attention_head_size) for t in self._qkv(x))
            cu, longest = attn_mask.cu_seqlens, attn_mask.max_seqlen
            out = varlen_disentangled_attention(q, k, v, cu, longest, *positions, **kwargs)
            return rearrange(out, "t h d -> 1 t (h d)")
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=attn.attention_head_size) for t in self._qkv(x))
        out = disentangled_attention(
            q, k, v, *positions, key_padding_mask=padding, query_padding_mask=padding, **kwargs
        )
        return rearrange(out, "b h s d -> b s (h d)")

    def _positions(self, attn, rel_embeddings):
        """(pos_key, pos_query), each (heads, 2 · span, head_dim) or None, as HF's
        ``disentangled_attention_bias`` projects the relative-position embeddings."""
        if not attn.relative_attention:
            return None, None
        rel = attn.pos_dropout(rel_embeddings)[: 2 * attn.pos_ebd_size]
        if attn.share_att_key:
            projections = {"c2p": attn.key_proj, "p2c": attn.query_proj}
        else:
            projections = {"c2p": getattr(attn, "pos_key_proj", None), "p2c": getattr(attn, "pos_query_proj", None)}
        return tuple(
            rearrange(projections[term](rel), "p (h d) -> h p d", h=attn.num_attention_heads)
            if term in attn.pos_att_type
            else None
            for term in _POSITION_TERMS
        )


def _class_name(module: nn.Module) -> tuple[str, str]:
    kind = getattr(type(module), "_original_class", type(module))
    return kind.__module__, kind.__name__


def _deberta_layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` (a DebertaV2Layer) cannot be fused, or None."""
    attn = layer.attention.self
    # HF adds a position term for "c2p" and "p2c" only, and only with relative attention ("none":
    # neither); without it the layer is plain attention, whose scale still counts the terms named.
    unknown = [term for term in attn.pos_att_type if term not in (*_POSITION_TERMS, "none")]
    if attn.relative_attention and unknown:
        return f"pos_att_type {unknown} has no fused kernel (supported: c2p, p2c)"
    if attn.relative_attention and not attn.share_att_key:
        for term, name in zip(_POSITION_TERMS, ("pos_key_proj", "pos_query_proj")):
            if term in attn.pos_att_type and type(getattr(attn, name, None)) is not nn.Linear:
                return f"attention.self.{name} is not a torch.nn.Linear"
    if attn.attention_head_size * attn.num_attention_heads != attn.all_head_size:
        return "its heads do not tile all_head_size"
    return layer_problem(layer, _LAYOUT)


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    if (type(module).__module__, type(module).__name__) == _LAYER:
        problem = _deberta_layer_problem(module)
        return (None, problem) if problem else (fuse_layer(module, FusedDebertaV2LayerMixin), None)
    attention = getattr(module, "attention", None)
    if hasattr(getattr(attention, "self", None), "pos_att_type") and hasattr(module, "intermediate"):
        return None, f"{type(module).__name__} is not a DeBERTa-v2 layer verified to compute DebertaV2Layer's forward"
    return None


def _encoder_class(module: nn.Module) -> tuple[type | None, str | None] | None:
    if _class_name(module) != _ENCODER:
        return None
    if all(isinstance(layer, FusedDebertaV2LayerMixin) for layer in module.layer):
        return DisentangledDebertaV2Encoder.over(type(module)), None
    return None, "its layers are not all fused: the mask and relative positions stay HF's (seq, seq) tensors"


class DebertaV2Unpadding(UnpaddedEncoderModel):
    """``UnpaddedEncoderModel`` over ``DebertaV2Model``: the packed call runs the embeddings on
    the real tokens (their mask multiply is by 1 there) and the encoder given the packing, whose
    layers run ``varlen_disentangled_attention``, each sequence at its own relative positions.
    A batch with padding between two tokens of a row runs padded (the padded model's relative
    positions count that padding), as does a model with v2-xlarge's conv layer, which reads the
    padded layout."""

    def padded_reason(self, arguments: dict, extra: dict) -> str | None:
        reason = super().padded_reason(arguments, extra)
        if reason is None and self.encoder.conv is not None:
            reason = "its encoder's conv layer reads the padded layout"
        if reason is None and has_padding_between_tokens(arguments["attention_mask"]):
            reason = "padding between tokens (DeBERTa's relative positions count it)"
        return reason

    def packed_forward(self, arguments: dict, extra: dict, packing: PackedSequences):
        from transformers.modeling_outputs import BaseModelOutput

        embeddings = self.embeddings(
            input_ids=arguments.get("input_ids"),
            token_type_ids=arguments.get("token_type_ids"),
            position_ids=arguments.get("position_ids"),
            inputs_embeds=arguments.get("inputs_embeds"),
        )
        encoded = self.encoder(embeddings, packing)
        wanted = extra.get("output_hidden_states", arguments.get("output_hidden_states"))
        wanted = self.config.output_hidden_states if wanted is None else wanted
        return BaseModelOutput(
            last_hidden_state=encoded.last_hidden_state, hidden_states=encoded.hidden_states if wanted else None
        )


def _unpadded(model: nn.Module) -> tuple[type | None, str | None] | None:
    if _class_name(model) != (_MODULE, "DebertaV2Model"):
        return None
    if not all(isinstance(layer, FusedDebertaV2LayerMixin) for layer in model.encoder.layer):
        return None, "unpad: its layers are not all fused"
    return DebertaV2Unpadding.over(type(model)), None


FAMILY = ModelFamily(
    "DeBERTa-v2",
    _replacement,
    fuse_loss=lambda model: fused_loss(model, frozenset({"deberta"})),
    unpad=_unpadded,
    change_class=_encoder_class,
    class_change="padding mask and relative positions handed to the fused disentangled attention",
)
