"""BERT-family encoders of HuggingFace transformers (>= 5): fused encoder layers and embeddings.

Encoder layers of BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, ERNIE, Data2VecText and
RoCBert (so also the sentence-transformers models built on them), whose classes are
BERT's line for line, become ``Fused<Layer>``, a subclass of the layer's own class
(``isinstance`` holds, so transformers' ``output_hidden_states`` capture and gradient
checkpointing still find it) that holds the same submodules and runs, with p the hidden
dropout:

    c = attention(x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv; mask)   fused kernel, keeps q, k, v, c, lse
    y = LayerNorm(dropout_p(c Woᵀ + bo) + x)                   one kernel, keeps y and rstd
    z = LayerNorm(dropout_p(fused_mlp(y)) + y)                 keeps fc1's output (GELU input)

Every dropout mask is regenerated from a Philox seed rather than stored, so dropout
draws differ from torch's, with the same distribution.

Their embeddings' ``LayerNorm`` and ``dropout``, which the forward calls one after the
other, become a ``LayerNormDropout`` and a ``DropoutInNorm`` (``slimformer.layers.norm``):
the same fused norm kernel applies the dropout to its output with the mask regenerated
from a seed, and the dropout's place passes its input through. Checked against the
embeddings' source: each ``x = self.LayerNorm(x)`` directly followed by
``x = self.dropout(x)``, and no other call of either.

The fused layers take the ``recompute`` policies of ``slimformer.layers.policies``. HF BERT
keeps q, k and v as three Linears, while ``self_attention``'s QKV recompute wants one
stacked weight, which would be a 3·E² copy per step kept for backward; so ``qkv``
checkpoints the projections together with the attention (non-reentrant, RNG restored),
which also repeats the attention forward in backward (about 3% of a BERT-base layer's
FLOPs at seq 512) and keeps neither q, k, v nor the log-sum-exp.

The fused layer calls the q, k, v and attention-output Linears as modules (their hooks
fire; an adapter wrapped around one, such as a PEFT LoRA layer, is used). Its Linears
may be ``sf.quantize``'s inference layers, in either order (``patch`` of a quantized
model, ``sf.quantize`` of a patched one, with or without ``unpad``). The MLP Linears are
read by the fused MLP kernel while they are float nn.Linears without hooks; quantized or
hooked, they are called as modules (fc1, the activation, fc2). A call runs the layer's
original, unfused forward instead, for that call only, when it asks for the attention
weights, by the ``output_attentions`` argument or by ``config.output_attentions`` (read
at each call, as transformers' output capture reads it; the weights are formed only
there), when it passes a cache (``cache`` or ``past_key_values``, which the original
attention writes) or a mask that is not a tensor (flex attention's ``BlockMask``), when
a submodule the fused forward does not call (``attention``, ``attention.self``,
``attention.output``, ``intermediate``, ``output``, the dropouts, LayerNorms and the
activation) has a forward or backward hook (transformers' inactive output-capturing
hooks excepted) or was replaced by a module of another type (the MLP Linears by anything
but nn.Linear or sf.quantize's). The original gets the call's arguments as they came.

Left, with the reason in the summary: decoder layers (causal, cache, cross-attention),
activations other than gelu / gelu_new / gelu_pytorch_tanh / relu, head dims above 256,
submodules of other types, and every class that only looks like a BERT layer (a subclass
may compute something else). ``chunk_size_feed_forward`` is not needed (the fused MLP
keeps less than a chunked one) and is ignored.

The fused layers run the fused kernel under every attention implementation ("eager",
"sdpa", "slimformer", flash attention), since the result is the same: they read the mask
transformers builds for the implementation as it is (eager's and sdpa's (batch, 1, seq,
seq) masks, shared by all layers, or a (batch, seq) padding mask). A call that asks for
the attention weights runs the original layer, so the implementation answers as it
would unpatched.

``FAMILY`` is this module's entry in ``slimformer.patch``'s registry; it also fuses the
masked-LM loss (``slimformer.integrations.hf.masked_lm``) and unpads base models
(``slimformer.integrations.hf.unpad``) of the same family.
"""

import inspect
import operator
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.integrations.hf.masked_lm import BERT_HEADS, FusedMaskedLM, is_masked_lm, masked_lm_problem
from slimformer.integrations.hf.unpad import (
    PACKING_ARGUMENT,
    PackedSequences,
    UnpaddedEncoderModel,
    is_unpaddable_base_model,
)
from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import MAX_HEAD_DIM, attention, varlen_attention
from slimformer.kernels.attention.tiles import MASKED_BIAS
from slimformer.kernels.norm import fused_norm
from slimformer.kernels.projection import projections
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.layers.memory_modes import MEMORY_MODES
from slimformer.layers.norm import LayerNorm, fuse_with_dropout
from slimformer.layers.policies import check_policy
from slimformer.layers.sharing import NotScriptable, TorchDropout, TorchLayerNorm, has_user_hooks

__all__ = ["FAMILY", "FusedBertFamilyLayer", "LayerLayout", "layout_family"]

# Encoder layers whose classes (layer, attention, self-attention, output, intermediate)
# are BERT's line for line in transformers 5, named by module and class so that
# transformers is never imported here.
_BERT_LAYERS = frozenset(
    {
        ("transformers.models.bert.modeling_bert", "BertLayer"),
        ("transformers.models.roberta.modeling_roberta", "RobertaLayer"),
        ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaLayer"),
        ("transformers.models.camembert.modeling_camembert", "CamembertLayer"),
        ("transformers.models.electra.modeling_electra", "ElectraLayer"),
        ("transformers.models.ernie.modeling_ernie", "ErnieLayer"),
        ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextLayer"),
        ("transformers.models.roc_bert.modeling_roc_bert", "RoCBertLayer"),
    }
)
# Their embeddings, whose forward ends with LayerNorm then dropout (checked against the source).
_BERT_EMBEDDINGS = frozenset(
    {
        ("transformers.models.bert.modeling_bert", "BertEmbeddings"),
        ("transformers.models.roberta.modeling_roberta", "RobertaEmbeddings"),
        ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaEmbeddings"),
        ("transformers.models.camembert.modeling_camembert", "CamembertEmbeddings"),
        ("transformers.models.electra.modeling_electra", "ElectraEmbeddings"),
        ("transformers.models.ernie.modeling_ernie", "ErnieEmbeddings"),
        ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextEmbeddings"),
        ("transformers.models.roc_bert.modeling_roc_bert", "RoCBertEmbeddings"),
    }
)
# ``x = self.LayerNorm(x)`` then ``x = self.dropout(x)``, either line may end in a comment (DistilBERT's do).
_NORM_THEN_DROPOUT = re.compile(r"(\w+) = self\.LayerNorm\(\1\) *(?:#.*)?\n\s*\1 = self\.dropout\(\1\) *(?:#.*)?\n")
# config.hidden_act -> fused_mlp's activation.
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# transformers' activation classes (``ACT2CLS``) -> their names in _HF_ACTIVATIONS, for
# layers that keep no config; gelu_python is GELUActivation too (the same erf GELU).
_ACTIVATION_CLASSES = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_new",
    "GELUTanh": "gelu_pytorch_tanh",
    "ReLU": "relu",
}
# The Linears of a fused BERT layer may be ``sf.quantize``'s inference layers (for either
# order of patch and quantize).
_LINEARS = (nn.Linear, Linear8bit, Linear16bit)


@dataclass(frozen=True)
class LayerLayout:
    """Where a post-LN encoder layer keeps its parts, as submodule paths, for the fused forward:

        c = attention(q(x), k(x), v(x))                     ``attention``: its q, k, v Linears,
                                                            ``attention_head_size``, ``scaling``
                                                            and ``config``; ``attention_dropout``
        y = out_norm(out_dropout(out_proj(c)) + x)          ``out_dropout`` None: no dropout there
        z = mlp_norm(mlp_dropout(fc2(activation(fc1(y)))) + y)   likewise ``mlp_dropout``

    ``containers``: the modules whose own forward the fused one replaces. ``activation_config``:
    the config attribute naming the activation, or None where the layer holds no config
    (MPNet): the activation module's class names it then.
    """

    attention: str
    attention_dropout: str
    qkv: tuple[str, str, str]
    out_proj: str
    out_dropout: str | None
    out_norm: str
    fc1: str
    activation: str
    fc2: str
    mlp_dropout: str | None
    mlp_norm: str
    containers: tuple[str, ...]
    activation_config: str | None

    def bypassed(self) -> dict[str, tuple[type, ...] | None]:
        """Submodules that the fused forward runs without calling, and the types it computes
        for (None: a container, or the activation); the Linears, which it calls (q, k, v,
        out_proj) or may call (the MLP's), are not listed."""
        dropouts = (self.attention_dropout, self.out_dropout, self.mlp_dropout)
        return {
            **dict.fromkeys(self.containers),
            **{path: (TorchDropout,) for path in dropouts if path is not None},
            self.out_norm: (TorchLayerNorm, LayerNorm),
            self.mlp_norm: (TorchLayerNorm, LayerNorm),
            self.activation: None,
        }

    def expected(self) -> dict[str, tuple[type, ...]]:
        """Submodule types a layer must have to be fused (the Linears may be ``sf.quantize``'s)."""
        linears = (*self.qkv, self.out_proj, self.fc1, self.fc2)
        typed = {path: types for path, types in self.bypassed().items() if types is not None}
        return {**dict.fromkeys(linears, _LINEARS), **typed}


_BERT_LAYOUT = LayerLayout(
    attention="attention.self",
    attention_dropout="attention.self.dropout",
    qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
    out_proj="attention.output.dense",
    out_dropout="attention.output.dropout",
    out_norm="attention.output.LayerNorm",
    fc1="intermediate.dense",
    activation="intermediate.intermediate_act_fn",
    fc2="output.dense",
    mlp_dropout="output.dropout",
    mlp_norm="output.LayerNorm",
    containers=("attention", "attention.self", "attention.output", "intermediate", "output"),
    activation_config="hidden_act",
)
# The names under which a layer's call may get a cache (``cache`` from transformers 5.24 on).
_CACHE_ARGUMENTS = ("cache", "past_key_values")


def _kernel_masks(attention_mask, batch: int, seq: int):
    """The mask transformers 5 hands a BERT encoder layer, as ``attention``'s
    ``(attn_mask, key_padding_mask)``.

    That mask is None (no padding, outside torch.compile), a (batch, 1, seq, seq) bool
    mask with True = attend (sdpa) or additive float mask (eager), both passed on and read
    block by block, or (batch, seq) with 0 = padding (flash attention, or slimformer's
    registered implementation), which becomes a key padding mask. Other masks (flex
    attention's BlockMask) never reach it: the layer runs its original forward.
    """
    if attention_mask is None:
        return None, None
    if attention_mask.shape == (batch, seq):
        return None, attention_mask == 0
    if attention_mask.dim() == 4:
        return attention_mask, None
    raise ValueError(
        f"attention_mask must be (batch, seq) = {(batch, seq)} or 4-d (batch, 1, seq, seq), "
        f"got shape {tuple(attention_mask.shape)}"
    )


_MISSING = object()


def _held(holder, name: str):
    """What ``getattr(holder, name)`` finds, read from the dicts that an nn.Module keeps it
    in (its ``__dict__``, then its submodules) where it is there: a dict lookup, not a walk
    through ``nn.Module.__getattr__``."""
    found = holder.__dict__.get(name, _MISSING)
    if found is _MISSING:
        found = holder.__dict__.get("_modules", {}).get(name, _MISSING)
    return getattr(holder, name, _MISSING) if found is _MISSING else found


class _LayoutParts:
    """A fused layer's parts at its layout's paths, and why they cannot be fused (None when
    they can), as they were when judged, with every link on the way (the object holding a
    part, its name there, the part and its type) to re-check: a part swapped, deleted or
    given another class anywhere on a path makes it stale. Re-checking is a dict lookup per
    link; resolving a path walks ``nn.Module.__getattr__`` for each name, and judging the
    parts took tens of µs per call."""

    def __init__(self, layer):
        layout = layer.layout
        paths = (*layout.bypassed(), *layout.qkv, layout.out_proj, layout.fc1, layout.fc2)
        self.by_path, self.path_links, links = {}, {}, {}
        for path in paths:
            holder, prefix, path_links = layer, "", []
            for name in path.split("."):
                prefix = f"{prefix}.{name}" if prefix else name
                part = getattr(holder, name)
                links[prefix] = (holder, name, part, type(part))
                path_links.append(links[prefix])
                holder = part
            self.by_path[path], self.path_links[path] = holder, tuple(path_links)
        self.links = tuple(links.values())
        self.unfused, self.bypassed_modules = None, []
        for path, types in layout.bypassed().items():
            part = self.by_path[path]
            if not isinstance(part, nn.Module):  # an activation that is a plain function
                continue
            if types is not None and type(part) not in types:
                self.unfused = f"{path} is a {type(part).__name__}"
                return
            self.bypassed_modules.append((path, part))
        # The MLP's Linears: read by the fused MLP kernel when they are plain nn.Linears without
        # hooks, else called as modules (sf.quantize's layers; hooks such as SmoothQuant
        # calibration's, which so see the real tokens only in an unpadded model).
        for path in (layout.fc1, layout.fc2):
            if type(self.by_path[path]) not in _LINEARS:
                self.unfused = f"{path} is a {type(self.by_path[path]).__name__}"
                return

    @staticmethod
    def current(links) -> bool:
        return all(_held(holder, name) is part and type(part) is kind for holder, name, part, kind in links)


# fused layer -> its parts as last judged (weak: a layer's entry goes with it)
_LAYOUT_PARTS: "weakref.WeakKeyDictionary[nn.Module, _LayoutParts]" = weakref.WeakKeyDictionary()


class FusedBertFamilyLayer(RuntimeMixin, NotScriptable):
    """Forward of a patched BERT-family encoder layer, mixed before the layer's own class.

    ``patch`` makes ``Fused<Layer>(FusedBertFamilyLayer, <Layer>)`` and an instance that shares
    the original's submodules and hooks. Attributes it adds: ``recompute`` (a policy of
    ``slimformer.layers.policies``), ``fused_activation`` and ``saves_output`` (whether each
    of the two LayerNorms may keep its output instead of its input, re-decided whenever
    their weights change, see ``slimformer.layers.memory_modes.MemoryModes``).

    ``forward(hidden_states, attention_mask=None, ...)`` takes what the original does (and
    ``inspect.signature`` of it is the original's) and returns the layer output (batch,
    seq, hidden) in hidden_states' dtype.
    """

    # sf.quantize may swap its inference Linears in: the forward calls them as modules.
    accepts_quantized_linears = True
    # Where the layer keeps its parts; a subclass for another family's layer sets its own.
    layout = _BERT_LAYOUT

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        packing = kwargs.pop(PACKING_ARGUMENT, None)  # an unpadded model that builds its mask inline
        if packing is not None:
            attention_mask = packing
        reason = self._call_reason(attention_mask, args, kwargs) or self._unfused_reason()
        if reason is not None:
            refuse_packed(attention_mask, reason)
            # The caller's arguments as they came: the original names the cache ``cache``
            # in transformers 5.24 and maps a ``past_key_values`` onto it.
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        return self._fused(hidden_states, attention_mask)

    def _fused(self, hidden_states, attention_mask, relative_bias=None):
        """The fused layer: (batch, seq, hidden) out; ``relative_bias`` (heads, offsets) as
        ``slimformer.attention`` takes it (MPNet's position bias), or None."""
        packed = isinstance(attention_mask, PackedSequences)
        policy = check_policy(self.recompute)
        if packed:
            attn_mask, padding = attention_mask, None
        else:
            attn_mask, padding = _kernel_masks(attention_mask, *hidden_states.shape[:2])
        if policy == "full" and torch.is_grad_enabled():
            # The last norm runs outside the checkpoint: it keeps its output (the next
            # layer's input, which a checkpoint would keep anyway) and rstd, and under
            # torch.compile a region ending in a multi-output op would lose its saved
            # boundary (the partitioner then recomputes every layer from the first).
            h, y = checkpoint(
                self._attention_mlp, hidden_states, attn_mask, padding, "none", relative_bias, use_reentrant=False
            )
            return self._add_norm(h, y, self.layout.mlp_norm, self.layout.mlp_dropout)
        h, y = self._attention_mlp(hidden_states, attn_mask, padding, policy, relative_bias)
        return self._add_norm(h, y, self.layout.mlp_norm, self.layout.mlp_dropout)

    def _call_reason(self, attention_mask, args, kwargs) -> str | None:
        """Why this call, by its arguments, must run the original forward, or None.

        The original attention writes a cache (an encoder layer gets one only when a caller
        passes it) and forms the attention weights, which transformers collects when they
        are asked for, by argument or in the config (as its ``capture_outputs`` decides).
        A mask that is not a tensor (flex attention's BlockMask) is read by the original."""
        if any(value is not None for value in args) or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            return "a cache or encoder inputs were passed"
        config = getattr(self._part(self.layout.attention), "config", None)
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            return "attentions were asked for"
        if not (attention_mask is None or isinstance(attention_mask, (torch.Tensor, PackedSequences))):
            return f"its attention_mask is a {type(attention_mask).__name__}"
        return None

    def _unfused_reason(self) -> str | None:
        """Why this call must run the original forward (see the module docstring), or None:
        what the layer's parts are is judged once per set of parts (``_LayoutParts``),
        their hooks on every call."""
        parts = self._layout_parts()
        if parts.unfused is not None:
            return parts.unfused
        for path, module in parts.bypassed_modules:
            if has_user_hooks(module):
                return f"{path} has hooks"
        return None

    def _layout_parts(self) -> "_LayoutParts":
        parts = _LAYOUT_PARTS.get(self)
        if parts is None or not parts.current(parts.links):
            parts = _LAYOUT_PARTS[self] = _LayoutParts(self)
        return parts

    def _attention_mlp(self, x, attn_mask, padding, policy, relative_bias=None):
        """(the MLP's output before its dropout, its input y): the layer but its last norm."""
        if "qkv" in policy and torch.is_grad_enabled():
            context = checkpoint(self._self_attention, x, attn_mask, padding, relative_bias, use_reentrant=False)
        else:
            context = self._self_attention(x, attn_mask, padding, relative_bias)
        layout = self.layout
        y = self._add_norm(self._part(layout.out_proj)(context), x, layout.out_norm, layout.out_dropout)
        return self._mlp(y, policy), y

    def _mlp(self, y, policy):
        """fc2(act(fc1(y))): the fused MLP kernel for float Linears without hooks; else (``sf.quantize``'s
        inference Linears, which keep no float weight; hooks) the Linears are called as modules."""
        fc1, fc2 = self._part(self.layout.fc1), self._part(self.layout.fc2)
        if all(type(fc) is nn.Linear and not has_user_hooks(fc) for fc in (fc1, fc2)):
            return fused_mlp(
                y,
                fc1.weight,
                fc1.bias,
                fc2.weight,
                fc2.bias,
                self.fused_activation,
                0.0,
                recompute_fc1="mlp" in policy,
            )
        return fc2(self._part(self.layout.activation)(fc1(y)))

    def _self_attention(self, x, attn_mask, padding, relative_bias=None):
        """(batch, seq, hidden) context, before the output projection; ``attn_mask`` may be
        a ``PackedSequences`` (x is then (1, total, hidden): every real token, packed)."""
        attn = self._part(self.layout.attention)
        dropout_p = self._part(self.layout.attention_dropout).p if attn.training else 0.0
        scale = getattr(attn, "scaling", None)  # MPNet's attention has none: 1 / sqrt(head_dim)
        qkv = self._qkv(x)
        if isinstance(attn_mask, PackedSequences):
            q, k, v = (rearrange(t, "1 t (h d) -> t h d", d=attn.attention_head_size) for t in qkv)
            cu, longest = attn_mask.cu_seqlens, attn_mask.max_seqlen
            out = varlen_attention(
                q, k, v, cu, cu, longest, longest, dropout_p, scale=scale, relative_bias=relative_bias
            )
            return rearrange(out, "t h d -> 1 t (h d)")
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=attn.attention_head_size) for t in qkv)
        if relative_bias is not None and attn_mask is not None:
            # the kernels take a relative bias in the attn_mask's place: the padding goes as keys
            keys = padding_of_mask(attn_mask)
            attn_mask, padding = None, keys if padding is None else keys | padding
        out = attention(
            q, k, v, attn_mask, dropout_p, scale=scale, key_padding_mask=padding, relative_bias=relative_bias
        )
        return rearrange(out, "b h s d -> b s (h d)")

    def _qkv(self, x):
        """The query, key and value projections of x: one op with one input gradient for float
        Linears without hooks (see ``slimformer.kernels.projection``); else the Linears are called."""
        linears = [self._part(path) for path in self.layout.qkv]
        if all(type(fc) is nn.Linear and not has_user_hooks(fc) for fc in linears):
            return projections(x, [fc.weight for fc in linears], [fc.bias for fc in linears])
        return [fc(x) for fc in linears]

    def _part(self, path: str):
        """The submodule (or activation function) at ``path``, one of the layout's."""
        parts = _LAYOUT_PARTS.get(self)
        if parts is None or (path in parts.path_links and not parts.current(parts.path_links[path])):
            parts = self._layout_parts()
        return parts.by_path[path] if path in parts.by_path else operator.attrgetter(path)(self)

    def _add_norm(self, branch, residual, norm_path: str, dropout_path: str | None):
        """``norm(dropout(branch) + residual)`` (BertSelfOutput, BertOutput), one kernel."""
        norm = self._part(norm_path)
        dropout = None if dropout_path is None else self._part(dropout_path)
        dropout_p = dropout.p if dropout is not None and dropout.training else 0.0
        rebuilds_input = torch.is_grad_enabled() and MEMORY_MODES.rebuilds_input(norm)
        return fused_norm(
            branch,
            norm.normalized_shape,
            norm.weight,
            norm.bias,
            norm.eps,
            is_rms=False,
            residual=residual,
            dropout_p=dropout_p,
            memory_efficient=rebuilds_input,
        )

    @property
    def saves_output(self) -> tuple[bool, bool]:
        """Whether each LayerNorm may keep its output instead of its input, for the current weights."""
        norms = (self._part(self.layout.out_norm), self._part(self.layout.mlp_norm))
        return tuple(MEMORY_MODES.rebuilds_input(norm) for norm in norms)

    def refresh_memory_mode(self) -> tuple[bool, bool]:
        """Re-decide now (one host sync); needed only after writing the weights through ``.data``."""
        MEMORY_MODES.refresh(self._part(self.layout.out_norm), self._part(self.layout.mlp_norm))
        return self.saves_output

    def extra_repr(self) -> str:
        return f"activation={self.fused_activation!r}, recompute={self.recompute!r}, saves_output={self.saves_output}"


def refuse_packed(attention_mask, reason: str) -> None:
    """Raise when an unpadded (packed) batch reaches a layer that must run its original forward."""
    if isinstance(attention_mask, PackedSequences):
        raise RuntimeError(
            f"an unpadded (packed) batch reached a layer that must run its original forward ({reason}); "
            "call the base model, which runs such calls padded"
        )


def padding_of_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (batch, seq) key padding mask (True = padding) of a mask transformers built for
    self-attention from a padding mask: None, (batch, seq) with 0 = padding, or (batch, 1,
    seq, seq) bool (True = attend) or additive, of padding alone or of padding and a
    window (ModernBERT's local layers). Every token may attend to itself, so the diagonal
    says which keys are padding, whatever the window."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask == 0
    diagonal = torch.diagonal(attention_mask[:, 0], dim1=-2, dim2=-1)
    return ~diagonal if diagonal.dtype == torch.bool else diagonal <= MASKED_BIAS


def _is_bert_layer(module: nn.Module) -> bool:
    return (type(module).__module__, type(module).__name__) in _BERT_LAYERS


def _looks_like_bert_layer(module: nn.Module) -> bool:
    attention = getattr(module, "attention", None)
    return all(hasattr(obj, name) for obj, name in ((attention, "self"), (module, "intermediate"), (module, "output")))


def _hf_activation(layer: nn.Module, layout: LayerLayout) -> tuple[str, str]:
    """(what the activation is called, its transformers name or its class's) of ``layer``."""
    if layout.activation_config is not None:
        config = layer.get_submodule(layout.attention).config
        return layout.activation_config, getattr(config, layout.activation_config)
    module = operator.attrgetter(layout.activation)(layer)
    return "activation", _ACTIVATION_CLASSES.get(type(module).__name__, type(module).__name__)


def layer_problem(layer: nn.Module, layout: LayerLayout) -> str | None:
    """Why ``layer`` (an allow-listed encoder layer laid out as ``layout``) cannot be fused, or None."""
    attention = layer.get_submodule(layout.attention)
    what, act = _hf_activation(layer, layout)
    if act not in _HF_ACTIVATIONS:
        return f"{what} {act!r} has no fused kernel (supported: {', '.join(_HF_ACTIVATIONS)})"
    for path, types in layout.expected().items():
        module = layer.get_submodule(path)
        if type(module) not in types:
            return f"{path} is a {type(module).__name__}, not torch.nn.{types[0].__name__}"
    head_dim = attention.attention_head_size
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is above the fused kernel's {MAX_HEAD_DIM}"
    return None


def _bert_layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` (an allow-listed BERT-family layer) cannot be fused, or None."""
    if layer.is_decoder or getattr(layer, "add_cross_attention", False):
        return "decoder layer (causal self-attention, KV cache, cross-attention) is not fused"
    return layer_problem(layer, _BERT_LAYOUT)


def fuse_layer(layer: nn.Module, mixin: type[FusedBertFamilyLayer] = FusedBertFamilyLayer) -> nn.Module:
    """A ``Fused<Layer>`` (``mixin`` over the layer's class) sharing ``layer``'s submodules,
    attributes and hooks."""
    fused = mixin.sharing(layer)
    layout = mixin.layout
    fused.fused_activation = _HF_ACTIVATIONS[_hf_activation(fused, layout)[1]]
    fused.recompute = "none"
    for path in (layout.out_norm, layout.mlp_norm):
        MEMORY_MODES.track(fused.get_submodule(path))
    return fused


_EMBEDDINGS_SOURCE_PROBLEM: dict[type, str | None] = {}


def _embeddings_problem(embeddings: nn.Module, names: tuple[str, str], pattern: re.Pattern) -> str | None:
    """Why the norm and dropout (attribute ``names``) of ``embeddings`` (an allow-listed
    class) cannot be fused, or None: every call of either must be one of ``pattern``'s."""
    kind = type(embeddings)
    norm_name, dropout_name = names
    if kind not in _EMBEDDINGS_SOURCE_PROBLEM:
        try:
            source = inspect.getsource(kind.forward)
        except (OSError, TypeError):
            source = ""
        pairs = len(pattern.findall(source))
        calls = [len(re.findall(rf"self\.{name}\b", source)) for name in names]
        same = pairs > 0 and calls == [pairs, pairs]
        problem = (
            None if same else f"its forward does not apply {dropout_name} right after each {norm_name} (source checked)"
        )
        _EMBEDDINGS_SOURCE_PROBLEM[kind] = problem
    if _EMBEDDINGS_SOURCE_PROBLEM[kind] is not None:
        return _EMBEDDINGS_SOURCE_PROBLEM[kind]
    for name, expected in zip(names, (TorchLayerNorm, TorchDropout)):
        module = getattr(embeddings, name, None)
        if type(module) is not expected:
            return f"{name} is a {type(module).__name__}, not torch.nn.{expected.__name__}"
    return None


def fuse_embeddings(
    embeddings: nn.Module,
    classes: frozenset[tuple[str, str]] = _BERT_EMBEDDINGS,
    names: tuple[str, str] = ("LayerNorm", "dropout"),
    pattern: re.Pattern = _NORM_THEN_DROPOUT,
) -> tuple[dict[str, nn.Module], str | None] | None:
    """{norm: LayerNormDropout, dropout: DropoutInNorm} fusing the two in ``embeddings``
    (their attribute ``names``; ``pattern`` matches the forward's call of both), or ({},
    why not), or None when its class is none of ``classes`` ((module, class name) pairs;
    BERT-family embeddings by default)."""
    if (type(embeddings).__module__, type(embeddings).__name__) not in classes:
        return None
    problem = _embeddings_problem(embeddings, names, pattern)
    if problem is not None:
        return {}, problem
    norm, dropout = fuse_with_dropout(*(getattr(embeddings, name) for name in names))
    return dict(zip(names, (norm, dropout))), None


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    if _is_bert_layer(module):
        problem = _bert_layer_problem(module)
        return (None, problem) if problem else (fuse_layer(module), None)
    if _looks_like_bert_layer(module):
        return None, f"{type(module).__name__} is not a BERT-family layer verified to compute BertLayer's forward"
    return None


def fused_loss(model: nn.Module, heads: frozenset[str] = BERT_HEADS) -> tuple[type | None, str | None] | None:
    """``Fused<Model>`` for a ``*ForMaskedLM`` model with one of the head layouts ``heads``
    (``slimformer.integrations.hf.masked_lm``), or (None, why not), or None for any other model."""
    if not is_masked_lm(model, heads):
        return None
    problem = masked_lm_problem(model)
    return (None, problem) if problem else (FusedMaskedLM.over(type(model)), None)


def layout_family(
    name: str,
    layer: tuple[str, str],
    mixin: type[FusedBertFamilyLayer],
    looks_like: Callable[[nn.Module], str | None],
    embeddings: frozenset[tuple[str, str]],
    heads: frozenset[str],
    base_model: tuple[str, str],
    unpadding: type[UnpaddedEncoderModel],
) -> ModelFamily:
    """The ``ModelFamily`` of encoders whose layer computes BERT's post-LN layer under
    another layout (DistilBERT, ALBERT): ``layer`` (module, class) becomes ``mixin.over``
    it when ``layer_problem`` finds nothing against ``mixin.layout``; another class that
    ``looks_like`` names (what it is taken for, e.g. "a DistilBERT block") is left with
    that reason; the ``embeddings`` classes' LayerNorm + dropout fuse, the masked-LM
    ``heads`` layouts fuse their loss, and ``base_model`` unpads as ``unpadding`` once
    every layer its ``encoder_layers`` lists is fused."""

    def replace(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
        if (type(module).__module__, type(module).__name__) == layer:
            problem = layer_problem(module, mixin.layout)
            return (None, problem) if problem else (fuse_layer(module, mixin), None)
        taken_for = looks_like(module)
        if taken_for is not None:
            return None, f"{type(module).__name__} is not {taken_for} verified to compute {layer[1]}'s forward"
        return None

    def unpad(model: nn.Module) -> tuple[type | None, str | None] | None:
        kind = getattr(type(model), "_original_class", type(model))
        if (kind.__module__, kind.__name__) != base_model:
            return None
        if all(isinstance(fused, mixin) for fused in unpadding.encoder_layers(model)):
            return unpadding.over(type(model)), None
        return None, "unpad: its layers are not all fused"

    return ModelFamily(
        name,
        replace,
        replace_children=lambda module: fuse_embeddings(module, embeddings),
        fuse_loss=lambda model: fused_loss(model, heads),
        unpad=unpad,
    )


def _unpadded(model: nn.Module) -> tuple[type | None, str | None] | None:
    if not is_unpaddable_base_model(model):
        return None
    layers = list(getattr(getattr(model, "encoder", None), "layer", ()))
    if layers and all(isinstance(layer, FusedBertFamilyLayer) for layer in layers):
        return UnpaddedEncoderModel.over(type(model)), None
    return None, "unpad: its encoder layers are not all fused"


FAMILY = ModelFamily(
    "BERT family", _replacement, replace_children=fuse_embeddings, fuse_loss=fused_loss, unpad=_unpadded
)
