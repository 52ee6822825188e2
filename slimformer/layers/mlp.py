"""The Transformer MLP block, fc2(dropout(act(fc1(x)))), on ``fused_mlp``.

Backward recomputes the activation from fc1's output instead of keeping it, and with
``recompute_fc1=True`` (the ``mlp`` recompute policy) recomputes fc1's output too, so
the block keeps nothing but its input.
"""

from torch import nn

from slimformer.kernels.activation import ACTIVATIONS, GATED, fused_mlp


class FusedMLP(nn.Module):
    """fc1 -> bias + activation -> dropout -> fc2, with ``fc1``/``fc2`` as ``nn.Linear``.

    For "swiglu" and "geglu", fc1 has 2 * dim_feedforward outputs: the gate rows, then the up rows.
    ``dropout`` is the probability after the activation (applied in training only).
    """

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        recompute_fc1: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        fc1_out = 2 * dim_feedforward if activation in GATED else dim_feedforward
        self.fc1 = nn.Linear(d_model, fc1_out, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(dim_feedforward, d_model, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.dropout = dropout
        self.recompute_fc1 = recompute_fc1

    def forward(self, x):
        return fused_mlp(
            x,
            self.fc1.weight,
            self.fc1.bias,
            self.fc2.weight,
            self.fc2.bias,
            self.activation,
            self.dropout if self.training else 0.0,
            self.recompute_fc1,
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}, recompute_fc1={self.recompute_fc1}"
