"""The public attention functions: argument checks in one place, then the ops."""

import math
import numbers

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention.bias import CausalBias, CausalVariant

from slimformer.kernels.attention.ops import (
    last_dim_contiguous,
    run_attention,
    run_self_attention,
    run_varlen_attention,
    split_heads,
)
from slimformer.kernels.philox import new_dropout_seed

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
    batch_shape: tuple[int, ...],
    heads: int,
    seq_q: int,
    seq_k: int,
) -> None:
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask must be on q's device {device}, got {attn_mask.device}")
        target = (*batch_shape, heads, seq_q, seq_k)
        if attn_mask.dim() > len(target) or any(
            size not in (1, want) for size, want in zip(reversed(attn_mask.shape), reversed(target))
        ):
            raise ValueError(
                f"attn_mask must broadcast to (batch, heads, seq_q, seq_k) = {target}, "
                f"got shape {tuple(attn_mask.shape)}"
            )
        if attn_mask.requires_grad:
            raise ValueError("attn_mask must not require grad: slimformer.attention gives masks no gradient")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask must be on q's device {device}, got {key_padding_mask.device}")
        if key_padding_mask.shape != (*batch_shape, seq_k):
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_k) = {(*batch_shape, seq_k)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


def _check_dropout_p(dropout_p: float, seq_q: int, seq_k: int) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    # a (batch, head)'s Philox counters are 32-bit: one per 16 scores, in 16 x 16 blocks
    if dropout_p > 0.0 and -(-seq_q // 16) * -(-seq_k // 16) * 16 > 2**32:
        raise ValueError(
            f"dropout_p > 0 needs ceil(seq_q / 16) · ceil(seq_k / 16) · 16 <= 2**32, got seq_q={seq_q}, seq_k={seq_k}"
        )


def _check_deterministic(deterministic: bool) -> bool:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    return deterministic


def _checked_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``scale`` as a float, or 1 / sqrt(head_dim) for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    return float(scale)


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")


def _causal_bias_as_mask(
    bias: CausalBias, is_causal: bool, seq_q: int, seq_k: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) computing what SDPA computes for a ``CausalBias`` mask.

    Upper-left alignment (and lower-right with seq_q == seq_k) is the kernels' causal
    path; lower-right with seq_q != seq_k lets row i see keys j <= i + seq_k - seq_q,
    which goes in as a (seq_q, seq_k) bool mask (seq_q · seq_k bytes, read block by block).
    """
    if is_causal:
        raise ValueError("is_causal must be False when attn_mask is a CausalBias (the bias already is causal)")
    if (bias.seq_len_q, bias.seq_len_kv) != (seq_q, seq_k):
        raise ValueError(
            f"attn_mask CausalBias must be for (seq_q, seq_k) = {(seq_q, seq_k)}, "
            f"got {(bias.seq_len_q, bias.seq_len_kv)}"
        )
    if bias.variant == CausalVariant.UPPER_LEFT or seq_q == seq_k:
        return None, True
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(seq_k - seq_q), False


def _check_causal_without_mask(attn_mask, is_causal: bool) -> None:
    """SDPA's rule (its math reference raises on every device; the fused CPU and CUDA
    backends let 4-d calls through): is_causal=True takes no explicit attn_mask."""
    if is_causal and attn_mask is not None:
        raise RuntimeError(
            "Explicit attn_mask should not be set when is_causal=True (as in scaled_dot_product_attention): pass "
            "attn_mask=None, or the causal mask folded into attn_mask with is_causal=False; got attn_mask of shape "
            f"{tuple(attn_mask.shape)}"
        )


def _autocast_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as autocast casts an input: floating point to ``dtype``, except float64."""
    return x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x


def _autocast_and_check_dtypes(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as autocast casts SDPA's (masks keep their dtype); raises unless they are one
    supported dtype on one device."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (_autocast_cast(t, dtype) for t in (query, key, value))
    if query.dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"query must be float16, bfloat16, float32 or float64, got {query.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {tensor.device}")
    return query, key, value


def _as_batch_heads(x: torch.Tensor) -> torch.Tensor:
    """(..., heads, seq, d) -> (batch, heads, seq, d), the leading dims flattened (a view)."""
    return x.reshape(-1, *x.shape[-3:])


def _mask_as_batch_heads(mask: torch.Tensor | None, batch_shape: tuple[int, ...]) -> torch.Tensor | None:
    """An attn_mask broadcastable to (*batch_shape, heads, seq_q, seq_k), as a 4-d mask."""
    if mask is None or mask.dim() <= 3 or len(batch_shape) == 1:
        return mask
    mask = mask[(None,) * (len(batch_shape) + 3 - mask.dim())]
    # a view, unless the mask's own leading dims are broadcast only in part
    return mask.expand(*batch_shape, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    deterministic: bool = True,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention that never materialises the score matrix.

    Same contract and argument names as ``torch.nn.functional.scaled_dot_product_attention``,
    plus ``key_padding_mask``, which combines with ``attn_mask`` or ``is_causal``, and a
    learned ``relative_bias``.

    Args:
        query: (..., heads, seq_q, head_dim) with any number of leading (batch) dims,
            3-d (N, L, E) included; float16, bfloat16 or float32 run the fused kernels,
            float64 (``torch.autograd.gradcheck``) runs the PyTorch reference in float64.
        key, value: (..., kv_heads, seq_k, head_dim), query's leading dims, dtype and
            device. ``kv_heads`` equals ``heads``, or divides it when ``enable_gqa`` (query
            head h reads kv head h // (heads // kv_heads), as in SDPA); k and v are never
            repeated in memory. head_dim is at most 256. Any strides are read in place as
            long as the last dim is contiguous (head views of a fused projection need no copy).
        attn_mask: bool (True = may attend), an additive float mask broadcastable to
            (..., heads, seq_q, seq_k) and read through broadcast strides, never
            expanded, or a ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left``
            / ``causal_lower_right``), honoured as SDPA does. It gets no gradient. An
            additive value <= -2**15 (finfo.min, -1e9) masks its key like -inf.
        dropout_p: attention dropout probability in [0, 1), applied whenever it is > 0 (as
            in SDPA). The mask is drawn from torch's generator, so ``torch.manual_seed``
            reproduces it, and regenerated in backward rather than stored.
        is_causal: row i attends keys j <= i (top-left aligned, as in SDPA); attn_mask
            must then be None (SDPA's rule), ``key_padding_mask`` may be given.
        scale: score scale, default ``1 / sqrt(head_dim)``.
        enable_gqa: allow fewer kv heads than query heads.
        key_padding_mask: bool (..., seq_k) with query's leading dims, True = padding (as
            in ``nn.MultiheadAttention``).
        deterministic: the backward's dQ pass. True (default): a second kernel walks the
            key blocks of each query block, so gradients are bitwise reproducible (7 GEMMs
            per tile pair). False: the dK/dV kernel adds dQ with fp32 atomics (5 GEMMs, a
            transient fp32 dQ buffer); the order of the additions varies from run to run,
            so dQ's last bits may too (as flash-attn's ``deterministic=False``). The forward
            and the PyTorch reference path are deterministic either way.
        relative_bias: (heads, seq_q + seq_k - 1) float, added to the scores by the offset
            of key j from query i: score (i, j) gets ``relative_bias[h, j - i + seq_q - 1]``
            (MPNet's and T5's bucketed relative position biases, gathered per offset:
            ``relative_bias = table[bucket(offsets)].T``). The kernels read it along each
            tile's diagonals, so no (seq_q, seq_k) tensor exists in forward or backward;
            it gets a gradient (fp32 atomics on GPUs, so its last bits vary by run). Not
            with ``attn_mask`` (padding goes in ``key_padding_mask``).
        window: a sliding window: query i attends keys j with |j - i| <= window only
            (ModernBERT's local layers: ``config.local_attention // 2``), combined with the
            other masks. The kernels visit only the key blocks within the window of some
            query of a block, so the work grows with the window, not with seq_k. Any
            integer (numpy's too, not bool); a window of max(seq_q, seq_k) or more limits
            nothing (it is clamped to that, so even ``sys.maxsize`` is safe).

    Returns:
        (..., heads, seq_q, head_dim) in query's dtype (under autocast q, k and v are
        first cast to the autocast dtype, as for SDPA); for 4-d inputs stored as
        (batch, seq_q, heads, head_dim) so that merging the heads is a view. Rows with
        no allowed key are zero (as SDPA gives), and so is their gradient.

    NaN and inf (the same on the kernels and the reference path): a non-finite q_i,
    ``scale``, additive mask value (NaN masks nothing) or k_j / v_j of a key j that row i
    may attend reaches o_i, as in SDPA. A key that is padding (``key_padding_mask``) is
    never read, unlike in SDPA: a NaN in its k or v reaches no output and no gradient, and
    its own dk, dv are 0. A key excluded for row i by ``is_causal``, ``window`` or
    ``attn_mask`` (False, or <= -2**15) gets the score −inf for that row, so a NaN in its
    k never reaches o_i (SDPA's NaN + −inf would); a non-finite v_j there, and in backward
    any non-finite value of q, k, v or the upstream gradient, may still reach the rows and
    keys it shares a block with through 0 · NaN, and which those are depends on the path
    and the block config (key blocks outside every window / causal range of a block are
    never read). Zero, or mark as padding, keys whose values may be non-finite.

    Raises:
        TypeError: a non-tensor or nested input, dtypes other than
            float16/bfloat16/float32/float64 or not matching, a mask of the wrong dtype, a
            dropout_p or scale that is not a real number, a window that is not an integer
            (or is a bool).
        RuntimeError: an attn_mask tensor with is_causal=True, as SDPA raises (its fused
            CPU and CUDA backends accept 4-d calls; its math reference and the
            documentation refuse them).
        ValueError: wrong ranks or shapes (unlike SDPA, value must have key's shape: a
            value head_dim other than query's is not supported), kv heads that do not
            divide the query heads, head_dim outside [1, 256], dropout_p outside [0, 1),
            a mask that does not broadcast or requires grad, tensors on different
            devices, a CausalBias for other sequence lengths or with is_causal=True, a
            negative window.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_nested:
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got a nested tensor: pad the sequences and pass "
                "key_padding_mask, or pack them for slimformer.varlen_attention"
            )
        if tensor.dim() < 3:
            raise ValueError(
                f"{name} must be at least 3-d (..., heads, seq, head_dim), got shape {tuple(tensor.shape)}"
            )
    query, key, value = _autocast_and_check_dtypes(query, key, value)
    *batch_shape, heads, seq_q, head_dim = query.shape
    batch_shape = tuple(batch_shape)
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != query.dim() or tuple(tensor.shape[:-3]) != batch_shape:
            raise ValueError(
                f"{name} must have query's leading (batch) dims {batch_shape}, got shape {tuple(tensor.shape)}"
            )
        if tensor.shape[-1] != head_dim:
            raise ValueError(f"{name} must have query's head_dim {head_dim}, got shape {tuple(tensor.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    _check_head_dim(head_dim)
    kv_heads, seq_k = key.shape[-3], key.shape[-2]
    if enable_gqa:
        if heads % max(kv_heads, 1) != 0 or (kv_heads == 0) != (heads == 0):
            raise ValueError(
                f"key and value heads must divide query's {heads} heads when enable_gqa=True, got {kv_heads}"
            )
    elif kv_heads != heads:
        raise ValueError(
            f"key and value must have query's {heads} heads (pass enable_gqa=True for fewer), got {kv_heads}"
        )
    _check_dropout_p(dropout_p, seq_q, seq_k)
    scale = _checked_scale(scale, head_dim)
    if isinstance(attn_mask, CausalBias):
        attn_mask, is_causal = _causal_bias_as_mask(attn_mask, is_causal, seq_q, seq_k, query.device)
    _check_masks(attn_mask, key_padding_mask, query.device, batch_shape, heads, seq_q, seq_k)
    _check_causal_without_mask(attn_mask, is_causal)
    relative_bias = _checked_relative_bias(
        relative_bias, attn_mask, query, heads, max(seq_q + seq_k - 1, 0), "seq_q + seq_k - 1"
    )
    window = _checked_window(window, max(seq_q, seq_k))
    if query.dim() != 4:
        attn_mask = _mask_as_batch_heads(attn_mask, batch_shape)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.reshape(-1, seq_k)
        query, key, value = _as_batch_heads(query), _as_batch_heads(key), _as_batch_heads(value)
    query, key, value = last_dim_contiguous(query), last_dim_contiguous(key), last_dim_contiguous(value)
    seed = new_dropout_seed(query.device, query.detach(), "attention") if dropout_p > 0.0 else None
    out, _ = run_attention(
        query,
        key,
        value,
        attn_mask,
        key_padding_mask,
        seed,
        float(dropout_p),
        bool(is_causal),
        scale,
        _check_deterministic(deterministic),
        relative_bias,
        window,
    )
    return out.view(*batch_shape, heads, seq_q, head_dim)


def checked_int(name: str, value) -> int:
    """``value`` as a Python int: any integer (numpy's too), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _checked_window(window, longest: int) -> int | None:
    """``window`` checked (None, or an int >= 0) and clamped to ``longest``, the longest
    sequence: |j − i| < longest for every pair, so a larger window excludes nothing, and
    the clamped one keeps the kernels' int32 bounds (start + BLOCK + window) from overflowing."""
    if window is None:
        return None
    window = checked_int("window", window)
    if window < 0:
        raise ValueError(f"window must be >= 0 (keys with |j - i| <= window), got {window}")
    return min(window, longest)


def _checked_relative_bias(
    relative_bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    query: torch.Tensor,
    heads: int,
    length: int,
    length_name: str,
) -> torch.Tensor | None:
    """``relative_bias`` checked against its contract (``attention``'s docstring), contiguous."""
    if relative_bias is None:
        return None
    if not isinstance(relative_bias, torch.Tensor):
        raise TypeError(f"relative_bias must be a torch.Tensor or None, got {type(relative_bias).__name__}")
    if not relative_bias.is_floating_point():
        raise TypeError(f"relative_bias must be a float tensor, got {relative_bias.dtype}")
    if attn_mask is not None:
        raise ValueError("relative_bias cannot be combined with attn_mask; pass padding as key_padding_mask")
    if tuple(relative_bias.shape) != (heads, length):
        raise ValueError(
            f"relative_bias must have shape (heads, {length_name}) = {(heads, length)}, "
            f"got {tuple(relative_bias.shape)}"
        )
    if relative_bias.device != query.device:
        raise ValueError(f"relative_bias must be on query's device {query.device}, got {relative_bias.device}")
    return relative_bias.contiguous()


def self_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    recompute_qkv: bool = False,
    deterministic: bool = True,
) -> torch.Tensor:
    """Multi-head self-attention of ``x`` with a fused QKV projection, before the output projection.

    Computes ``attention(q, k, v)`` with q, k, v the heads of ``F.linear(x, qkv_weight,
    qkv_bias)`` and returns it as (batch, seq, embed), a view of the kernel's output.
    With ``recompute_qkv`` (the ``qkv`` recompute policy) backward recomputes the
    projection from ``x``, so only x, the output and the fp32 log-sum-exp (plus the
    dropout seed) stay alive; otherwise the projection (q, k, v) is kept.

    Args:
        x: (batch, seq, embed), float16, bfloat16 or float32 (the fused kernels), or
            float64 (the PyTorch reference in float64, on any device).
        qkv_weight: (3 · embed, embed), the q, k, v rows stacked as in
            ``nn.MultiheadAttention.in_proj_weight``; x's dtype and device.
        qkv_bias: (3 · embed,) or None.
        num_heads: divides embed; embed / num_heads is at most 256.
        attn_mask, dropout_p, is_causal, key_padding_mask, deterministic: as in ``attention``.

    Raises:
        TypeError: x not float16/bfloat16/float32/float64, weights of another dtype
            (outside autocast, or float64), a mask of the wrong dtype.
        ValueError: wrong shapes, num_heads not dividing embed, head_dim > 256,
            dropout_p outside [0, 1), masks that do not fit, tensors on other devices.
        RuntimeError: an attn_mask with is_causal=True (as ``attention``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-d (batch, seq, embed), got shape {tuple(x.shape)}")
    if x.dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    batch, seq, embed = x.shape
    weights = [("qkv_weight", qkv_weight, (3 * embed, embed))]
    if qkv_bias is not None:
        weights.append(("qkv_bias", qkv_bias, (3 * embed,)))
    # autocast casts no float64 tensor: with float64 on either side the dtypes must match
    autocast = torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64
    for name, tensor, shape in weights:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != x.dtype and (not autocast or tensor.dtype == torch.float64):
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {tensor.device}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1 or embed % num_heads != 0:
        raise ValueError(f"num_heads must divide embed {embed}, got {num_heads}")
    _check_head_dim(embed // num_heads)
    _check_dropout_p(dropout_p, seq, seq)
    _check_masks(attn_mask, key_padding_mask, x.device, (batch,), num_heads, seq, seq)
    _check_causal_without_mask(attn_mask, is_causal)
    if not recompute_qkv:
        q, k, v = split_heads(F.linear(x, qkv_weight, qkv_bias), num_heads)
        out = attention(
            q, k, v, attn_mask, dropout_p, is_causal, key_padding_mask=key_padding_mask, deterministic=deterministic
        )
        return rearrange(out, "b h s d -> b s (h d)")
    scale = 1.0 / math.sqrt(embed // num_heads)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    seed = new_dropout_seed(x.device, x.detach(), "self_attention") if dropout_p > 0.0 else None
    with torch.autocast(x.device.type, enabled=False):
        out, _ = run_self_attention(
            x,
            qkv_weight,
            qkv_bias,
            num_heads,
            attn_mask,
            key_padding_mask,
            seed,
            float(dropout_p),
            bool(is_causal),
            scale,
            dtype,
            _check_deterministic(deterministic),
        )
    return rearrange(out, "b h s d -> b s (h d)")


def _checked_max_seqlen(name: str, value) -> int:
    value = checked_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = True,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed variable-length sequences, like flash-attn's ``flash_attn_varlen_func``.

    Sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key/value rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; it attends only to its own keys. Equal to
    ``slimformer.attention`` run on each sequence alone.

    Args:
        query: (total_q, heads, head_dim), float16, bfloat16 or float32 (float64 runs the
            PyTorch reference, for gradcheck); strided, last dim contiguous.
        key, value: (total_k, kv_heads, head_dim), query's dtype and device; kv_heads
            divides heads (query head h reads kv head h // (heads // kv_heads)).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on query's device: 0, then the
            running total of the lengths, ending at total_q / total_k. Zero-length
            sequences are allowed (their rows are none; a query with no key gets o = 0).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (an upper bound
            is fine: the grid has that many blocks per sequence, the extra ones exit).
        dropout_p: attention dropout in [0, 1), applied whenever > 0; the mask is drawn
            from torch's generator and regenerated in backward. Sequence b draws what
            ``attention`` draws for batch entry b of a batch of such sequences, so a
            seed gives each sequence the mask it gets there.
        is_causal: query i attends keys j <= i of its sequence (top-left aligned, as in
            ``slimformer.attention`` and SDPA; flash-attn >= 2.1 aligns bottom-right
            when a sequence has fewer queries than keys).
        scale: score scale, default 1 / sqrt(head_dim).
        return_lse: also return the fp32 log-sum-exp, (heads, total_q), +inf for rows
            with no key.
        deterministic: the backward's dQ pass, as in ``attention``.
        relative_bias: (heads, max_seqlen_q + max_seqlen_k - 1) float, as in ``attention``:
            row i and key j of a sequence (counted from its start) get
            ``relative_bias[h, j - i + max_seqlen_q - 1]``.
        window: a sliding window within each sequence, as in ``attention`` (clamped to
            max(max_seqlen_q, max_seqlen_k)). NaN and inf as in ``attention``; another
            sequence's keys are never read.

    Returns:
        (total_q, heads, head_dim) in query's dtype, contiguous; with ``return_lse``,
        (out, lse).

    Raises:
        TypeError: non-tensors, dtypes other than float16/bfloat16/float32/float64 or
            not matching, cu_seqlens not int32, max_seqlen or window not an integer.
        ValueError: wrong ranks or shapes, kv heads not dividing heads, head_dim outside
            [1, 256], different devices, cu_seqlens of different lengths, not 1-d, not
            starting at 0, decreasing, not ending at the row count, a sequence longer than
            max_seqlen (on CUDA these value checks are device-side asserts: no host sync),
            a negative window, dropout_p outside [0, 1) or, with dropout, ceil(max_seqlen_q / 16) ·
            ceil(max_seqlen_k / 16) · 16 > 2**32 (a sequence's Philox counters are 32-bit).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-d (total_tokens, heads, head_dim), got shape {tuple(tensor.shape)}")
    query, key, value = _autocast_and_check_dtypes(query, key, value)
    _, heads, head_dim = query.shape
    if key.shape[-1] != head_dim:
        raise ValueError(f"key must have query's head_dim {head_dim}, got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    _check_head_dim(head_dim)
    kv_heads = key.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"key and value heads must divide query's {heads} heads, got {kv_heads}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"{name} must be 1-d (batch + 1,), got shape {tuple(cu.shape)}")
        if cu.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's {cu_seqlens_q.numel()} entries (one sequence each), "
            f"got {cu_seqlens_k.numel()}"
        )
    max_seqlen_q = _checked_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _checked_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_dropout_p(dropout_p, max_seqlen_q, max_seqlen_k)
    scale = _checked_scale(scale, head_dim)
    relative_bias = _checked_relative_bias(
        relative_bias,
        None,
        query,
        query.shape[1],
        max(max_seqlen_q + max_seqlen_k - 1, 0),
        "max_seqlen_q + max_seqlen_k - 1",
    )
    window = _checked_window(window, max(max_seqlen_q, max_seqlen_k))
    query, key, value = last_dim_contiguous(query), last_dim_contiguous(key), last_dim_contiguous(value)
    seed = new_dropout_seed(query.device, query.detach(), "varlen_attention") if dropout_p > 0.0 else None
    out, lse = run_varlen_attention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        seed,
        max_seqlen_q,
        max_seqlen_k,
        float(dropout_p),
        bool(is_causal),
        scale,
        _check_deterministic(deterministic),
        relative_bias,
        window,
    )
    return (out, lse) if return_lse else out
