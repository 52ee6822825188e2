"""Fused scaled-dot-product attention (FlashAttention-2) with masks, dropout and GQA, on
padded (batch, heads, seq, head_dim) tensors or packed variable-length sequences.

For query row i and key j, with ``z`` the dropout keep mask and ``r = 1 / (1 - dropout_p)``:

    s_ij = scale · q_i·k_j + mask_ij   (−inf where key j is not allowed for row i)
    lse_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij − lse_i),   o_i = Σ_j r z_ij p_ij v_j

The forward walks over key blocks with an online softmax, so neither s nor p is ever
written to memory. It saves q, k, v, o, the fp32 ``lse`` and the dropout seed: with
``lse`` the backward rebuilds p block by block, and z comes back from the seed (Philox
stream b · heads + h, counter and byte from (i, j) in the MMA-layout scheme of
``philox.py``, so each thread draws the keep bits of the scores it holds). The backward
uses ``delta_i = Σ_d dO_id O_id = Σ_j dP_ij P_ij`` and

    dP = r z ∘ dO Vᵀ,   dS = P ∘ (dP − delta),   dV = (r z ∘ P)ᵀ dO,
    dK = scale · dSᵀ Q,   dQ = scale · dS K

in two passes without races: one program per key block accumulates dK and dV over
every query block of every query head sharing that key/value head (GQA), and one
program per query block accumulates dQ. With ``deterministic=False`` the first pass
also adds each tile's dS K into an fp32 dQ buffer with atomics (5 GEMMs per tile pair
instead of 7, in an order that varies from run to run).

A key is not allowed where a bool mask is False, the key is padding, it lies in the
causal future, or its additive mask value is at most ``MASKED_BIAS`` (−inf, finfo.min,
−1e9: a row masked only by such values would have an lse too large for fp32 to rebuild
p from, and SDPA would average v uniformly there). Which rows have no allowed key is
decided from the masks alone, never from the scores: a row of very negative scores
(``scale=2e4``) gives SDPA's answer. A row with no allowed key gets o = 0 and
lse = +inf; with lse = +inf every p_ij of that row is exp(−inf) = 0, so the backward
gives the row, and the keys it would have seen, zero gradient without a special case.
NaN and inf in q, ``scale``, an additive mask (a NaN value masks nothing) or the keys a
row may attend propagate as in SDPA; padding keys are never read (zeroed as they are
loaded, so a NaN there reaches nothing), and a key masked for a row only has its score
replaced by −inf (``attention``'s docstring says what that leaves to the block config).

The kernels read q, k, v through their strides (only head_dim must be contiguous), so
the heads of a fused QKV projection are used in place (on sm_90 the forward reads them
through TMA descriptors, which take the same strides), and write o as (batch, seq,
heads, head_dim), so that merging the heads for the output projection is a view and
that projection saves the very storage attention saved. ``self_attention`` adds the
``qkv`` recompute policy: its backward recomputes the projection from the layer input
and keeps only the input, o and lse.

Varlen (FlashAttention-2's varlen API) packs sequences of different lengths without
padding: q is (total_q, heads, head_dim), sequence b owning rows ``cu_seqlens_q[b] :
cu_seqlens_q[b + 1]``, and likewise k and v with ``cu_seqlens_k``; each sequence attends
only to its own keys. The same kernels run it (``VARLEN``: the grid's batch axis runs
over the sequences, with ``max_seqlen`` blocks each, and the programs past a sequence's
end exit), with the same dropout streams (b · heads + h for sequence b), so compute and
memory are proportional to the real tokens.

The package, in the order a reader follows a call:

- ``interface``: ``attention``, ``self_attention``, ``varlen_attention``: checks, then the ops;
- ``ops``: the ``torch.library`` custom ops, which run the kernels or the references;
- ``forward``, ``backward``: the kernels and their launchers;
- ``tiles``: the jit helpers the kernels share; ``launch``: what the launchers share;
- ``configs``: the block configs, one table per architecture;
- ``reference``: the PyTorch references (the CPU path);
- ``disentangled``: DeBERTa's disentangled attention (c2p and p2c position terms), its
  kernels, reference and ops in one file, on the shared tiles.
"""

from slimformer.kernels.attention.disentangled import disentangled_attention, varlen_disentangled_attention
from slimformer.kernels.attention.interface import MAX_HEAD_DIM, attention, self_attention, varlen_attention
from slimformer.kernels.attention.tiles import MASKED_BIAS

__all__ = [
    "MASKED_BIAS",
    "MAX_HEAD_DIM",
    "attention",
    "disentangled_attention",
    "self_attention",
    "varlen_attention",
    "varlen_disentangled_attention",
]
