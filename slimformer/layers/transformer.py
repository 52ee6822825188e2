"""``torch.nn.TransformerEncoderLayer`` on the fused kernels, with a recompute policy.

The layer keeps torch's submodules (``self_attn``, ``linear1``, ``linear2``, ``norm1``,
``norm2``; same state_dict) and runs them through the fused ops:

    post-LN:  x = norm1(dropout(attn(x)) + x);   x = norm2(dropout(mlp(x)) + x)
    pre-LN:   y, h = norm2(dropout(attn(norm1(x))) + x);   x = dropout_add(mlp(y), h)

attention keeps q, k, v, its output and the log-sum-exp (never the score matrix), the
norms keep their output (memory-efficient mode), the MLP keeps fc1's output, and every
dropout mask is regenerated from a seed. The ``recompute`` policy
(``slimformer.layers.policies``) drops more: ``qkv`` recomputes the QKV projection, ``mlp``
fc1, ``full`` checkpoints the whole layer but its last op (see ``slimformer.layers.policies``).

Inputs are (batch, seq, d_model) with ``batch_first=True``; sequence-first inputs are
transposed to a batch-first copy on entry (one more activation kept for backward).

When a submodule that torch's forward calls (outside its inference fast path) has
forward or backward hooks, the layer runs torch's forward instead, so that they fire
with torch's arguments; ``self_attn`` and the norms still run their fused kernels then.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimformer.kernels.activation import fused_mlp
from slimformer.kernels.attention import self_attention
from slimformer.kernels.dropout import dropout_add
from slimformer.layers.attention import MultiheadAttention
from slimformer.layers.norm import LayerNorm
from slimformer.layers.policies import check_policy
from slimformer.layers.sharing import (
    NotScriptable,
    TorchLinear,
    TorchTransformerEncoderLayer,
    any_has_call_hooks,
    share_parameters,
)

_SUPPORTED_ACTIVATIONS = '"relu", "gelu", F.relu, F.gelu, torch.relu, nn.ReLU(), nn.GELU() or nn.GELU("tanh")'


def fused_activation_name(activation) -> str:
    """The fused MLP's name for a TransformerEncoderLayer ``activation`` argument."""
    if activation in ("relu", F.relu, torch.relu) or isinstance(activation, nn.ReLU):
        return "relu"
    if activation in ("gelu", F.gelu):
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    raise ValueError(f"activation must be one of {_SUPPORTED_ACTIVATIONS} to be fused, got {activation!r}")


class TransformerEncoderLayer(NotScriptable, TorchTransformerEncoderLayer):
    """Drop-in ``torch.nn.TransformerEncoderLayer``; extra keyword ``recompute`` (a policy).

    ``forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)`` takes
    torch's masks (bool True = not allowed, or additive float) and causal hint (as in
    ``slimformer.MultiheadAttention``). float64 layers run the PyTorch references in
    float64, on any device. With hooks on a submodule that torch's forward calls
    (``self_attn``, ``norm1``, ``norm2``, ``linear1``, ``linear2``, ``dropout``,
    ``dropout1``, ``dropout2``, a module ``activation``) the call runs torch's forward,
    where they fire; the recompute policy does not apply to it.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation="relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recompute: str = "none",
    ):
        fused_name = fused_activation_name(activation)
        super().__init__(
            d_model,
            nhead,
            dim_feedforward,
            dropout,
            activation,
            layer_norm_eps,
            batch_first,
            norm_first,
            bias,
            device,
            dtype,
        )
        self.fused_activation = fused_name
        # Keeps nn.TransformerEncoder off its inference fast path, which would hand this
        # layer nested tensors it does not take.
        self.activation_relu_or_gelu = 0
        self.self_attn = MultiheadAttention.from_torch(self.self_attn)
        self.norm1 = LayerNorm.from_torch(self.norm1)
        self.norm2 = LayerNorm.from_torch(self.norm2)
        self.recompute = check_policy(recompute)

    @classmethod
    def from_torch(cls, module: nn.TransformerEncoderLayer, *, recompute: str = "none"):
        """The slimformer layer for ``module``, sharing its Parameters (no copies).

        ``linear1``, ``linear2`` and the dropouts are ``module``'s own submodules;
        ``self_attn``, ``norm1`` and ``norm2`` become the slimformer modules over the same
        Parameters, so the ``state_dict`` keys and tensors are ``module``'s.

        Raises:
            TypeError: ``module`` is not a ``torch.nn.TransformerEncoderLayer``.
            ValueError: its activation has no fused kernel, ``recompute`` is not a policy,
                or ``linear1``/``linear2`` are not plain ``nn.Linear`` (quantized, say: the
                fused MLP reads their float weights).
        """
        layer = share_parameters(cls, module, TorchTransformerEncoderLayer, ("norm_first", "activation"))
        for name in ("linear1", "linear2"):
            if type(getattr(module, name)) is not TorchLinear:
                kind = type(getattr(module, name)).__name__
                raise ValueError(f"{name} must be a torch.nn.Linear for the fused MLP, got {kind}")
        layer.fused_activation = fused_activation_name(module.activation)
        layer.recompute = check_policy(recompute)
        layer.activation_relu_or_gelu = 0  # off torch's fast path, as in __init__
        layer.self_attn = MultiheadAttention.from_torch(module.self_attn)
        layer.norm1 = LayerNorm.from_torch(module.norm1)
        layer.norm2 = LayerNorm.from_torch(module.norm2)
        return layer

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        check_policy(self.recompute)
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
        d_model = self.self_attn.embed_dim
        if src.dim() not in (2, 3) or src.shape[-1] != d_model:
            raise ValueError(
                f"src must be (batch, seq, d_model) or (seq, batch, d_model) or (seq, d_model) with d_model = "
                f"{d_model}, got shape {tuple(src.shape)}"
            )
        if self._submodules_have_hooks():
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        batch_first = self.self_attn.batch_first
        x = src if batch_first or src.dim() == 2 else src.transpose(0, 1)
        batched = x.dim() == 3
        if not batched:
            x = x.unsqueeze(0)
            src_key_padding_mask = None if src_key_padding_mask is None else src_key_padding_mask.unsqueeze(0)
        attn_mask, padding, is_causal = self.self_attn.kernel_masks(src_mask, src_key_padding_mask, x, x, is_causal)
        if self.recompute == "full" and torch.is_grad_enabled():
            # The last op (norm2, or the pre-LN residual add) runs outside the checkpoint:
            # it keeps at most its output, the next layer's input that a checkpoint keeps
            # anyway, and under torch.compile a region ending in a multi-output op would
            # lose its saved boundary (the partitioner would recompute every layer at once).
            branch, residual = checkpoint(self._body, x, attn_mask, padding, is_causal, "none", use_reentrant=False)
        else:
            branch, residual = self._body(x, attn_mask, padding, is_causal, self.recompute)
        out = self._last_residual_add(branch, residual)
        if not batched:
            return out.squeeze(0)
        return out if batch_first else out.transpose(0, 1)

    def _submodules_have_hooks(self) -> bool:
        """Whether a module that torch's forward calls has hooks (the fused path calls none)."""
        return any_has_call_hooks(
            self.self_attn,
            self.norm1,
            self.norm2,
            self.linear1,
            self.linear2,
            self.dropout,
            self.dropout1,
            self.dropout2,
            self.activation,
        )

    # Each dropout's p is read from torch's module for it (dropout1 after the attention,
    # dropout inside the MLP, dropout2 after it): under torch.compile a p that dynamo made
    # dynamic must not be read both inside the checkpoint and after it.

    def _body(self, x, attn_mask, padding, is_causal, policy):
        """(the MLP's output, its residual): the layer up to its last residual add."""
        p = self.dropout1.p if self.training else 0.0
        if self.norm_first:
            attended = self._attention(self.norm1(x), attn_mask, padding, is_causal, policy)
            y, h = self.norm2(attended, x, dropout_p=p, return_residual=True)
            return self._mlp(y, policy), h
        x = self.norm1(self._attention(x, attn_mask, padding, is_causal, policy), x, dropout_p=p)
        return self._mlp(x, policy), x

    def _last_residual_add(self, branch, residual):
        p = self.dropout2.p if self.training else 0.0
        if self.norm_first:
            return dropout_add(branch, residual, p, self.training)
        return self.norm2(branch, residual, dropout_p=p)

    def _attention(self, x, attn_mask, padding, is_causal, policy):
        attn = self.self_attn
        out = self_attention(
            x,
            attn.in_proj_weight,
            attn.in_proj_bias,
            attn.num_heads,
            attn_mask,
            attn.dropout if self.training else 0.0,
            is_causal,
            padding,
            recompute_qkv="qkv" in policy,
            deterministic=attn.deterministic,
        )
        return F.linear(out, attn.out_proj.weight, attn.out_proj.bias)

    def _mlp(self, x, policy):
        return fused_mlp(
            x,
            self.linear1.weight,
            self.linear1.bias,
            self.linear2.weight,
            self.linear2.bias,
            self.fused_activation,
            self.dropout.p if self.training else 0.0,
            recompute_fc1="mlp" in policy,
        )

    def extra_repr(self) -> str:
        return f"activation={self.fused_activation!r}, norm_first={self.norm_first}, recompute={self.recompute!r}"
