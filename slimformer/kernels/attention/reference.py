"""The PyTorch references of the attention kernels: the readable statement of what they
compute, and the CPU path. They work in blocks of query rows as the kernels work in tiles
(no (batch, heads, seq_q, seq_k) tensor is ever alive), in fp32 (fp64 for fp64 inputs),
and draw the kernels' very dropout masks. Varlen runs the dense reference on each
sequence, as a batch of one whose dropout streams start at the sequence's.
"""

import math

import torch
from einops import rearrange

from slimformer.kernels.attention.launch import empty_forward, empty_output, reference_dtype
from slimformer.kernels.attention.tiles import MASKED_BIAS
from slimformer.kernels.dispatch import reference_row_blocks
from slimformer.kernels.philox import dropout_keep_mma_block, dropout_threshold


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, heads per kv head, ...)."""
    return rearrange(x, "b (k g) ... -> b k g ...", k=kv_heads)


def _reference_query_blocks(batch: int, heads: int, seq_q: int, seq_k: int) -> list[tuple[int, int]]:
    """(start, stop) of the reference's blocks of query rows, every head at once: the
    reference walks over them as the kernels walk over tiles, so no (batch, heads, seq_q,
    seq_k) score, probability, dropout-mask or dS tensor is ever alive."""
    return reference_row_blocks(seq_q, batch * heads * seq_k)


def _reference_grouped_rows(x: torch.Tensor, kv_heads: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a (batch, heads, seq, head_dim) tensor as one contiguous fp32 (fp64
    for fp64 inputs) (batch · kv_heads, heads per kv head · rows, head_dim) stack of matrices: the query
    heads sharing a kv head are stacked, so one bmm serves the whole group (GQA)."""
    block = _grouped(x[:, :, start:stop], kv_heads)
    rows = torch.empty(block.shape, dtype=reference_dtype(x), device=x.device).copy_(block)
    return rows.view(-1, rows.shape[2] * rows.shape[3], rows.shape[4])


def _no_allowed_key(best: torch.Tensor) -> torch.Tensor:
    """Rows with no allowed key, from their best masked score (a NaN row is not one: it propagates)."""
    return best == -math.inf


def _masked_block_scores(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    start: int,
    stop: int,
    heads: int,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    relative_bias: torch.Tensor | None = None,
    seq_q: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Scores (fp32, fp64 for fp64 inputs) of query rows start:stop against the keys ``k``, −inf where a key is
    not allowed: (batch · kv_heads, heads per kv head · rows, keys).

    ``q_rows`` and ``k`` are as ``_reference_grouped_rows`` gives them; ``k`` may hold only the
    first keys (a causal block leaves out the keys after its last row). ``relative_bias``
    (heads, seq_q + seq_k − 1) adds ``relative_bias[h, j − i + seq_q − 1]`` to score (i, j).
    """
    s = torch.bmm(q_rows, k.mT).mul_(scale)
    n_keys = k.shape[1]
    scores = s.view(-1, heads, stop - start, n_keys)  # (batch, heads, rows, keys)
    if relative_bias is not None:
        scores.add_(relative_bias.to(scores.dtype)[:, relative_positions(start, stop, n_keys, seq_q, s.device)])
    if attn_mask is not None:
        per_row = attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1
        mask = attn_mask[..., start:stop, :n_keys] if per_row else attn_mask[..., :n_keys]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, -math.inf)
        else:  # a NaN in the mask is not <= MASKED_BIAS: it propagates, as in SDPA
            scores.add_(mask.to(scores.dtype).masked_fill(mask <= MASKED_BIAS, -math.inf))
    if key_padding_mask is not None:
        scores.masked_fill_(key_padding_mask[:, None, None, :n_keys], -math.inf)
    if is_causal:
        rows = torch.arange(start, stop, device=s.device)[:, None]
        scores.masked_fill_(torch.arange(n_keys, device=s.device) > rows, -math.inf)
    if window is not None:  # a sliding window: keys with |j − i| <= window
        offsets = relative_positions(start, stop, n_keys, 1, s.device)
        scores.masked_fill_(offsets.abs() > window, -math.inf)
    return s


def relative_positions(start: int, stop: int, n_keys: int, seq_q: int, device) -> torch.Tensor:
    """(rows, n_keys) int64 indices j − i + seq_q − 1 of query rows start:stop and keys
    0:n_keys into a relative bias of length seq_q + seq_k − 1."""
    rows = torch.arange(start, stop, device=device)[:, None]
    return torch.arange(n_keys, device=device) - rows + (seq_q - 1)


def _without_padding(key_padding_mask: torch.Tensor | None, kv_heads: int, *keys: torch.Tensor) -> torch.Tensor | None:
    """Zeroes the padding keys' rows of the (batch · kv_heads, seq_k, head_dim) stacks
    ``keys`` in place, as the kernels never read them (a NaN or inf there reaches nothing);
    returns the (batch · kv_heads, seq_k, 1) padding mask, or None without one."""
    if key_padding_mask is None:
        return None
    padding = key_padding_mask.repeat_interleave(kv_heads, 0)[:, :, None]
    for x in keys:
        x.masked_fill_(padding, 0.0)
    return padding


def _dropout_keep_block(
    seed: torch.Tensor, first_stream: int, batch_heads: int, seq_k: int, start: int, stop: int, n_keys: int, p: float
) -> torch.Tensor:
    """The kernels' keep mask for query rows start:stop of every (batch, head) and keys
    0:n_keys, as a bool (batch · heads, rows, n_keys) tensor: streams first_stream + b·heads + h
    of ``philox.py``'s attention scheme, whose matrices have seq_k columns."""
    return dropout_keep_mma_block(seed, batch_heads, start, stop, n_keys, seq_k, p, first_stream)


def attention_forward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: torch.Tensor | None,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``forward.attention_forward`` computes, in fp32 PyTorch (fp64 for fp64 inputs), over
    blocks of query rows: (out in q's dtype and the kernel's layout, lse)."""
    if q.numel() == 0 or k.numel() == 0:
        return empty_forward(q)
    out = empty_output(q)
    lse = torch.empty(q.shape[:3], dtype=reference_dtype(q), device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # fp32 bmm even when called under autocast
        _attention_fwd_blocks(
            q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, out, lse, 0, relative_bias, window
        )
    return out, lse


def _attention_fwd_blocks(
    q,
    k,
    v,
    attn_mask,
    key_padding_mask,
    dropout_p,
    is_causal,
    scale,
    seed,
    out,
    lse,
    first_stream=0,
    relative_bias=None,
    window=None,
):
    """The body of ``attention_forward_reference``: writes out and lse block by block; the
    dropout streams of batch b start at first_stream + b · heads."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    k_all, v_all = _reference_grouped_rows(k, kv_heads, 0, seq_k), _reference_grouped_rows(v, kv_heads, 0, seq_k)
    _without_padding(key_padding_mask, kv_heads, k_all, v_all)
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _reference_grouped_rows(q, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows,
            k_all[:, :n_keys],
            start,
            stop,
            heads,
            attn_mask,
            key_padding_mask,
            is_causal,
            scale,
            relative_bias,
            seq_q,
            window,
        )
        best = p.amax(-1, keepdim=True)
        no_key = _no_allowed_key(best)
        p.sub_(best.masked_fill(no_key, 0.0)).exp_()
        total = p.sum(-1, keepdim=True)
        row_scale = total.reciprocal().masked_fill_(no_key, 0.0)
        if seed is not None:
            keep = _dropout_keep_block(seed, first_stream, batch * heads, seq_k, start, stop, n_keys, dropout_p)
            p.mul_(keep.reshape(p.shape))
            row_scale.mul_(dropout_threshold(dropout_p)[1])
        o = torch.bmm(p.mul_(row_scale), v_all[:, :n_keys])
        out[:, :, start:stop].copy_(o.view(batch, heads, stop - start, head_dim))
        block_lse = best.add_(total.log_()).masked_fill_(no_key, math.inf)
        lse[:, :, start:stop].copy_(block_lse.view(batch, heads, stop - start))


def attention_backward_reference(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    relative_bias: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """What ``backward.attention_backward`` computes, in fp32 PyTorch over blocks of query rows (dK and
    dV accumulate over the blocks), written into dq, dk, dv, and with ``relative_bias`` its
    gradient into ``dbias`` (zeroed, fp32 or fp64, shaped like it). ``out`` is not read: each
    block holds whole rows of P and dP, from which it takes delta. Always deterministic:
    ``deterministic`` only chooses the kernels' dQ pass."""
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    with torch.autocast(q.device.type, enabled=False):  # fp32 bmm even when called under autocast
        _attention_bwd_blocks(
            grad_out,
            q,
            k,
            v,
            lse,
            seed,
            attn_mask,
            key_padding_mask,
            dropout_p,
            is_causal,
            scale,
            dq,
            dk,
            dv,
            0,
            relative_bias,
            dbias,
            window,
        )


def _attention_bwd_blocks(
    grad_out,
    q,
    k,
    v,
    lse,
    seed,
    attn_mask,
    key_padding_mask,
    dropout_p,
    is_causal,
    scale,
    dq,
    dk,
    dv,
    first_stream=0,
    relative_bias=None,
    dbias=None,
    window=None,
):
    """The body of ``attention_backward_reference``: dq block by block, dk and dv (and the
    relative bias's gradient, dS summed over the batch along each diagonal) accumulated."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    k_all, v_all = _reference_grouped_rows(k, kv_heads, 0, seq_k), _reference_grouped_rows(v, kv_heads, 0, seq_k)
    padding = _without_padding(key_padding_mask, kv_heads, k_all, v_all)
    dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
    keep_scale = dropout_threshold(dropout_p)[1] if seed is not None else 1.0
    for start, stop in _reference_query_blocks(batch, heads, seq_q, seq_k):
        n_keys = min(seq_k, stop) if is_causal else seq_k
        q_rows = _reference_grouped_rows(q, kv_heads, start, stop)
        do_rows = _reference_grouped_rows(grad_out, kv_heads, start, stop)
        p = _masked_block_scores(
            q_rows,
            k_all[:, :n_keys],
            start,
            stop,
            heads,
            attn_mask,
            key_padding_mask,
            is_causal,
            scale,
            relative_bias,
            seq_q,
            window,
        )
        p.sub_(lse[:, :, start:stop].reshape(*q_rows.shape[:2], 1)).exp_()
        if seed is None:
            dv_all[:, :n_keys].baddbmm_(p.mT, do_rows)
            dp = torch.bmm(do_rows, v_all[:, :n_keys].mT)
        else:
            keep = _dropout_keep_block(seed, first_stream, batch * heads, seq_k, start, stop, n_keys, dropout_p)
            keep = keep.reshape(p.shape)
            dv_all[:, :n_keys].baddbmm_((p * keep).mT, do_rows, alpha=keep_scale)
            dp = torch.bmm(do_rows * keep_scale, v_all[:, :n_keys].mT).mul_(keep)
        # delta = Σ_j P_ij dP_ij, which equals the kernels' Σ_d dO_id O_id: a block holds
        # whole rows, and summing the row itself keeps each row of dS summing to ~0, as
        # torch's softmax backward does (no cancellation error from two different sums).
        delta = torch.linalg.vecdot(p, dp).unsqueeze(-1)
        ds = dp.sub_(delta).mul_(p)
        if dbias is not None:
            per_head = ds.view(batch, heads, (stop - start) * n_keys).sum(0)
            positions = relative_positions(start, stop, n_keys, seq_q, ds.device).flatten()
            dbias.index_add_(1, positions, per_head.to(dbias.dtype))
        dk_all[:, :n_keys].baddbmm_(ds.mT, q_rows)
        dq_rows = torch.bmm(ds, k_all[:, :n_keys]).mul_(scale)
        dq[:, :, start:stop].copy_(dq_rows.view(batch, heads, stop - start, head_dim))
    if padding is not None:  # nothing read a padding key: zero, even where a NaN row's p is NaN
        dk_all.masked_fill_(padding, 0.0)
        dv_all.masked_fill_(padding, 0.0)
    dk.copy_(dk_all.mul_(scale).view(batch, kv_heads, seq_k, head_dim))
    dv.copy_(dv_all.view(batch, kv_heads, seq_k, head_dim))


def sequences(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(b, q rows, k rows) of each varlen sequence with queries and keys, as slices (on the host)."""
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        if starts_q[b + 1] > starts_q[b] and starts_k[b + 1] > starts_k[b]:
            yield b, slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


def as_batch_of_one(x: torch.Tensor) -> torch.Tensor:
    """Packed (rows, heads, head_dim) -> a (1, heads, rows, head_dim) view."""
    return rearrange(x, "l h d -> 1 h l d")


def _sequence_bias(relative_bias: torch.Tensor | None, max_q: int, rows: slice, keys: slice) -> torch.Tensor | None:
    """The part of a varlen relative bias (heads, max_q + max_k − 1, centre max_q − 1) that
    a sequence of these rows and keys reads, as a dense one (centre at its rows − 1): a view."""
    if relative_bias is None:
        return None
    centre, seq_q, seq_k = max_q - 1, rows.stop - rows.start, keys.stop - keys.start
    return relative_bias[:, centre - (seq_q - 1) : centre + seq_k]


def varlen_forward_reference(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed, relative_bias=None, window=None
):
    """What ``forward.varlen_forward`` computes: the dense reference on each sequence, written
    into packed (total_q, heads, head_dim) out and (heads, total_q) lse; a row with no key
    gets o = 0 and lse = +inf. ``relative_bias`` (heads, max_q + max_k − 1) adds
    ``relative_bias[h, j − i + max_q − 1]`` to the score of a sequence's row i and key j."""
    heads = q.shape[1]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((heads, q.shape[0]), math.inf, dtype=reference_dtype(q), device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for b, rows, keys in sequences(cu_q, cu_k):
            _attention_fwd_blocks(
                as_batch_of_one(q[rows]),
                as_batch_of_one(k[keys]),
                as_batch_of_one(v[keys]),
                None,
                None,
                dropout_p,
                is_causal,
                scale,
                seed,
                as_batch_of_one(out[rows]),
                lse[None, :, rows],
                b * heads,
                _sequence_bias(relative_bias, max_q, rows, keys),
                window,
            )
    return out, lse


def varlen_backward_reference(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    seed,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    scale,
    deterministic,
    relative_bias=None,
    dbias=None,
    window=None,
):
    """What ``backward.varlen_backward`` computes, sequence by sequence: (dq, dk, dv), and
    with ``relative_bias`` its gradient added into ``dbias`` (zeroed, shaped like it)."""
    heads = q.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.autocast(q.device.type, enabled=False):
        for b, rows, keys in sequences(cu_q, cu_k):
            _attention_bwd_blocks(
                as_batch_of_one(grad_out[rows]),
                as_batch_of_one(q[rows]),
                as_batch_of_one(k[keys]),
                as_batch_of_one(v[keys]),
                lse[None, :, rows],
                seed,
                None,
                None,
                dropout_p,
                is_causal,
                scale,
                as_batch_of_one(dq[rows]),
                as_batch_of_one(dk[keys]),
                as_batch_of_one(dv[keys]),
                b * heads,
                _sequence_bias(relative_bias, max_q, rows, keys),
                _sequence_bias(dbias, max_q, rows, keys),
                window,
            )
    return dq, dk, dv
