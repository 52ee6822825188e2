"""What each recompute policy costs in compute: extra forward FLOPs per token, estimated
from a layer's Linear shapes (2 × in × out per token each) and its attention
(2 × 2 × keys × width per token: q·kᵀ and p·v; keys = seq, or the sliding window's
2w + 1 where it is narrower). Norms, activations and dropout are left out (under 2% of
a BERT layer's FLOPs).

What each policy recomputes in backward (``slimformer.layers.policies``):

| policy    | patched HF layers                     | ``sf.TransformerEncoderLayer`` |
|-----------|---------------------------------------|--------------------------------|
| ``qkv``   | the q, k, v projections and attention | the q, k, v projections        |
| ``mlp``   | fc1                                   | fc1                            |
| ``full``  | the whole forward                     | the whole forward              |
"""

from torch import nn

__all__ = ["LayerFlops", "layer_flops", "step_flops_per_token"]


class LayerFlops:
    """Forward FLOPs per token of one layer's parts, and the extra of each policy."""

    def __init__(
        self, qkv: float, attention: float, out: float, fc1: float, fc2: float, qkv_recomputes_attention: bool
    ):
        self.qkv, self.attention, self.out, self.fc1, self.fc2 = qkv, attention, out, fc1, fc2
        self.qkv_recomputes_attention = qkv_recomputes_attention

    @property
    def forward(self) -> float:
        return self.qkv + self.attention + self.out + self.fc1 + self.fc2

    def extra(self, policy: str) -> float:
        """Extra forward FLOPs per token that ``policy`` spends in backward."""
        qkv = self.qkv + (self.attention if self.qkv_recomputes_attention else 0.0)
        return {"none": 0.0, "qkv": qkv, "mlp": self.fc1, "qkv+mlp": qkv + self.fc1, "full": self.forward}[policy]


def _linear(module: nn.Module | None) -> float:
    weight = getattr(module, "weight", None)
    return 0.0 if weight is None else 2.0 * weight.shape[0] * weight.shape[1]


def _attention(keys: int, width: int) -> float:
    return 4.0 * keys * width


def layer_flops(layer: nn.Module, seq: int) -> LayerFlops:
    """``LayerFlops`` of a planned layer at sequence length ``seq``; ValueError for a layer
    whose parts are not known."""
    from slimformer.layers.transformer import TransformerEncoderLayer

    layout = getattr(layer, "layout", None)
    if layout is not None:  # a patched BERT-family layer (slimformer.integrations.hf.bert)
        part = layer.get_submodule
        q = part(layout.qkv[0])
        return LayerFlops(
            sum(_linear(part(path)) for path in layout.qkv),
            _attention(seq, q.weight.shape[0]),
            _linear(part(layout.out_proj)),
            _linear(part(layout.fc1)),
            _linear(part(layout.fc2)),
            True,
        )
    if hasattr(layer, "attn") and hasattr(layer.attn, "Wqkv"):  # patched ModernBERT
        attn, mlp = layer.attn, layer.mlp
        window = attn.config.sliding_window if attn.sliding_window is not None else None
        keys = seq if window is None else min(seq, 2 * window + 1)
        return LayerFlops(
            _linear(attn.Wqkv),
            _attention(keys, attn.Wo.weight.shape[1]),
            _linear(attn.Wo),
            _linear(mlp.Wi),
            _linear(mlp.Wo),
            True,
        )
    if isinstance(layer, TransformerEncoderLayer):
        attn = layer.self_attn
        return LayerFlops(
            2.0 * attn.in_proj_weight.shape[0] * attn.in_proj_weight.shape[1],
            _attention(seq, attn.embed_dim),
            _linear(attn.out_proj),
            _linear(layer.linear1),
            _linear(layer.linear2),
            False,
        )
    raise ValueError(f"no FLOP model for {type(layer).__name__}")


def step_flops_per_token(model: nn.Module, layers: list[nn.Module], applications: list[LayerFlops]) -> float:
    """A training step's FLOPs per token: 3 × the forward's (backward costs twice the
    forward), the forward being every Linear outside ``layers`` once and each layer
    application in ``applications``."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    others = sum(_linear(m) for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside)
    return 3.0 * (others + sum(flops.forward for flops in applications))
