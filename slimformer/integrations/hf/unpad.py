"""Unpadded BERT-family encoders: compute and memory proportional to the real tokens.

``slimformer.patch(model, unpad=True)`` changes the class of each BERT-family, DistilBERT
or ALBERT base model in ``model`` (``BertModel``, ``RobertaModel``, ``DistilBertModel``,
``AlbertModel`` ... also inside ``*ForMaskedLM``, ``*ForSequenceClassification``, token
classification and sentence-transformers models), in place and reversibly, to
``Unpadded<Model>(UnpaddedEncoderModel, <Model>)`` (a family's subclass of it where its
model differs). When a call passes a 2-d ``attention_mask`` (1 = token, 0 = padding) its
forward

1. packs: the flat indices of the real tokens (``torch.nonzero``: the one host sync a
   forward needs, for the token count) and ``cu_seqlens`` (int32, no sync), once;
2. gathers every per-token input (input_ids, token_type_ids, the position ids the
   padded model would have used, inputs_embeds, ...) into one packed (1, total) row,
   so the embeddings, every encoder layer (QKV, attention through
   ``slimformer.varlen_attention``, MLP, norms, dropout) run on the real tokens only;
3. scatters ``last_hidden_state`` (and ``hidden_states``) back to (batch, seq, hidden)
   once at the end, with **zeros at padded positions** (HF returns values there that
   no head reads), and runs the pooler on it.

Every real position equals the padded model's, outputs and gradients, for any mask:
right or left padding, holes in the middle (the sequence is the row's real tokens in
order, at their padded positions), all-padding rows (no tokens; their rows are zero; a
batch with no token at all runs padded).
Dropout masks are drawn per packed token, so with dropout a step differs from the padded
model's by its random draws only. The Linears may be ``slimformer.quantize``'s (quantize
before or after the patch): INT8's activation scales are per token, so a token's Linear
output depends on its own row only, packed or padded.

Calls that cannot be unpadded run the original, padded forward: no ``attention_mask``
(nothing to remove) or a 4-d one, attentions asked for (``output_attentions``, as an
argument or in the config), encoder-decoder inputs (``encoder_hidden_states``, a cache
as ``cache`` or ``past_key_values``, ``use_cache``), a decoder config, or an
encoder layer that is not fused or runs its original forward this call (hooks, replaced
submodules: see ``slimformer.integrations.hf.bert``), and ``torch.export`` (the packed length is the
mask's token count, a value an exported graph cannot take its shapes from; under
``torch.compile`` the packing runs eagerly instead). ``model.unpad = False`` on the base
model turns it off. With left padding the pooler reads position 0, which is padding: it pools a
zero row where HF pools the padding token's state (neither is a [CLS] embedding).

The packing reaches the fused layers as their attention mask. BERT-family models build
the layers' mask in ``_create_attention_masks``, which the unpadded model replaces to hand
the packing on. DistilBERT and ALBERT build it inline, by transformers'
``create_bidirectional_mask``: their unpadded forward calls the original with no mask
(for which every implementation in ``_INLINE_MASK_IMPLEMENTATIONS`` builds none) and the
packing as the keyword argument ``PACKING_ARGUMENT``, which their forwards hand down to
every layer with the rest of their keyword arguments; other attention implementations
(flex attention's BlockMask) run padded.

The packing itself (``PackedSequences``, ``pack_padding_mask``, ``unpad_tokens``,
``pad_tokens``) is plain torch, kept here beside its only user.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slimformer.integrations.hf.classes import RuntimeMixin

# Base models whose forward is BertModel's: embeddings (position ids from a buffer, or
# RoBERTa's from the padding index), ``_create_attention_masks``, the encoder's layers,
# an optional pooler. Named by module and class so transformers is never imported here.
_BASE_MODELS = frozenset(
    {
        ("transformers.models.bert.modeling_bert", "BertModel"),
        ("transformers.models.roberta.modeling_roberta", "RobertaModel"),
        ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaModel"),
        ("transformers.models.camembert.modeling_camembert", "CamembertModel"),
        ("transformers.models.electra.modeling_electra", "ElectraModel"),
        ("transformers.models.ernie.modeling_ernie", "ErnieModel"),
        ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextModel"),
        ("transformers.models.roc_bert.modeling_roc_bert", "RoCBertModel"),
    }
)


# Attention implementations whose mask builder returns None for no mask (no padding in
# the packed row), so that a model building its mask inline hands its layers None.
_INLINE_MASK_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "slimformer"})

# Arguments of a call that runs padded: encoder-decoder inputs and a cache, which the
# original attention writes (transformers 5.24 names it ``cache`` and maps a
# ``past_key_values`` onto it).
_DECODER_ARGUMENTS = ("encoder_hidden_states", "cache", "past_key_values")


@dataclass(frozen=True)
class PackedSequences:
    """Where the real tokens of a padded (batch, seq) batch sit once packed.

    ``indices``: (total,) int64 flat positions of the real tokens in (batch · seq);
    ``cu_seqlens``: (batch + 1,) int32 running token counts; ``max_seqlen``: the padded
    length ``seq``, an upper bound of every sequence's known without a host sync.
    Passed to the encoder layers as their ``attention_mask``.
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    seq: int

    @property
    def total(self) -> int:
        return self.indices.numel()


# Run eagerly under torch.compile: the token count is a host sync, so the graph breaks
# here anyway; this way it breaks once, at this call, rather than once in each frame.
@torch.compiler.disable
def pack_padding_mask(attention_mask: torch.Tensor) -> PackedSequences:
    """``PackedSequences`` of a (batch, seq) mask of 1 (token) and 0 (padding), bool,
    integer or float; any pattern of padding. Raises TypeError / ValueError for other
    shapes or values (on CUDA the value check is a device-side assert)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-d (batch, seq), got shape {tuple(attention_mask.shape)}")
    if attention_mask.is_complex():
        raise TypeError(f"attention_mask must be bool, integer or float, got {attention_mask.dtype}")
    batch, seq = attention_mask.shape
    tokens = attention_mask != 0
    if attention_mask.dtype != torch.bool:
        not_binary = tokens & (attention_mask != 1)
        if attention_mask.device.type == "cpu":
            if not_binary.any():
                bad = attention_mask[not_binary][0].item()
                raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got {bad}")
        else:
            torch._assert_async(~not_binary.any(), "attention_mask must hold only 0 (padding) and 1 (token)")
    cu_seqlens = F.pad(tokens.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    indices = tokens.flatten().nonzero().flatten()  # the host sync: the token count
    return PackedSequences(indices, cu_seqlens, seq, batch, seq)


# The keyword argument that carries the packing to the layers of a model that builds its
# mask inline (its forward passes its keyword arguments on to every layer).
PACKING_ARGUMENT = "slimformer_packing"


# Run eagerly under torch.compile (a host sync, as the packing's token count is).
@torch.compiler.disable
def has_padding_between_tokens(mask: torch.Tensor) -> bool:
    """Whether a row of a (batch, seq) padding mask has padding between two tokens: where a
    model's attention depends on positions (MPNet's relative bias, ModernBERT's window), the
    packed sequence's offsets would leave that padding out."""
    tokens = mask != 0
    starts = (tokens[:, 1:] & ~tokens[:, :-1]).sum(1) + tokens[:, 0]
    return bool((starts > 1).any())


def unpad_tokens(x: torch.Tensor, packing: PackedSequences) -> torch.Tensor:
    """(batch, seq, ...) -> (total, ...): the real tokens, in order."""
    return x.flatten(0, 1).index_select(0, packing.indices)


def pad_tokens(x: torch.Tensor, packing: PackedSequences) -> torch.Tensor:
    """(total, ...) -> (batch, seq, ...), zeros at padded positions."""
    out = x.new_zeros(packing.batch * packing.seq, *x.shape[1:])
    return out.index_copy(0, packing.indices, x).view(packing.batch, packing.seq, *x.shape[1:])


def _first_positions(packed: torch.Tensor, packing: PackedSequences, first_is_token: torch.Tensor) -> torch.Tensor:
    """(batch, ...) position 0 of every row of ``pad_tokens(packed, packing)``: a row's
    first packed token when position 0 is a token, else zeros."""
    if packing.total == 0:
        return packed.new_zeros(packing.batch, *packed.shape[1:])
    first = packed.index_select(0, packing.cu_seqlens[:-1].clamp(max=packing.total - 1))
    return torch.where(first_is_token.view(-1, *[1] * (packed.dim() - 1)), first, 0.0)


def is_unpaddable_base_model(module: nn.Module) -> bool:
    """Whether ``module`` is one of the BERT-family base models ``patch(unpad=True)`` can unpad."""
    kind = getattr(type(module), "_original_class", type(module))
    return (kind.__module__, kind.__name__) in _BASE_MODELS


class UnpaddedEncoderModel(RuntimeMixin):
    """Forward of an unpadded base model, mixed before the model's own class (see the
    module docstring); it takes the model's own arguments, and ``inspect.signature`` of
    it is the model's. ``unpad`` (default True) turns it off."""

    prefix = "Unpadded"
    unpad = True
    # sf.quantize may swap its inference Linears in (the pooler's is called as a module).
    accepts_quantized_linears = True
    # Whether the model builds its layers' mask inline (see the module docstring).
    builds_mask_inline = False

    def encoder_layers(self) -> list[nn.Module]:
        """The encoder layers every packed call runs through."""
        return list(self.encoder.layer)

    def pooled(self, first: torch.Tensor) -> torch.Tensor:
        """The pooler's output for the (batch, hidden) rows at position 0."""
        return self.pooler(first[:, None])

    def packed_forward(self, arguments: dict, extra: dict, packing: PackedSequences):
        """The model's own forward on the packed (1, total) inputs ``arguments``, its layers
        given the packing (see the module docstring): a ``ModelOutput``."""
        if self.builds_mask_inline:
            arguments["attention_mask"] = None
            extra[PACKING_ARGUMENT] = packing
        else:
            arguments["attention_mask"] = packing
        return super().forward(**arguments, **extra, return_dict=True)

    def forward(self, *args, **kwargs):
        bound = self._forward_signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        extra = dict(arguments.pop("kwargs", {}))
        if self.padded_reason(arguments, extra) is not None:
            return super().forward(*args, **kwargs)
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        mask = arguments["attention_mask"]
        packing = pack_padding_mask(mask)
        if packing.total == 0:  # no token at all: nothing to pack (the model's pooler needs a row)
            return super().forward(*args, **kwargs)
        if arguments.get("position_ids") is None:
            arguments["position_ids"] = self._padded_position_ids(arguments, packing)
        per_token = (packing.batch, packing.seq)
        for name, value in arguments.items():
            if name != "attention_mask" and isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == per_token:
                arguments[name] = unpad_tokens(value, packing)[None]
        outputs = self.packed_forward(arguments, extra, packing)
        packed = outputs.last_hidden_state[0]
        outputs["last_hidden_state"] = pad_tokens(packed, packing)
        if getattr(self, "pooler", None) is not None:
            # The pooler reads position 0; handing it those rows alone (not a view of the
            # padded output) keeps backward from holding the padded output's storage.
            outputs["pooler_output"] = self.pooled(_first_positions(packed, packing, mask[:, 0] != 0))
        if outputs.get("hidden_states") is not None:
            outputs["hidden_states"] = tuple(pad_tokens(h[0], packing) for h in outputs.hidden_states)
        return outputs if return_dict else outputs.to_tuple()

    def padded_reason(self, arguments: dict, extra: dict) -> str | None:
        """Why a call with these arguments runs the padded forward, or None."""
        mask = arguments.get("attention_mask")
        if not self.unpad:
            return "unpad is off"
        if torch.compiler.is_exporting():
            return "torch.export (the packed length depends on the mask's values)"
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return "no 2-d attention_mask"
        given = {**extra, **arguments}
        if getattr(self.config, "is_decoder", False) or any(given.get(name) is not None for name in _DECODER_ARGUMENTS):
            return "a decoder or encoder-decoder call, or a cache"
        if arguments.get("use_cache"):
            return "use_cache"
        # a keyword argument in transformers 5's BERT, a parameter of its own in older forwards (MPNet)
        if given.get("output_attentions", getattr(self.config, "output_attentions", False)):
            return "output_attentions"
        implementation = self.config._attn_implementation
        if self.builds_mask_inline and implementation not in _INLINE_MASK_IMPLEMENTATIONS:
            return f"the {implementation} attention implementation builds a mask for the packed row"
        for index, layer in enumerate(self.encoder_layers()):
            reason = layer._unfused_reason() if hasattr(layer, "_unfused_reason") else "it is not fused"
            if reason is not None:
                return f"encoder layer {index}: {reason}"
        return None

    def _padded_position_ids(self, arguments: dict, packing: PackedSequences) -> torch.Tensor:
        """The (batch, seq) position ids the padded forward computes."""
        embeddings = self.embeddings
        if hasattr(embeddings, "create_position_ids_from_input_ids"):  # RoBERTa: from the padding index
            if arguments.get("input_ids") is not None:
                return embeddings.create_position_ids_from_input_ids(arguments["input_ids"], embeddings.padding_idx)
            return embeddings.create_position_ids_from_inputs_embeds(arguments["inputs_embeds"], embeddings.padding_idx)
        return embeddings.position_ids[:, : packing.seq].expand(packing.batch, packing.seq)

    def _create_attention_masks(self, attention_mask, encoder_attention_mask, *args, **kwargs):
        if isinstance(attention_mask, PackedSequences):  # the layers take the packing as their mask
            return attention_mask, encoder_attention_mask
        return super()._create_attention_masks(attention_mask, encoder_attention_mask, *args, **kwargs)

    @classmethod
    def over(cls, model_class: type) -> type:
        unpadded = super().over(model_class)
        _share_output_capture(model_class, unpadded)
        return unpadded


def _share_output_capture(model_class: type, unpadded: type) -> None:
    """transformers finds which outputs a model can capture (``output_hidden_states``) in a
    registry keyed by the class's name; give ``Unpadded<Model>`` its original's entry."""
    registry = getattr(sys.modules.get("transformers.utils.output_capturing"), "_CAN_RECORD_REGISTRY", None)
    if registry is not None and str(model_class) in registry:
        dict.__setitem__(registry, str(unpadded), dict.__getitem__(registry, str(model_class)))
