"""Attention layers on the fused kernel: a drop-in ``nn.MultiheadAttention`` and a
self-attention block with a fused QKV projection.

Both keep, for backward, only q, k, v (one projection output), the attention output
and its fp32 log-sum-exp, never the (L, S) score or probability matrix. With
``recompute_qkv=True`` (the ``qkv`` recompute policy) self-attention recomputes q, k, v
from the layer input in backward, so it keeps only the output and the log-sum-exp.
The attention output is stored as (batch, seq, heads, head_dim), so the output
projection saves that same storage rather than a copy.
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from slimformer.kernels.attention import attention, self_attention
from slimformer.layers.sharing import NotScriptable, TorchMultiheadAttention, share_parameters


class MultiheadAttention(NotScriptable, TorchMultiheadAttention):
    """``torch.nn.MultiheadAttention`` on ``slimformer.attention``.

    Same constructor, parameters, ``state_dict`` and ``forward`` signature, plus the
    keyword-only ``recompute_qkv`` (used when query, key and value are the same tensor)
    and ``deterministic`` (the backward's dQ pass, see ``slimformer.attention``).

    With ``need_weights=False`` the attention runs in the fused kernel. With
    ``need_weights=True`` (torch's default) the call goes to torch's own implementation,
    which returns the averaged (or per-head) weights but materialises them: correct,
    not memory-efficient. Layers built with ``add_bias_kv`` or ``add_zero_attn`` also
    use torch's implementation.

    Masks follow torch: ``key_padding_mask`` (N, S) and ``attn_mask`` (L, S) or
    (N · num_heads, L, S), bool with True = not allowed, or float added to the scores.
    ``is_causal=True`` is torch's hint that ``attn_mask`` is the causal mask: as torch
    does, the kernel then applies the causal mask without reading ``attn_mask``, unless a
    ``key_padding_mask`` is given too, when ``attn_mask`` is applied as given. Unlike
    torch, the hint may come without ``attn_mask`` (with ``need_weights=False``).
    float64 layers run the PyTorch reference in float64, on any device.
    """

    _copied_attributes = (
        "embed_dim",
        "kdim",
        "vdim",
        "_qkv_same_embed_dim",
        "num_heads",
        "dropout",
        "batch_first",
        "head_dim",
        "bias_k",
        "bias_v",
        "add_zero_attn",
    )

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
        *,
        recompute_qkv: bool = False,
        deterministic: bool = True,
    ):
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.recompute_qkv = recompute_qkv
        self.deterministic = deterministic

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, recompute_qkv: bool = False, deterministic: bool = True):
        """The slimformer layer for ``module``, sharing its Parameters (no copies)."""
        layer = share_parameters(cls, module, TorchMultiheadAttention, cls._copied_attributes)
        layer.recompute_qkv = recompute_qkv
        layer.deterministic = deterministic
        return layer

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if need_weights or self.bias_k is not None or self.add_zero_attn:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        self._check_shapes(query, key, value)
        self_attending = query is key and key is value
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        attn_mask, key_padding_mask, is_causal = self.kernel_masks(attn_mask, key_padding_mask, query, key, is_causal)
        dropout_p = self.dropout if self.training else 0.0
        if self_attending and self._qkv_same_embed_dim:
            out = self_attention(
                query,
                self.in_proj_weight,
                self.in_proj_bias,
                self.num_heads,
                attn_mask,
                dropout_p,
                is_causal,
                key_padding_mask,
                recompute_qkv=self.recompute_qkv,
                deterministic=self.deterministic,
            )
        else:
            q, k, v = (
                rearrange(F.linear(x, w, b), "n l (h d) -> n h l d", h=self.num_heads)
                for x, w, b in zip((query, key, value), self._projection_weights(), self._projection_biases())
            )
            out = rearrange(
                attention(
                    q,
                    k,
                    v,
                    attn_mask,
                    dropout_p,
                    is_causal,
                    key_padding_mask=key_padding_mask,
                    deterministic=self.deterministic,
                ),
                "n h l d -> n l (h d)",
            )
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not batched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _check_shapes(self, query, key, value) -> None:
        """torch's shape checks of the fused path's inputs, as ValueErrors naming the argument."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be 3-d (batched) or all 2-d (unbatched), got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        widths = (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim))
        for name, tensor, features in widths:
            if tensor.shape[-1] != features:
                raise ValueError(
                    f"{name} must have {features} features in its last dim, got shape {tuple(tensor.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                "key and value must have the same batch and sequence sizes, got "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        batch_dim = 0 if self.batch_first or query.dim() == 2 else 1
        if query.dim() == 3 and query.shape[batch_dim] != key.shape[batch_dim]:
            raise ValueError(f"key must have query's batch size {query.shape[batch_dim]}, got shape {tuple(key.shape)}")

    def _projection_weights(self):
        if self._qkv_same_embed_dim:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def _projection_biases(self):
        return (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)

    def kernel_masks(self, attn_mask, key_padding_mask, query, key, is_causal):
        """(attn_mask, key_padding_mask, is_causal) for ``slimformer.attention`` from torch's
        masks (True = not allowed) and causal hint, for batch-first (N, L, E) ``query`` and
        ``key``: a mask with True = may attend, or additive (N, H, L, S)-broadcastable
        float; a bool padding mask; whether the kernel applies the causal mask."""
        batch, seq_q, seq_k = query.shape[0], query.shape[1], key.shape[1]
        if is_causal and attn_mask is not None and key_padding_mask is not None:
            is_causal = False  # torch merges the hinted mask with the padding and applies both as given
        if is_causal:
            attn_mask = None
            if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
                # an additive padding mask reaches the kernel as attn_mask, which is_causal excludes
                causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device).tril()
                attn_mask, is_causal = causal, False
        elif attn_mask is not None:
            if attn_mask.dim() == 3:
                if attn_mask.shape != (batch * self.num_heads, seq_q, seq_k):
                    raise ValueError(
                        f"attn_mask must have shape (N * num_heads, L, S) = "
                        f"{(batch * self.num_heads, seq_q, seq_k)} or (L, S), got {tuple(attn_mask.shape)}"
                    )
                attn_mask = attn_mask.view(batch, self.num_heads, seq_q, seq_k)
            if attn_mask.dtype == torch.bool:
                attn_mask = ~attn_mask
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            if not key_padding_mask.dtype.is_floating_point:
                raise TypeError(f"key_padding_mask must be bool or floating point, got {key_padding_mask.dtype}")
            padding = key_padding_mask[:, None, None, :]
            if attn_mask is None:
                attn_mask = padding
            elif attn_mask.dtype == torch.bool:
                attn_mask = torch.where(attn_mask, padding, float("-inf"))
            else:
                attn_mask = attn_mask + padding
            key_padding_mask = None
        return attn_mask, key_padding_mask, is_causal

    def extra_repr(self) -> str:
        return f"recompute_qkv={self.recompute_qkv}, deterministic={self.deterministic}"


class SelfAttention(NotScriptable, nn.Module):
    """Multi-head self-attention with a fused QKV projection, inputs (batch, seq, embed).

    ``qkv_proj`` maps embed -> 3 · embed (q, k, v rows stacked), ``out_proj`` embed ->
    embed. ``dropout`` is the attention dropout, applied in training only. With
    ``recompute_qkv`` backward recomputes q, k, v from the input: the block then keeps
    only its attention output and the fp32 log-sum-exp (plus a dropout seed).
    ``deterministic=False`` takes the backward's one-pass dQ with atomics (see
    ``slimformer.attention``).

    ``forward(x, key_padding_mask=None, attn_mask=None, is_causal=False)`` takes masks
    as ``slimformer.attention`` does: ``key_padding_mask`` (batch, seq) with True =
    padding, ``attn_mask`` bool with True = may attend, or an additive float mask.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        recompute_qkv: bool = False,
        device=None,
        dtype=None,
        *,
        deterministic: bool = True,
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"num_heads must divide embed_dim {embed_dim}, got {num_heads}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.recompute_qkv, self.deterministic = recompute_qkv, deterministic
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal: bool = False):
        out = self_attention(
            x,
            self.qkv_proj.weight,
            self.qkv_proj.bias,
            self.num_heads,
            attn_mask,
            self.dropout if self.training else 0.0,
            is_causal,
            key_padding_mask,
            recompute_qkv=self.recompute_qkv,
            deterministic=self.deterministic,
        )
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"recompute_qkv={self.recompute_qkv}, deterministic={self.deterministic}"
        )


def __getattr__(name: str):
    # register_transformers_attention lived here before the HuggingFace integrations moved to
    # slimformer.integrations.hf; imported when asked for, since layers never import integrations.
    if name == "register_transformers_attention":
        from slimformer.integrations.hf.attention import register_transformers_attention

        return register_transformers_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
