"""Swap slimformer's fused layers into an existing model, in place, and back.

``patch(model)`` replaces modules one instance at a time, over the same Parameter
objects (no copies, the same ``state_dict`` keys and tensors, optimizers built before
the patch keep working):

* encoder layers of HuggingFace BERT-family models (transformers >= 5: BERT, RoBERTa,
  XLM-RoBERTa, CamemBERT, ELECTRA, ERNIE, Data2VecText, RoCBert, and so the
  sentence-transformers models built on them) -> ``Fused<Layer>``, a subclass of the
  layer's own class (``isinstance`` holds, so transformers' ``output_hidden_states``
  capture and gradient checkpointing still find it) that holds the same submodules
  and runs, with p the hidden dropout:

      c = attention(x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv; mask)   fused kernel, keeps q, k, v, c, lse
      y = LayerNorm(dropout_p(c Woᵀ + bo) + x)                   one kernel, keeps y and rstd
      z = LayerNorm(dropout_p(fused_mlp(y)) + y)                 keeps fc1's output (GELU input)

  Every dropout mask is regenerated from a Philox seed rather than stored, so dropout
  draws differ from torch's, with the same distribution.
* the embeddings of those models (``BertEmbeddings`` ...): their ``LayerNorm`` and
  ``dropout``, which their forward calls one after the other, become a
  ``LayerNormDropout`` and a ``DropoutInNorm`` (``slimformer.layers.norm``), the
  same fused norm kernel applying the dropout to its output with the mask regenerated
  from a seed; the dropout's place passes its input through. Checked against the
  embeddings' source: each ``x = self.LayerNorm(x)`` directly followed by
  ``x = self.dropout(x)``, and no other call of either.
* HuggingFace BERT-family ``*ForMaskedLM`` models (BERT, ERNIE, RoBERTa, XLM-RoBERTa,
  CamemBERT, Data2VecText) and ``BertForPreTraining`` change class in place to ``Fused<Model>``, whose training
  loss skips the vocabulary logits (see ``slimformer.masked_lm``; ``logits`` is None
  when that loss is fused);
* with ``unpad=True``, HuggingFace BERT-family base models (``BertModel``, ``RobertaModel``
  ...) whose encoder layers are all fused change class in place to ``Unpadded<Model>``,
  which runs padded batches on their real tokens only (see ``slimformer.unpad``);
* ``torch.nn.TransformerEncoderLayer`` -> ``slimformer.TransformerEncoderLayer``
  (``from_torch``), also inside ``torch.nn.TransformerEncoder``;
* every other ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` -> ``slimformer.LayerNorm``
  / ``slimformer.RMSNorm`` (``from_torch``, memory-efficient mode);
* ``torch.nn.MultiheadAttention`` -> ``slimformer.MultiheadAttention`` (``from_torch``);
* HuggingFace RMSNorms whose forward is LlamaRMSNorm's, checked against its source
  (Llama, Mistral, Qwen2/3 and about 130 more families in transformers 5) ->
  ``Fused<Norm>``, which normalises in one kernel and then multiplies by the weight in
  the input's dtype, exactly as the original casts before it scales.

Only those exact classes are swapped: a subclass may compute something else, so it is
left, and the summary says why. So is every other module whose class name says it is
an attention, an MLP or a norm (GPT-2's attention and MLP, Llama's, Gemma's
``(1 + weight)`` RMSNorm ...). ``patch`` returns the model; what it did is
``patch_summary(model)``, printable as plain text or a rich table.

The fused layers take the ``recompute`` policies of ``slimformer.recompute``. HF BERT
keeps q, k and v as three Linears, while ``self_attention``'s QKV recompute wants one
stacked weight, which would be a 3·E² copy per step kept for backward; so ``qkv``
checkpoints the projections together with the attention (non-reentrant, RNG restored),
which also repeats the attention forward in backward (about 3% of a BERT-base layer's
FLOPs at seq 512) and keeps neither q, k, v nor the log-sum-exp.

The fused BERT layer calls the q, k, v and attention-output Linears as modules (their
hooks fire; an adapter wrapped around one, such as a PEFT LoRA layer, is used). Its
Linears may be ``sf.quantize``'s inference layers, in either order (``patch`` of a
quantized model, ``sf.quantize`` of a patched one, with or without ``unpad``). The MLP
Linears are read by the fused MLP kernel while they are float nn.Linears without hooks;
quantized or hooked, they are called as modules (fc1, the activation, fc2). A call
runs the layer's original, unfused forward instead, for that call only, when it asks
for the attention weights, by the ``output_attentions`` argument or by
``config.output_attentions`` (read at each call, as transformers' output capture reads
it; the weights are formed only there), when it passes a cache (``cache`` or
``past_key_values``, which the original attention writes) or a mask that is not a
tensor (flex attention's ``BlockMask``), when a submodule the fused forward does not
call (``attention``, ``attention.self``, ``attention.output``, ``intermediate``,
``output``, the dropouts, LayerNorms and the activation) has a forward or backward hook
(transformers' inactive output-capturing hooks excepted) or was replaced by a module of
another type (the MLP Linears by anything but nn.Linear or sf.quantize's). The original
gets the call's arguments as they came. Other limits: decoder layers (causal, cache,
cross-attention) and activations other than gelu / gelu_new / gelu_pytorch_tanh /
relu are left; ``chunk_size_feed_forward`` is not needed (the fused MLP keeps less
than a chunked one) and is ignored.

The attention implementation is the user's: ``patch`` never changes
``config._attn_implementation`` (transformers' default, "sdpa", or what was asked for,
reads back the same), and ``model.set_attn_implementation`` after the patch is honoured.
The fused layers run the fused kernel under "eager", "sdpa", "slimformer" and flash
attention alike, since the result is the same: they read the mask transformers builds
for the implementation as it is (eager's and sdpa's (batch, 1, seq, seq) masks, shared by
all layers, or a (batch, seq) padding mask). A call that asks for the attention weights
runs the original layer, so the implementation answers as it would unpatched: "eager"
returns the weights, "slimformer" forms them in PyTorch, "sdpa" returns none (and
transformers warns). Under ``torch.compile`` transformers builds the (batch, 1, seq,
seq) mask of "eager" and "sdpa" even without padding (4 MiB at batch 4, seq 512 in
fp32, kept for backward); ``model.set_attn_implementation("slimformer")`` (registered
when transformers is imported, see ``register_transformers_attention``) passes the
(batch, seq) padding mask instead.

Every class ``patch`` makes at run time (``Fused<Layer>``, ``Fused<Model>``,
``Unpadded<Model>``) has the original's ``forward`` signature, as ``inspect.signature``
reads it: transformers' Trainer keeps the dataset columns the model takes.

Patch before wrapping the model (DDP, FSDP, ``torch.compile``). Hooks registered on a
swapped module before the patch move to its replacement; hooks added afterwards are
dropped by ``unpatch``.
"""

import copy
import inspect
import re
import textwrap
import warnings
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import attention
from slimformer.kernels.norm import MEMORY_MODES, fused_norm, rms_norm
from slimformer.kernels.projection import projections
from slimformer.kernels.varlen_attention import varlen_attention
from slimformer.layers.attention import MultiheadAttention
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.layers.norm import LayerNorm, RMSNorm, fuse_with_dropout
from slimformer.layers.sharing import (
    NotScriptable,
    TorchDropout,
    TorchLayerNorm,
    TorchMultiheadAttention,
    TorchRMSNorm,
    TorchTransformerEncoderLayer,
    forward_with_signature,
    has_user_hooks as _has_user_hooks,
)
from slimformer.layers.transformer import TransformerEncoderLayer
from slimformer.masked_lm import fused_masked_lm_class, is_masked_lm, masked_lm_problem
from slimformer.recompute import check_policy
from slimformer.unpad import PackedSequences, is_unpaddable_base_model, unpadded_class

__all__ = [
    "FusedBertFamilyLayer",
    "FusedLlamaStyleRMSNorm",
    "ClassSwap",
    "Left",
    "PatchSummary",
    "Swap",
    "patch",
    "patch_summary",
    "unpatch",
]

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
_NORM_THEN_DROPOUT = re.compile(r"(\w+) = self\.LayerNorm\(\1\)\n\s*\1 = self\.dropout\(\1\)\n")
# config.hidden_act -> fused_mlp's activation.
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_MAX_HEAD_DIM = 256
_RECORD = "_slimformer_patch"
# The Linears of a fused BERT layer may be ``sf.quantize``'s inference layers (for either
# order of patch and quantize).
_LINEARS = (nn.Linear, Linear8bit, Linear16bit)
# Submodules that the fused forward runs without calling, and the types it computes
# for (None: a container whose own forward is replaced); the Linears, which it calls
# (q, k, v, attention.output.dense) or may call (the MLP's), are not listed.
_BYPASSED = {
    "attention": None, "attention.self": None, "attention.self.dropout": (TorchDropout,),
    "attention.output": None, "attention.output.dropout": (TorchDropout,),
    "attention.output.LayerNorm": (TorchLayerNorm, LayerNorm), "intermediate": None,
    "intermediate.intermediate_act_fn": None, "output": None, "output.dropout": (TorchDropout,),
    "output.LayerNorm": (TorchLayerNorm, LayerNorm),
}  # fmt: skip
# The MLP's Linears: read by the fused MLP kernel when they are plain nn.Linears without
# hooks, else called as modules (sf.quantize's layers; hooks such as SmoothQuant
# calibration's, which so see the real tokens only in an unpadded model).
_MLP_LINEARS = ("intermediate.dense", "output.dense")
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


def _rebuild_fused_layer(original_class: type, state: dict, mixin: type | None = None) -> nn.Module:
    fused_class = _fused_class(original_class, mixin or FusedBertFamilyLayer)
    layer = fused_class.__new__(fused_class)
    layer.__dict__.update(state)
    return layer


class FusedBertFamilyLayer(NotScriptable):
    """Forward of a patched BERT-family encoder layer, mixed before the layer's own class.

    ``patch`` makes ``Fused<Layer>(FusedBertFamilyLayer, <Layer>)`` and an instance that shares
    the original's submodules and hooks. Attributes it adds: ``recompute`` (a policy of
    ``slimformer.recompute``), ``fused_activation`` and ``saves_output`` (whether each
    of the two LayerNorms may keep its output instead of its input, re-decided whenever
    their weights change, see ``slimformer.kernels.norm.MemoryModes``).

    ``forward(hidden_states, attention_mask=None, ...)`` takes what the original does (and
    ``inspect.signature`` of it is the original's) and returns the layer output (batch,
    seq, hidden) in hidden_states' dtype.
    """

    # sf.quantize may swap its inference Linears in: the forward calls them as modules.
    accepts_quantized_linears = True

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        packed = isinstance(attention_mask, PackedSequences)
        reason = self._call_reason(attention_mask, args, kwargs) or self._unfused_reason()
        if reason is not None:
            if packed:
                raise RuntimeError(
                    f"an unpadded (packed) batch reached a layer that must run its original forward ({reason}); "
                    "call the base model, which runs such calls padded"
                )
            # The caller's arguments as they came: the original names the cache ``cache``
            # in transformers 5.24 and maps a ``past_key_values`` onto it.
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
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
            h, y = checkpoint(self._attention_mlp, hidden_states, attn_mask, padding, "none", use_reentrant=False)
            return self._add_norm(h, y, self.output)
        return self._add_norm(*self._attention_mlp(hidden_states, attn_mask, padding, policy), self.output)

    def _call_reason(self, attention_mask, args, kwargs) -> str | None:
        """Why this call, by its arguments, must run the original forward, or None.

        The original attention writes a cache (an encoder layer gets one only when a caller
        passes it) and forms the attention weights, which transformers collects when they
        are asked for, by argument or in the config (as its ``capture_outputs`` decides).
        A mask that is not a tensor (flex attention's BlockMask) is read by the original."""
        if any(value is not None for value in args) or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            return "a cache or encoder inputs were passed"
        config = getattr(self.attention.self, "config", None)
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            return "attentions were asked for"
        if not (attention_mask is None or isinstance(attention_mask, (torch.Tensor, PackedSequences))):
            return f"its attention_mask is a {type(attention_mask).__name__}"
        return None

    def _unfused_reason(self) -> str | None:
        """Why this call must run the original forward (see the module docstring), or None."""
        for path, types in _BYPASSED.items():
            try:
                module = self.get_submodule(path)
            except AttributeError:  # an activation that is a plain function
                continue
            if types is not None and type(module) not in types:
                return f"{path} is a {type(module).__name__}"
            if _has_user_hooks(module):
                return f"{path} has hooks"
        for path in _MLP_LINEARS:
            module = self.get_submodule(path)
            if type(module) not in _LINEARS:
                return f"{path} is a {type(module).__name__}"
        return None

    def _attention_mlp(self, x, attn_mask, padding, policy):
        """(the MLP's output before its dropout, its input y): the layer but its last norm."""
        if "qkv" in policy and torch.is_grad_enabled():
            context = checkpoint(self._self_attention, x, attn_mask, padding, use_reentrant=False)
        else:
            context = self._self_attention(x, attn_mask, padding)
        out = self.attention.output
        y = self._add_norm(out.dense(context), x, out)
        return self._mlp(y, policy), y

    def _mlp(self, y, policy):
        """fc2(act(fc1(y))): the fused MLP kernel for float Linears without hooks; else (``sf.quantize``'s
        inference Linears, which keep no float weight; hooks) the Linears are called as modules."""
        fc1, fc2 = self.intermediate.dense, self.output.dense
        if all(type(fc) is nn.Linear and not _has_user_hooks(fc) for fc in (fc1, fc2)):
            return fused_mlp(
                y, fc1.weight, fc1.bias, fc2.weight, fc2.bias, self.fused_activation, 0.0,
                recompute_fc1="mlp" in policy,
            )  # fmt: skip
        return fc2(self.intermediate.intermediate_act_fn(fc1(y)))

    def _self_attention(self, x, attn_mask, padding):
        """(batch, seq, hidden) context, before the output projection; ``attn_mask`` may be
        a ``PackedSequences`` (x is then (1, total, hidden): every real token, packed)."""
        attn = self.attention.self
        dropout_p = attn.dropout.p if attn.training else 0.0
        qkv = self._qkv(x)
        if isinstance(attn_mask, PackedSequences):
            q, k, v = (rearrange(t, "1 t (h d) -> t h d", h=attn.num_attention_heads) for t in qkv)
            cu, longest = attn_mask.cu_seqlens, attn_mask.max_seqlen
            out = varlen_attention(q, k, v, cu, cu, longest, longest, dropout_p, scale=attn.scaling)
            return rearrange(out, "t h d -> 1 t (h d)")
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=attn.num_attention_heads) for t in qkv)
        out = attention(q, k, v, attn_mask, dropout_p, scale=attn.scaling, key_padding_mask=padding)
        return rearrange(out, "b h s d -> b s (h d)")

    def _qkv(self, x):
        """The query, key and value projections of x: one op with one input gradient for float
        Linears without hooks (see ``slimformer.kernels.projection``); else the Linears are called."""
        attn = self.attention.self
        linears = (attn.query, attn.key, attn.value)
        if all(type(fc) is nn.Linear and not _has_user_hooks(fc) for fc in linears):
            return projections(x, [fc.weight for fc in linears], [fc.bias for fc in linears])
        return [fc(x) for fc in linears]

    @staticmethod
    def _add_norm(branch, residual, block):
        """``block.LayerNorm(block.dropout(branch) + residual)`` (BertSelfOutput, BertOutput), one kernel."""
        norm = block.LayerNorm
        dropout_p = block.dropout.p if block.dropout.training else 0.0
        rebuilds_input = torch.is_grad_enabled() and MEMORY_MODES.rebuilds_input(norm)
        return fused_norm(
            branch, norm.normalized_shape, norm.weight, norm.bias, norm.eps, residual, dropout_p,
            rebuilds_input, False, False,
        )  # fmt: skip

    @property
    def saves_output(self) -> tuple[bool, bool]:
        """Whether each LayerNorm may keep its output instead of its input, for the current weights."""
        norms = (self.attention.output.LayerNorm, self.output.LayerNorm)
        return tuple(MEMORY_MODES.rebuilds_input(norm) for norm in norms)

    def refresh_memory_mode(self) -> tuple[bool, bool]:
        """Re-decide now (one host sync); needed only after writing the weights through ``.data``."""
        MEMORY_MODES.refresh(self.attention.output.LayerNorm, self.output.LayerNorm)
        return self.saves_output

    def __reduce_ex__(self, protocol):
        # Fused<Layer> is made at run time, so a pickle names the original class instead.
        return _rebuild_fused_layer, (self._original_class, self.__dict__)

    def extra_repr(self) -> str:
        return f"activation={self.fused_activation!r}, recompute={self.recompute!r}, saves_output={self.saves_output}"


# The forward of transformers' LlamaRMSNorm, which most decoder families copy verbatim.
_LLAMA_RMSNORM_FORWARD = """\
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedLlamaStyleRMSNorm:
    """Forward of a patched HuggingFace RMSNorm whose forward is LlamaRMSNorm's.

    That forward normalises in fp32, casts to the input's dtype and then multiplies by
    the weight (in the dtype promotion of weight and input). Here the normalisation is
    one ``rms_norm`` call without weight (fp32 statistics, rounded once to the input's
    dtype, keeping its output and rstd for backward instead of an fp32 copy of the
    input), followed by the same ``weight *`` product. Inputs of other dtypes (float64)
    run the original forward.
    """

    def forward(self, hidden_states):
        if hidden_states.dtype not in _NORM_DTYPES:
            return super().forward(hidden_states)
        normalized = rms_norm(
            hidden_states, tuple(self.weight.shape), None, self.variance_epsilon, memory_efficient=True
        )
        return self.weight * normalized

    def __reduce_ex__(self, protocol):
        return _rebuild_fused_layer, (self._original_class, self.__dict__, FusedLlamaStyleRMSNorm)


_FUSED_CLASSES: dict[tuple[type, type], type] = {}


def _fused_class(layer_class: type, mixin: type = FusedBertFamilyLayer) -> type:
    """``Fused<Layer>``: ``mixin``'s forward, under ``layer_class``'s forward signature, over
    ``layer_class``; made once per class."""
    if (mixin, layer_class) not in _FUSED_CLASSES:
        forward = forward_with_signature(mixin.forward, layer_class.forward)
        namespace = {"__module__": __name__, "_original_class": layer_class, "forward": forward}
        _FUSED_CLASSES[mixin, layer_class] = type(f"Fused{layer_class.__name__}", (mixin, layer_class), namespace)
    return _FUSED_CLASSES[mixin, layer_class]


_LLAMA_STYLE: dict[type, str | None] = {}


def _llama_style_rmsnorm_problem(norm: nn.Module) -> str | None:
    """Why ``norm`` (a module with a ``variance_epsilon``) is not a LlamaRMSNorm in all
    but name, or None."""
    kind = type(norm)
    if kind not in _LLAMA_STYLE:
        try:
            source = textwrap.dedent(inspect.getsource(kind.forward))
        except (OSError, TypeError):
            source = None
        same = source == _LLAMA_RMSNORM_FORWARD
        _LLAMA_STYLE[kind] = None if same else "its forward is not LlamaRMSNorm's (checked against its source)"
    if _LLAMA_STYLE[kind] is not None:
        return _LLAMA_STYLE[kind]
    parameters = dict(norm.named_parameters(recurse=False))
    extra = list(norm.children()) or list(norm.buffers())
    if list(parameters) != ["weight"] or parameters["weight"].dim() != 1 or extra:
        return "holds more than LlamaRMSNorm's one 1-d weight"
    if not isinstance(norm.variance_epsilon, float):
        return f"variance_epsilon is a {type(norm.variance_epsilon).__name__}, not a float"
    return None


def _fuse_llama_style_rmsnorm(norm: nn.Module) -> nn.Module:
    fused_class = _fused_class(type(norm), FusedLlamaStyleRMSNorm)
    fused = fused_class.__new__(fused_class)
    fused.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in norm.__dict__.items()})
    return fused


# Class names of the modules the summary accounts for when they are left.
_ROLES = {
    "attention": re.compile(r"Attention|Attn", re.I),
    "MLP": re.compile(r"MLP|FeedForward|FFN", re.I),
    "norm": re.compile(r"Norm"),
}


def _left_role_reason(module: nn.Module) -> str | None:
    """Why an attention / MLP / norm module that is no swap candidate is left, or None
    for modules of other roles."""
    name = type(module).__name__
    from_transformers = type(module).__module__.startswith("transformers.")
    if _ROLES["attention"].search(name):
        reason = (
            "attention of a model family slimformer does not fuse layer by layer (it fuses BERT-family encoder "
            "layers, torch.nn.TransformerEncoderLayer and torch.nn.MultiheadAttention)"
        )
        if from_transformers:
            reason += "; run it on slimformer's kernel with model.set_attn_implementation('slimformer')"
        return reason
    if _ROLES["MLP"].search(name):
        return (
            "no drop-in for this MLP (the fused MLP replaces the feed-forward of BERT-family layers and "
            "torch.nn.TransformerEncoderLayer)"
        )
    if _ROLES["norm"].search(name):
        return (
            "not torch.nn.LayerNorm / RMSNorm nor an RMSNorm computing LlamaRMSNorm's forward, so its result may "
            "differ (e.g. Gemma's 1 + weight, T5's cast to the weight's dtype, batch or group statistics)"
        )
    return None


def _is_bert_layer(module: nn.Module) -> bool:
    return (type(module).__module__, type(module).__name__) in _BERT_LAYERS


def _looks_like_bert_layer(module: nn.Module) -> bool:
    attention = getattr(module, "attention", None)
    return all(hasattr(obj, name) for obj, name in ((attention, "self"), (module, "intermediate"), (module, "output")))


def _bert_layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` (an allow-listed BERT-family layer) cannot be fused, or None."""
    if layer.is_decoder or getattr(layer, "add_cross_attention", False):
        return "decoder layer (causal self-attention, KV cache, cross-attention) is not fused"
    act = layer.attention.self.config.hidden_act
    if act not in _HF_ACTIVATIONS:
        return f"hidden_act {act!r} has no fused kernel (supported: {', '.join(_HF_ACTIVATIONS)})"
    expected = {
        "attention.self.query": _LINEARS, "attention.self.key": _LINEARS,
        "attention.self.value": _LINEARS, "attention.self.dropout": (TorchDropout,),
        "attention.output.dense": _LINEARS, "attention.output.dropout": (TorchDropout,),
        "attention.output.LayerNorm": (TorchLayerNorm, LayerNorm), "intermediate.dense": _LINEARS,
        "output.dense": _LINEARS, "output.dropout": (TorchDropout,), "output.LayerNorm": (TorchLayerNorm, LayerNorm),
    }  # fmt: skip
    for path, types in expected.items():
        module = layer.get_submodule(path)
        if type(module) not in types:
            return f"{path} is a {type(module).__name__}, not torch.nn.{types[0].__name__}"
    head_dim = layer.attention.self.attention_head_size
    if head_dim > _MAX_HEAD_DIM:
        return f"head_dim {head_dim} is above the fused kernel's {_MAX_HEAD_DIM}"
    return None


def _fuse_bert_layer(layer: nn.Module) -> nn.Module:
    """A ``Fused<Layer>`` sharing ``layer``'s submodules, attributes and hooks."""
    fused_class = _fused_class(type(layer))
    fused = fused_class.__new__(fused_class)
    # The module's dicts (submodules, hooks) are copied so that registering on one of
    # the two objects later does not change the other; their contents are shared.
    fused.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in layer.__dict__.items()})
    fused.fused_activation = _HF_ACTIVATIONS[layer.attention.self.config.hidden_act]
    fused.recompute = "none"
    for norm in (fused.attention.output.LayerNorm, fused.output.LayerNorm):
        MEMORY_MODES.track(norm)
    return fused


_EMBEDDINGS_SOURCE_PROBLEM: dict[type, str | None] = {}


def _embeddings_problem(embeddings: nn.Module) -> str | None:
    """Why the LayerNorm and dropout of ``embeddings`` (an allow-listed class) cannot be
    fused, or None."""
    kind = type(embeddings)
    if kind not in _EMBEDDINGS_SOURCE_PROBLEM:
        try:
            source = inspect.getsource(kind.forward)
        except (OSError, TypeError):
            source = ""
        pairs = len(_NORM_THEN_DROPOUT.findall(source))
        same = pairs > 0 and source.count("self.LayerNorm") == source.count("self.dropout") == pairs
        problem = None if same else "its forward does not apply dropout right after each LayerNorm (source checked)"
        _EMBEDDINGS_SOURCE_PROBLEM[kind] = problem
    if _EMBEDDINGS_SOURCE_PROBLEM[kind] is not None:
        return _EMBEDDINGS_SOURCE_PROBLEM[kind]
    for name, expected in (("LayerNorm", TorchLayerNorm), ("dropout", TorchDropout)):
        module = getattr(embeddings, name, None)
        if type(module) is not expected:
            return f"{name} is a {type(module).__name__}, not torch.nn.{expected.__name__}"
    return None


def _embedding_swaps(embeddings: nn.Module, name: str) -> tuple[list["Swap"], str | None]:
    """The swaps fusing the LayerNorm and dropout of BERT-family ``embeddings``, or
    ([], why not), or ([], None) when ``embeddings`` is not such a module."""
    if (type(embeddings).__module__, type(embeddings).__name__) not in _BERT_EMBEDDINGS:
        return [], None
    problem = _embeddings_problem(embeddings)
    if problem is not None:
        return [], problem
    norm, dropout = fuse_with_dropout(embeddings.LayerNorm, embeddings.dropout)
    prefix = f"{name}." if name else ""
    return [
        Swap(f"{prefix}LayerNorm", embeddings, embeddings.LayerNorm, norm),
        Swap(f"{prefix}dropout", embeddings, embeddings.dropout, dropout),
    ], None


def _is_slimformer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("slimformer.")


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(the module to put in ``module``'s place, None) or (None, why it is left, or None
    when it is no candidate at all)."""
    kind = type(module)
    if _is_bert_layer(module):
        problem = _bert_layer_problem(module)
        return (None, problem) if problem else (_fuse_bert_layer(module), None)
    if _looks_like_bert_layer(module):
        return None, f"{kind.__name__} is not a BERT-family layer verified to compute BertLayer's forward"
    if kind is TorchTransformerEncoderLayer:
        try:
            return TransformerEncoderLayer.from_torch(module), None
        except ValueError as error:
            return None, str(error)
    if kind is TorchLayerNorm:
        return LayerNorm.from_torch(module), None
    if kind is TorchRMSNorm:
        return RMSNorm.from_torch(module), None
    if kind is TorchMultiheadAttention:
        return MultiheadAttention.from_torch(module), None
    for base in (TorchTransformerEncoderLayer, TorchLayerNorm, TorchRMSNorm, TorchMultiheadAttention):
        if isinstance(module, base):
            return None, f"subclass of torch.nn.{base.__name__} whose forward may differ"
    if _ROLES["norm"].search(kind.__name__) and hasattr(module, "variance_epsilon"):
        problem = _llama_style_rmsnorm_problem(module)
        return (None, problem) if problem else (_fuse_llama_style_rmsnorm(module), None)
    return None, _left_role_reason(module)


@dataclass(frozen=True)
class Swap:
    """One module replaced: where it sits (``parent`` is None for the model itself) and
    both objects, which ``unpatch`` puts back."""

    name: str
    parent: nn.Module | None
    original: nn.Module
    replacement: nn.Module

    @property
    def attribute(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass(frozen=True)
class ClassSwap:
    """One module whose class ``patch`` changed in place (a ``*ForMaskedLM`` model, or an
    unpadded base model), and its class before, which ``unpatch`` restores."""

    name: str
    module: nn.Module
    original_class: type
    change: str = "masked-LM loss fused with the decoder"


@dataclass(frozen=True)
class Left:
    """A candidate module that ``patch`` did not replace, and why."""

    name: str
    type_name: str
    reason: str


@dataclass(frozen=True)
class PatchSummary:
    """What ``patch`` did to one model. ``print`` gives plain text; rich's ``print``
    (or ``Console.print``) a table. Held by the patched model for ``unpatch``."""

    model_type: str
    swapped: tuple[Swap, ...]
    left: tuple[Left, ...]
    # the policy patch gave the swapped layers that take one (None: none given, or none takes one)
    recompute: str | None
    # nn.TransformerEncoders whose nested-tensor fast path patch turned off (their
    # layers are slimformer's now, which take padded tensors and a padding mask)
    nested_tensor_off: tuple[nn.Module, ...] = ()
    patched: bool = True
    class_swaps: tuple[ClassSwap, ...] = ()
    # the policy patch was given where no swapped module takes one (``recompute`` is then None)
    unused_recompute: str | None = None

    def title(self) -> str:
        call = f"slimformer.patch({self.model_type}, recompute={self.recompute!r})"
        if self.unused_recompute is not None:
            call = f"slimformer.patch({self.model_type}, recompute={self.unused_recompute!r} applies to nothing)"
        if not self.patched:
            call = f"{self.model_type}, not patched"
        return f"{call}: {len(self.swapped) + len(self.class_swaps)} swapped, {len(self.left)} left"

    def rows(self) -> list[tuple[str, str, str]]:
        """(module, original type, what it became or why it was left), one per module."""
        rows = [
            (swap.name or "(model)", swap.original_class.__name__,
             f"-> slimformer {type(swap.module).__name__} ({swap.change})")
            for swap in self.class_swaps
        ]  # fmt: skip
        for swap in self.swapped:
            result = f"-> slimformer {type(swap.replacement).__name__}"
            policy = getattr(swap.replacement, "recompute", None)
            if policy is not None:
                result += f" (recompute={policy!r})"
            rows.append((swap.name or "(model)", type(swap.original).__name__, result))
        rows.extend((left.name or "(model)", left.type_name, f"left: {left.reason}") for left in self.left)
        return rows

    def __str__(self) -> str:
        rows = [("module", "type", "result"), *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
        return "\n".join([self.title(), *lines])

    def __rich__(self):
        from rich.table import Table
        from rich.text import Text

        table = Table(title=self.title())
        for column in ("module", "type", "result"):
            table.add_column(column)
        for row in self.rows():
            table.add_row(*(Text(cell) for cell in row))
        return table


def _plan(model: nn.Module) -> tuple[list[Swap], list[Left]]:
    """Swaps and leftovers, walking the module tree; a swapped module is not entered.

    Inside a module that is left, only norms are listed again (they may still be
    swapped); its attention and MLP are covered by its own reason."""
    swaps, left, replacements = [], [], {}

    def visit(module: nn.Module, name: str, parent: nn.Module | None, inside_left: bool) -> None:
        if _is_slimformer(module):
            return
        if id(module) not in replacements:  # a module registered twice gets one replacement
            replacements[id(module)] = _replacement(module)
            reason = replacements[id(module)][1]
            if reason is not None and (not inside_left or _ROLES["norm"].search(type(module).__name__)):
                left.append(Left(name, type(module).__name__, reason))
        replacement, reason = replacements[id(module)]
        if replacement is not None:
            swaps.append(Swap(name, parent, module, replacement))
            return
        fused_children, problem = _embedding_swaps(module, name)
        swaps.extend(fused_children)
        if problem is not None:
            left.append(Left(name, type(module).__name__, problem))
        done = {swap.attribute for swap in fused_children}
        for child_name, child in module.named_children():
            if child_name not in done:
                visit(child, f"{name}.{child_name}" if name else child_name, module, inside_left or reason is not None)

    visit(model, "", None, False)
    return swaps, left


def _plan_masked_lm(model: nn.Module) -> tuple[list[ClassSwap], list[Left]]:
    """``*ForMaskedLM`` models in ``model`` whose loss can be fused, and those that cannot."""
    swaps, left = [], []
    for name, module in model.named_modules():
        if is_masked_lm(module) and not _is_slimformer(module):
            problem = masked_lm_problem(module)
            if problem is None:
                swaps.append(ClassSwap(name, module, type(module)))
            else:
                left.append(Left(name, type(module).__name__, problem))
    return swaps, left


def _plan_unpad(root: nn.Module) -> tuple[list[ClassSwap], list[Left]]:
    """Base models in ``root`` (already patched) to unpad, and those that cannot be."""
    swaps, left = [], []
    for name, module in root.named_modules():
        if not is_unpaddable_base_model(module) or _is_slimformer(module):
            continue
        layers = list(getattr(getattr(module, "encoder", None), "layer", ()))
        if layers and all(isinstance(layer, FusedBertFamilyLayer) for layer in layers):
            swaps.append(ClassSwap(name, module, type(module), "unpadded: packed real tokens, varlen attention"))
        else:
            left.append(Left(name, type(module).__name__, "unpad: its encoder layers are not all fused"))
    return swaps, left


def patch(model: nn.Module, recompute: str | None = None, unpad: bool = False) -> nn.Module:
    """Swap slimformer's fused layers into ``model`` in place (see the module docstring).

    Args:
        model: any ``nn.Module``; patch it before wrapping it in DDP, FSDP or
            ``torch.compile``.
        recompute: policy for the swapped layers that take one ("none", "qkv", "mlp",
            "qkv+mlp", "full"); None leaves them at "none". ``slimformer.recompute``
            changes it later. A policy that no swapped module takes (a GPT-2, whose
            norms only are swapped) warns with a ``UserWarning``, and the summary says
            it applies to nothing.
        unpad: also unpad BERT-family base models (``slimformer.unpad``): with a padded
            ``attention_mask``, every layer runs on the real tokens only, and padded
            positions of ``last_hidden_state`` are zeros. Off by default.

    Returns:
        ``model`` (or its replacement, when ``model`` is itself a swappable layer), with
        ``patch_summary`` of it telling what was swapped and what was left and why. A
        model that is already patched, or has nothing to patch, is returned unchanged
        with a ``UserWarning`` saying so.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``unpad`` is not a bool.
        ValueError: ``recompute`` is not a policy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(unpad, bool):
        raise TypeError(f"unpad must be a bool, got {type(unpad).__name__} {unpad!r}")
    if recompute is not None:
        check_policy(recompute)
    patched = [name or "the model itself" for name, module in model.named_modules() if _RECORD in module.__dict__]
    if patched:
        warnings.warn(
            f"slimformer.patch: {type(model).__name__} is already patched ({', '.join(patched)}); nothing changed. "
            "Call slimformer.unpatch first to patch it again.",
            stacklevel=2,
        )
        return model
    model_type = type(model).__name__
    swaps, left = _plan(model)
    class_swaps, heads_left = _plan_masked_lm(model)
    left += heads_left
    if not swaps and not class_swaps:
        reasons = "".join(f"\n  {item.name or '(model)'} ({item.type_name}): {item.reason}" for item in left)
        warnings.warn(
            f"slimformer.patch: nothing to patch in {type(model).__name__}; nothing changed.{reasons}", stacklevel=2
        )
        return model
    for swap in swaps:
        if recompute is not None and hasattr(swap.replacement, "recompute"):
            swap.replacement.recompute = recompute
        if swap.parent is not None:
            setattr(swap.parent, swap.attribute, swap.replacement)
    for class_swap in class_swaps:
        class_swap.module.__class__ = fused_masked_lm_class(class_swap.original_class)
    root = swaps[0].replacement if swaps and swaps[0].parent is None else model
    nested_off = tuple(
        encoder
        for encoder in root.modules()
        if isinstance(encoder, nn.TransformerEncoder)
        and getattr(encoder, "use_nested_tensor", False)
        and any(isinstance(layer, TransformerEncoderLayer) for layer in encoder.layers)
    )
    for encoder in nested_off:
        encoder.use_nested_tensor = False
    if unpad:
        unpad_swaps, unpad_left = _plan_unpad(root)
        if not unpad_swaps:
            warnings.warn(
                f"slimformer.patch: unpad=True but {type(model).__name__} has no BERT-family base model whose "
                "encoder layers are all fused; nothing is unpadded",
                stacklevel=2,
            )
        for class_swap in unpad_swaps:
            class_swap.module.__class__ = unpadded_class(class_swap.original_class)
        class_swaps += unpad_swaps
        left += unpad_left
    unused = None
    if recompute is not None and not any(hasattr(swap.replacement, "recompute") for swap in swaps):
        unused, recompute = recompute, None
        warnings.warn(
            f"slimformer.patch: recompute={unused!r} applies to nothing in {model_type}: none of the modules "
            "it swapped takes a recompute policy (fused BERT-family encoder layers and "
            "torch.nn.TransformerEncoderLayer do)",
            stacklevel=2,
        )
    summary = PatchSummary(
        model_type, tuple(swaps), tuple(left), recompute, nested_off, class_swaps=tuple(class_swaps),
        unused_recompute=unused,
    )  # fmt: skip
    setattr(root, _RECORD, summary)
    # Decide the norms' memory modes now (one host sync): a model compiled before its first
    # eager step would otherwise trace the safe mode, keeping each norm's input too.
    MEMORY_MODES.refresh()
    return root


def patch_summary(model: nn.Module) -> PatchSummary:
    """What ``patch`` did to ``model``: every module swapped, and every candidate,
    attention, MLP and norm module left with the reason. Never raises for a module.

    For a model that is not patched (``patch`` was not called, or found nothing to
    swap) the summary has no swaps, and lists what ``patch`` would swap as left with
    the reason "not patched"; its ``patched`` is False.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    summary = getattr(model, _RECORD, None)
    if summary is not None:
        return summary
    swaps, left = _plan(model)
    class_swaps, heads_left = _plan_masked_lm(model)
    would_swap = tuple(
        Left(swap.name, swap.original_class.__name__, "not patched (slimformer.patch would fuse its masked-LM loss)")
        for swap in class_swaps
    ) + tuple(
        Left(swap.name, type(swap.original).__name__, f"not patched (slimformer.patch would swap it for slimformer "
                                                     f"{type(swap.replacement).__name__})")
        for swap in swaps
    )  # fmt: skip
    return PatchSummary(type(model).__name__, (), (*would_swap, *left, *heads_left), None, patched=False)


def _recorded_summary(model: nn.Module) -> PatchSummary:
    summary = getattr(model, _RECORD, None)
    if summary is None:
        raise ValueError(
            f"{type(model).__name__} is not patched: slimformer.patch returned it unchanged or was not called"
        )
    return summary


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the exact module objects ``patch`` replaced; returns the original model.

    The originals take the train/eval mode of their replacements. Raises ValueError if
    ``model`` is not patched, or if a swapped module is no longer where ``patch`` put it
    (then nothing is changed).
    """
    summary = _recorded_summary(model)
    for swap in summary.swapped:
        if swap.parent is not None and swap.parent._modules.get(swap.attribute) is not swap.replacement:
            raise ValueError(f"{swap.name or 'the model'} was replaced after patching; not restoring any module")
    for swap in reversed(summary.swapped):
        swap.original.train(swap.replacement.training)
        if swap.parent is not None:
            setattr(swap.parent, swap.attribute, swap.original)
    for encoder in summary.nested_tensor_off:
        encoder.use_nested_tensor = True
    for class_swap in summary.class_swaps:
        class_swap.module.__class__ = class_swap.original_class
    delattr(model, _RECORD)
    swapped_self = summary.swapped and summary.swapped[0].parent is None
    return summary.swapped[0].original if swapped_self else model
