"""ModernBERT encoders of HuggingFace transformers (>= 5): fused layers and embeddings.

``ModernBertEncoderLayer`` (pre-LN) becomes ``FusedModernBertEncoderLayer``, a subclass of its
class sharing its submodules (``state_dict``, hooks and ``unpatch`` as for the other
families), whose forward runs

    h = attn_norm(x);  q, k, v = Wqkv(h);  q, k = RoPE(q, k)          (cos, sin: the model's)
    x = x + out_drop(Wo(attention(q, k, v; padding, window)))          slimformer.attention
    x = x + mlp(mlp_norm(x))                                            the fused GeGLU MLP

RoPE is applied to q and k in torch before the kernel: its backward keeps only cos and sin,
so no copy of q or k is kept beside the kernel's. The local layers pass the kernel HF's
sliding window (|i − j| <= ``config.sliding_window``), whose tiles outside it the kernels
never visit; the padding reaches the kernel as a key padding mask, read off the diagonal
of the mask transformers builds (every token may attend to itself, windowed or not). A
padded query farther than the window from every token has no allowed key: it gets 0, as
SDPA gives (HF eager: the mean of its values); no real position reads it.

``ModernBertMLP`` computes ``Wo(drop(act(input) * gate))`` with ``input, gate =
Wi(x).chunk(2)``: the fused MLP's ``geglu`` (``slimformer.kernels.activation``), which keeps
only Wi's output for backward, or nothing at the ``mlp`` recompute policies, where HF keeps
Wi's output, the activation, the product and the dropout mask. The layer's ``recompute`` is
its MLP's too: ``qkv`` checkpoints the attention block, ``mlp`` recomputes Wi, ``full``
checkpoints the whole layer. A layer calls its original forward, for that call, when
attentions are asked for, its mask is not a tensor or its attention's Linears, dropout or
norms have hooks; the MLP likewise for its own submodules.

The embeddings' ``norm`` and ``drop``, which their forward calls as ``self.drop(self.norm(x))``
and nowhere else (source checked), become one fused norm kernel as BERT's do.
``ModernBertForMaskedLM``'s loss is fused with its decoder (``slimformer.integrations.hf.masked_lm``:
its ``head`` on the labelled rows only, as its sparse prediction does).

With ``unpad=True``, ``ModernBertModel`` becomes ``UnpaddedModernBertModel``: the real tokens
only, at their padded positions for RoPE, through ``sf.varlen_attention`` (each sequence's
window its own) on any device, no flash-attn package needed; a batch with padding between
two tokens of a row runs padded (the window counts that padding).

Left, with the reason in the summary: a layer whose MLP's activation is not the exact gelu
(its attention and MLP then stay HF's), head dims above 256.
"""

import re
import sys

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.bert import fuse_embeddings, fused_loss, padding_of_mask, refuse_packed
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.integrations.hf.unpad import PackedSequences, UnpaddedEncoderModel, has_padding_between_tokens
from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import MAX_HEAD_DIM, attention, varlen_attention
from slimformer.layers.norm import LayerNorm
from slimformer.layers.policies import check_policy
from slimformer.layers.sharing import NotScriptable, TorchDropout, TorchLayerNorm, has_user_hooks

__all__ = ["FAMILY", "FusedModernBertMLPMixin"]

_MODULE = "transformers.models.modernbert.modeling_modernbert"
_MLP = (_MODULE, "ModernBertMLP")
_LAYER = (_MODULE, "ModernBertEncoderLayer")
_EMBEDDINGS = (_MODULE, "ModernBertEmbeddings")
_DROP_OF_NORM = re.compile(r"self\.drop\(self\.norm\(")
_BASE_MODEL = (_MODULE, "ModernBertModel")
# transformers' exact GELU (``ACT2CLS["gelu"]``): the fused kernel's geglu
_GELU = "GELUActivation"


class FusedModernBertMLPMixin(RuntimeMixin, NotScriptable):
    """Forward of a patched ``ModernBertMLP`` (see the module docstring), mixed before its
    class; ``patch`` makes ``FusedModernBertMLP(FusedModernBertMLPMixin, ModernBertMLP)``."""

    def forward(self, hidden_states):
        if self._unfused_reason() is not None:
            return super().forward(hidden_states)
        policy = check_policy(self.recompute)
        dropout_p = self.drop.p if self.drop.training else 0.0
        return fused_mlp(
            hidden_states,
            self.Wi.weight,
            self.Wi.bias,
            self.Wo.weight,
            self.Wo.bias,
            "geglu",
            dropout_p,
            recompute_fc1="mlp" in policy or policy == "full",
        )

    def _unfused_reason(self) -> str | None:
        """Why this call runs the original forward (hooks, replaced submodules), or None."""
        for name, types in (("Wi", (nn.Linear,)), ("Wo", (nn.Linear,)), ("drop", (TorchDropout,)), ("act", None)):
            module = getattr(self, name)
            if types is not None and type(module) not in types:
                return f"{name} is a {type(module).__name__}"
            if has_user_hooks(module):
                return f"{name} has hooks"
        return None

    def extra_repr(self) -> str:
        return f"activation='geglu', recompute={self.recompute!r}"


class FusedModernBertLayerMixin(RuntimeMixin, NotScriptable):
    """Forward of a patched ``ModernBertEncoderLayer``, mixed before its class: pre-LN, Wqkv,
    RoPE applied to q and k in torch (its backward keeps cos and sin, no copy of q or k), the
    fused attention with the layer's sliding window for its local layers (tiles outside it
    skipped) and the padding as a key padding mask, Wo, and the (fused) MLP. ``recompute``:
    ``qkv`` checkpoints the attention block, ``full`` the whole layer; the MLP keeps its own."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        reason = self._call_reason(attention_mask, kwargs) or self._unfused_reason()
        if reason is not None:
            refuse_packed(attention_mask, reason)
            return super().forward(hidden_states, attention_mask, position_embeddings, **kwargs)
        policy = check_policy(self.recompute)
        padding = attention_mask if isinstance(attention_mask, PackedSequences) else padding_of_mask(attention_mask)
        if policy == "full" and torch.is_grad_enabled():
            return checkpoint(self._layer, hidden_states, padding, position_embeddings, "none", use_reentrant=False)
        return self._layer(hidden_states, padding, position_embeddings, policy)

    def _layer(self, hidden_states, padding, position_embeddings, policy):
        h = self.attn_norm(hidden_states)
        if "qkv" in policy and torch.is_grad_enabled():
            context = checkpoint(self._attention, h, padding, *position_embeddings, use_reentrant=False)
        else:
            context = self._attention(h, padding, *position_embeddings)
        hidden_states = hidden_states + self.attn.out_drop(self.attn.Wo(context))
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))

    def _attention(self, h, padding, cos, sin):
        """(batch, seq, hidden) context of the fused attention, before Wo; ``padding`` a
        (batch, seq) key padding mask, None, or a ``PackedSequences`` (h is then the packed
        (1, total, hidden) row, cos and sin its tokens', and the window each sequence's)."""
        attn = self.attn
        qkv = rearrange(attn.Wqkv(h), "b s (three n d) -> three b n s d", three=3, d=attn.head_dim)
        q, k = sys.modules[_MODULE].apply_rotary_pos_emb(qkv[0], qkv[1], cos, sin, unsqueeze_dim=1)
        window = None if attn.sliding_window is None else attn.config.sliding_window
        dropout_p = attn.attention_dropout if attn.training else 0.0
        scale = attn.head_dim**-0.5
        # v copied out of the projection: kept as a view, it would keep all of Wqkv's output
        # (q and k are RoPE's new tensors)
        v = qkv[2].contiguous()
        if isinstance(padding, PackedSequences):
            q, k, v = (rearrange(t, "1 n t d -> t n d") for t in (q, k, v))
            cu, longest = padding.cu_seqlens, padding.max_seqlen
            out = varlen_attention(q, k, v, cu, cu, longest, longest, dropout_p, scale=scale, window=window)
            return rearrange(out, "t n d -> 1 t (n d)")
        out = attention(q, k, v, dropout_p=dropout_p, scale=scale, key_padding_mask=padding, window=window)
        return rearrange(out, "b n s d -> b s (n d)")

    def _call_reason(self, attention_mask, kwargs) -> str | None:
        """Why this call, by its arguments, runs the original forward, or None."""
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            return "attentions were asked for"
        if not (attention_mask is None or isinstance(attention_mask, (torch.Tensor, PackedSequences))):
            return f"its attention_mask is a {type(attention_mask).__name__}"
        return None

    def _unfused_reason(self) -> str | None:
        """Why a call must run the original forward, by its submodules (hooks), or None."""
        for name in ("attn", "attn.Wqkv", "attn.Wo", "attn.out_drop", "attn_norm", "mlp_norm"):
            if has_user_hooks(self.get_submodule(name)):
                return f"{name} has hooks"
        return None

    @property
    def recompute(self) -> str:
        return self.__dict__["_recompute"]

    @recompute.setter
    def recompute(self, policy: str) -> None:
        # the layer's policy is its fused MLP's too (which recomputes Wi at the mlp policies)
        self.__dict__["_recompute"] = policy
        if isinstance(self.mlp, FusedModernBertMLPMixin):
            self.mlp.recompute = policy

    def extra_repr(self) -> str:
        return f"recompute={self.recompute!r}"


def _layer_problem(layer: nn.Module) -> str | None:
    mlp_problem = _mlp_problem(layer.mlp)
    if mlp_problem is not None:
        return f"its MLP: {mlp_problem}"
    attn = layer.attn
    if type(attn.Wqkv) is not nn.Linear or type(attn.Wo) is not nn.Linear:
        return "its Wqkv or Wo is not a torch.nn.Linear"
    if attn.head_dim > MAX_HEAD_DIM:
        return f"head_dim {attn.head_dim} is above the fused kernel's {MAX_HEAD_DIM}"
    return None


def _fused_layer(layer: nn.Module) -> nn.Module:
    """A ``FusedModernBertEncoderLayer`` sharing ``layer``'s submodules, its MLP fused and its
    LayerNorms slimformer's (in the fused layer's own module dict: ``unpatch`` puts the
    original layer, its children untouched, back)."""
    fused = FusedModernBertLayerMixin.sharing(layer)
    fused._modules["mlp"] = _fused_mlp(layer.mlp)
    for name in ("attn_norm", "mlp_norm"):
        if type(layer.get_submodule(name)) is TorchLayerNorm:
            fused._modules[name] = LayerNorm.from_torch(layer.get_submodule(name))
    fused.recompute = "none"
    return fused


def _mlp_problem(mlp: nn.Module) -> str | None:
    if type(mlp.act).__name__ != _GELU:
        return f"its activation is a {type(mlp.act).__name__}; the fused kernel's geglu is the exact gelu"
    for name in ("Wi", "Wo"):
        if type(getattr(mlp, name)) is not nn.Linear:
            return f"{name} is a {type(getattr(mlp, name)).__name__}, not torch.nn.Linear"
    if type(mlp.drop) is not TorchDropout:
        return f"drop is a {type(mlp.drop).__name__}, not torch.nn.Dropout"
    return None


def _fused_mlp(mlp: nn.Module) -> nn.Module:
    fused = FusedModernBertMLPMixin.sharing(mlp)
    fused.recompute = "none"
    return fused


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    kind = (type(module).__module__, type(module).__name__)
    if kind == _LAYER:
        problem = _layer_problem(module)
        return (None, problem) if problem else (_fused_layer(module), None)
    if kind == _MLP:  # in a layer that is left
        problem = _mlp_problem(module)
        return (None, problem) if problem else (_fused_mlp(module), None)
    return None


def _fused_embeddings(embeddings: nn.Module) -> tuple[dict[str, nn.Module], str | None] | None:
    return fuse_embeddings(embeddings, frozenset({_EMBEDDINGS}), ("norm", "drop"), _DROP_OF_NORM)


class ModernBertUnpadding(UnpaddedEncoderModel):
    """``UnpaddedEncoderModel`` over ``ModernBertModel``, which takes a ready mask per layer
    kind: the packed call hands both kinds the packing, and RoPE the real tokens' positions."""

    def encoder_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def padded_reason(self, arguments: dict, extra: dict) -> str | None:
        reason = super().padded_reason(arguments, extra)
        if reason is None and has_padding_between_tokens(arguments["attention_mask"]):
            reason = "padding between tokens (the local layers' window counts it)"
        return reason

    def packed_forward(self, arguments: dict, extra: dict, packing: PackedSequences):
        arguments["attention_mask"] = {"full_attention": packing, "sliding_attention": packing}
        return super(UnpaddedEncoderModel, self).forward(**arguments, **extra)

    def _padded_position_ids(self, arguments: dict, packing: PackedSequences) -> torch.Tensor:
        positions = torch.arange(packing.seq, device=packing.indices.device)
        return positions.expand(packing.batch, packing.seq)


def _unpadded(model: nn.Module) -> tuple[type | None, str | None] | None:
    kind = getattr(type(model), "_original_class", type(model))
    if (kind.__module__, kind.__name__) != _BASE_MODEL:
        return None
    if all(isinstance(layer, FusedModernBertLayerMixin) for layer in model.layers):
        return ModernBertUnpadding.over(type(model)), None
    return None, "unpad: its layers are not all fused"


FAMILY = ModelFamily(
    "ModernBERT",
    _replacement,
    replace_children=_fused_embeddings,
    fuse_loss=lambda model: fused_loss(model, frozenset({"modernbert"})),
    unpad=_unpadded,
)
