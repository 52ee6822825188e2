"""slimformer's attention as a HuggingFace transformers (>= 5) attention implementation.

``register_transformers_attention`` adds "slimformer" to transformers'
``AttentionInterface`` (and the matching ``AttentionMaskInterface``), so that
``model.set_attn_implementation("slimformer")`` or ``attn_implementation="slimformer"``
runs a model's attention through ``slimformer.attention``; ``import slimformer`` calls it
as soon as transformers is imported. Calls that ask for the attention weights run it in
PyTorch, as transformers' eager attention does (``_attention_with_weights``).
"""

import torch
import torch.nn.functional as F

from slimformer.kernels.attention import attention
from slimformer.layers.sharing import has_user_hooks

__all__ = ["register_transformers_attention"]


# Arguments of transformers' attention functions that change the result and that the
# kernel does not implement (a sliding window arrives as a mask and is supported).
_UNSUPPORTED_HF_ARGUMENTS = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}


def _attention_with_weights(query, key, value, attention_mask, dropout, scaling, is_causal):
    """(output (batch, q_len, heads, d), probabilities (batch, heads, q_len, kv_len)), formed
    as transformers' eager attention forms them, for a call that asks for the weights.
    ``attention_mask``: None, (batch, kv_len) or a broadcastable 4-d mask, bool (True =
    attend) or additive."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None and attention_mask.dim() == 2:  # (batch, kv_len) padding, True = token
        attention_mask = attention_mask[:, None, None, :]
    elif attention_mask is not None:
        is_causal = False  # a built mask already holds the causal pattern
    if is_causal:  # aligned bottom-right, as transformers does when the lengths differ
        q_len, kv_len = scores.shape[-2:]
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = causal if attention_mask is None else attention_mask & causal
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register_transformers_attention(name: str = "slimformer") -> str:
    """Register ``slimformer.attention`` with HuggingFace transformers (>= 5) as ``name``.

    Adds an ``AttentionInterface`` function and the matching ``AttentionMaskInterface``
    function, so that ``model.set_attn_implementation(name)`` (or
    ``attn_implementation=name`` in ``from_pretrained``) runs the model's attention
    through the fused kernel. A padding mask over bidirectional or causal attention
    (BERT's, a decoder's without a cache) reaches the kernel as a (batch, kv_len) key
    padding mask, so no (q_len, kv_len) mask is built; any other pattern (cache offsets,
    sliding windows, packed sequences, custom mask functions) is built as transformers'
    boolean sdpa mask and read through its broadcast strides. Returns ``name``.

    A call with ``output_attentions`` (the model was asked for its attention weights, by the
    argument or its config), or
    on an attention module with hooks of a user (which may read them), runs the attention
    in PyTorch instead, as transformers' eager attention does, and returns the
    probabilities with it. The registered function raises NotImplementedError for a model
    that asks for logit soft-capping or attention sinks.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import AttentionInterface, AttentionMaskInterface, masking_utils

    plain_patterns = (masking_utils.bidirectional_mask_function, masking_utils.causal_mask_function)

    def mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=0,
        kv_offset=0,
        mask_function=masking_utils.causal_mask_function,
        attention_mask=None,
        **kwargs,
    ):
        if mask_function in plain_patterns and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
            return masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        kwargs["allow_is_causal_skip"] = False
        return masking_utils.sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
        )

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        unsupported = sorted(name for name in _UNSUPPORTED_HF_ARGUMENTS if kwargs.get(name) is not None)
        if unsupported:
            raise NotImplementedError(
                f"slimformer attention has no {', '.join(unsupported)} ({_UNSUPPORTED_HF_ARGUMENTS[unsupported[0]]}); "
                f"use another attn_implementation for {type(module).__name__}"
            )
        is_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        asked = kwargs.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False))
        if asked or has_user_hooks(module):  # someone reads the weights
            return _attention_with_weights(query, key, value, attention_mask, dropout, scaling, is_causal)
        key_padding_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask, key_padding_mask = None, ~attention_mask
        elif attention_mask is not None:
            is_causal = False  # a built mask already holds the causal pattern
        if is_causal and query.shape[2] != key.shape[2]:
            # transformers aligns causal masks bottom-right when the lengths differ.
            offset = key.shape[2] - query.shape[2]
            attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
            attention_mask, is_causal = attention_mask.tril(offset), False
        out = attention(
            query,
            key,
            value,
            attention_mask,
            dropout,
            is_causal,
            scaling,
            enable_gqa=query.shape[1] != key.shape[1],
            key_padding_mask=key_padding_mask,
        )
        return out.transpose(1, 2), None

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask)
    return name
