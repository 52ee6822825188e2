"""Recompute policies: what a slimformer layer rebuilds in backward instead of keeping.

``sf.recompute(model, policy)`` (slimformer/recompute.py) sets one on every layer of a model.

| policy      | the layer recomputes in backward                         |
|-------------|----------------------------------------------------------|
| ``none``    | activations and dropout masks only (the fused kernels)   |
| ``qkv``     | + the QKV projection, from the layer input              |
| ``mlp``     | + fc1 and its activation, from the MLP input             |
| ``qkv+mlp`` | both                                                     |
| ``full``    | the whole layer but its last op (``torch.utils.checkpoint``, non-reentrant) |

``full`` keeps each layer's input and the statistics of its last norm (or nothing, for
a pre-LN layer's last residual add), which runs outside the checkpoint: it keeps its
output, the next layer's input, which the checkpoint keeps anyway. Under torch.compile a
checkpoint region ending in a multi-output op loses its saved boundary (the partitioner
would keep the first layer's input only and recompute every layer at the start of
backward); this way each layer is recomputed just before its backward, as in eager mode.

Dropout masks come from Philox seeds drawn from torch's generator, and checkpointing
restores the generator, so every policy gives the same gradients. Under ``torch.compile``
the ops are ``torch.library`` custom ops whose saved tensors the partitioner cannot
re-plan, so each policy keeps what it keeps in eager mode (``bench/compile_memory.py``).
"""

POLICIES = ("none", "qkv", "mlp", "qkv+mlp", "full")


def check_policy(policy: str) -> str:
    """``policy`` itself if it names a policy, else a ValueError listing them."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    return policy
