"""The attention ops: ``torch.library`` custom ops for the forward and the backward of
dense, self- and varlen attention, joined by ``register_autograd``, so that torch.compile
keeps exactly what each op saves and cannot re-plan it. The dropout seed is an input
(drawn by the caller). Each op runs the kernels (``forward``, ``backward``) or, on CPU
outside the interpreter and for fp64, the PyTorch references.
"""

import weakref

import torch
import torch.nn.functional as F
from einops import rearrange

from slimformer.kernels.attention.backward import attention_backward, varlen_backward
from slimformer.kernels.attention.forward import attention_forward, varlen_forward
from slimformer.kernels.attention.launch import empty_output, reference_dtype
from slimformer.kernels.attention.reference import (
    attention_backward_reference,
    attention_forward_reference,
    varlen_backward_reference,
    varlen_forward_reference,
)
from slimformer.kernels.dispatch import absent_output, direct, eager_autograd, use_triton


def runs_kernels(q: torch.Tensor) -> bool:
    # fp64 (gradcheck) always takes the PyTorch reference, in fp64.
    return use_triton(q) and q.dtype != torch.float64


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch, head and sequence strides (head views of a fused
    # projection need no copy) but load rows of head_dim contiguous elements.
    return x if x.stride(-1) == 1 else x.contiguous()


def split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, seq, 3 · embed) projection -> q, k, v (batch, heads, seq, head_dim) views."""
    return rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=num_heads).unbind(0)


def _attention_forward(
    q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, relative_bias=None, window=None
):
    fwd = attention_forward if runs_kernels(q) else attention_forward_reference
    return fwd(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, relative_bias, window)


def _attention_backward(grad_out, q, *args, **kwargs):
    """The kernels' or the reference's backward, with ``attention_backward``'s arguments."""
    bwd = attention_backward if runs_kernels(q) else attention_backward_reference
    bwd(grad_out, q, *args, **kwargs)


def _bias_gradient(relative_bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The zeroed buffer the backward adds a relative bias's gradient into (fp32, fp64 for
    fp64 inputs); an empty tensor without a bias (an op returns tensors only)."""
    if relative_bias is None:
        return q.new_empty(0, dtype=reference_dtype(q))
    return torch.zeros(relative_bias.shape, dtype=reference_dtype(q), device=q.device)


def _bias_grad_or_none(dbias: torch.Tensor, relative_bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if relative_bias is None else dbias.to(relative_bias.dtype)


def _fake_out_and_lse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_output(q), q.new_empty(q.shape[:3], dtype=reference_dtype(q))


@torch.library.custom_op("slimformer::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of (batch, heads, seq, head_dim) q, k, v with a contiguous last dim;
    ``deterministic`` is the backward's (see ``backward.attention_backward``);
    ``relative_bias`` (heads, seq_q + seq_k − 1), contiguous, adds
    ``relative_bias[h, j − i + seq_q − 1]`` to score (i, j); ``window``: keys with
    |j − i| <= window only (a sliding window), or None."""
    return _attention_forward(
        q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed, relative_bias, window
    )


@attention_op.register_fake
def _(
    q, k, v, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, deterministic, relative_bias=None,
    window=None,
):  # fmt: skip
    return _fake_out_and_lse(q)


@torch.library.custom_op("slimformer::attention_backward", mutates_args=())
def attention_backward_op(
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
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias): dq, dk, dv shaped and strided like q, k, v (``empty_like``);
    dbias the relative bias's gradient in fp32 (fp64 for fp64 inputs), empty without one."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = _bias_gradient(relative_bias, q)
    _attention_backward(
        last_dim_contiguous(grad_out),
        q,
        k,
        v,
        out,
        lse,
        seed,
        attn_mask,
        key_padding_mask,
        dropout_p,
        is_causal,
        scale,
        deterministic,
        dq,
        dk,
        dv,
        relative_bias=relative_bias,
        dbias=None if relative_bias is None else dbias,
        window=window,
    )
    return dq, dk, dv, dbias


@attention_backward_op.register_fake
def _(
    grad_out, q, k, v, out, lse, seed, attn_mask, key_padding_mask, dropout_p, is_causal, scale, deterministic,
    relative_bias=None, window=None,
):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _bias_gradient(relative_bias, q)


def _attention_setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and the dropout seed (plus the caller's masks and relative bias)."""
    q, k, v, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, deterministic, *extra = inputs
    relative_bias, window = (*extra, None, None)[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, attn_mask, key_padding_mask, relative_bias)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.deterministic = dropout_p, is_causal, scale, deterministic
    ctx.window = window


def _attention_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 12
    q, k, v, out, lse, seed, attn_mask, key_padding_mask, relative_bias = ctx.saved_tensors
    dq, dk, dv, dbias = direct(attention_backward_op)(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        seed,
        attn_mask,
        key_padding_mask,
        ctx.dropout_p,
        ctx.is_causal,
        ctx.scale,
        ctx.deterministic,
        relative_bias,
        ctx.window,
    )
    return dq, dk, dv, *(None,) * 7, _bias_grad_or_none(dbias, relative_bias), None


# what the public functions call (``eager_autograd``: the op, or in plain eager mode the same
# formula without torch's generated autograd wrapper)
run_attention = eager_autograd(attention_op, _attention_grad, _attention_setup_context)


@torch.library.custom_op("slimformer::self_attention_recompute_qkv", mutates_args=())
def self_attention_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dtype: torch.dtype,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): attention of q, k, v = split(x Wᵀ + b) with the projection in ``dtype``
    (autocast's, or x's); out is (batch, heads, seq, head_dim) stored as (batch, seq, heads,
    head_dim). Saves x, the weights, out, lse and the seed; the backward op recomputes the
    projection and writes dq, dk, dv straight into one (batch, seq, 3 · embed) gradient."""
    qkv = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    q, k, v = split_heads(qkv, num_heads)
    return _attention_forward(q, k, v, attn_mask, key_padding_mask, dropout_p, is_causal, scale, seed)


@self_attention_op.register_fake
def _(x, weight, bias, num_heads, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, dtype, deterministic):
    batch, seq, embed = x.shape
    q = x.new_empty((batch, num_heads, seq, embed // num_heads), dtype=dtype)
    return _fake_out_and_lse(q)


@torch.library.custom_op("slimformer::self_attention_recompute_qkv_backward", mutates_args=())
def self_attention_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    num_heads: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
    needs_input_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) for grad_out (batch, heads, seq, head_dim); each an empty
    placeholder where ``needs_input_grad`` says it is not needed."""
    # The forward's projection ran in out's dtype (autocast's, if it was on); redo it
    # in that dtype, since autocast is off in backward.
    dtype = out.dtype
    x_, weight_ = x.to(dtype), weight.to(dtype)
    qkv = F.linear(x_, weight_, None if bias is None else bias.to(dtype))
    q, k, v = split_heads(qkv, num_heads)
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = split_heads(dqkv, num_heads)
    _attention_backward(
        last_dim_contiguous(grad_out.to(dtype)),
        q,
        k,
        v,
        out,
        lse,
        seed,
        attn_mask,
        key_padding_mask,
        dropout_p,
        is_causal,
        scale,
        deterministic,
        dq,
        dk,
        dv,
    )
    needs_x, needs_weight, needs_bias = needs_input_grad
    dx = (dqkv @ weight_).to(x.dtype) if needs_x else absent_output(x.device)
    dweight = (dqkv.flatten(0, 1).mT @ x_.flatten(0, 1)).to(weight.dtype) if needs_weight else absent_output(x.device)
    dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None and needs_bias else absent_output(x.device)
    return dx, dweight, dbias


@self_attention_backward_op.register_fake
def _(
    grad_out,
    x,
    weight,
    bias,
    out,
    lse,
    seed,
    attn_mask,
    key_padding_mask,
    num_heads,
    dropout_p,
    is_causal,
    scale,
    deterministic,
    needs_input_grad,
):
    needs_x, needs_weight, needs_bias = needs_input_grad
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x else absent_output(x.device),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if needs_weight else absent_output(x.device),
        torch.empty_like(bias) if bias is not None and needs_bias else absent_output(x.device),
    )


def _self_attention_setup_context(ctx, inputs, output):
    x, weight, bias, num_heads, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale, _, deterministic = (
        inputs
    )
    out, lse = output
    ctx.save_for_backward(x, weight, bias, out, lse, seed, attn_mask, key_padding_mask)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.num_heads, ctx.dropout_p, ctx.is_causal, ctx.scale = num_heads, dropout_p, is_causal, scale
    ctx.deterministic = deterministic


def _self_attention_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 12
    x, weight, bias, out, lse, seed, attn_mask, key_padding_mask = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    dx, dweight, dbias = direct(self_attention_backward_op)(
        grad_out,
        x,
        weight,
        bias,
        out,
        lse,
        seed,
        attn_mask,
        key_padding_mask,
        ctx.num_heads,
        ctx.dropout_p,
        ctx.is_causal,
        ctx.scale,
        ctx.deterministic,
        needs,
    )
    grads = [grad if need else None for grad, need in zip((dx, dweight, dbias), needs)]
    return *grads, *(None,) * 9


run_self_attention = eager_autograd(self_attention_op, _self_attention_grad, _self_attention_setup_context)


# Varlen's ops: torch.compile traces a packed batch without reading cu_seqlens on the
# host: the token counts are the tensors' first dims, the longest sequences int
# arguments, and the cu_seqlens value checks run inside the op.


@torch.library.custom_op("slimformer::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seed: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool = True,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, heads, head_dim) contiguous, lse (heads, total_q)) of q, k, v with a
    contiguous last dim; ``deterministic`` is the backward's, as in ``attention_op``;
    ``relative_bias`` (heads, max_q + max_k − 1), contiguous, adds
    ``relative_bias[h, j − i + max_q − 1]`` to the score of a sequence's row i and key j."""
    check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], max_q, "query")
    check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], max_k, "key")
    fwd = varlen_forward if runs_kernels(q) else varlen_forward_reference
    return fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, seed, relative_bias, window)


@varlen_attention_op.register_fake
def _(
    q, k, v, cu_q, cu_k, seed, max_q, max_k, dropout_p, is_causal, scale, deterministic=True, relative_bias=None,
    window=None,
):  # fmt: skip
    total_q, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(heads, total_q, dtype=reference_dtype(q), device=q.device)


@torch.library.custom_op("slimformer::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    deterministic: bool,
    relative_bias: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias) as ``attention_backward_op`` gives them."""
    bwd = varlen_backward if runs_kernels(q) else varlen_backward_reference
    args = (seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, deterministic)
    dbias = _bias_gradient(relative_bias, q)
    grads = bwd(
        last_dim_contiguous(grad_out),
        q,
        k,
        v,
        out,
        lse,
        *args,
        relative_bias=relative_bias,
        dbias=None if relative_bias is None else dbias,
        window=window,
    )
    return *grads, dbias


@varlen_attention_backward_op.register_fake
def _(
    grad_out, q, k, v, out, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, deterministic,
    relative_bias=None, window=None,
):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _bias_gradient(relative_bias, q)


def _varlen_setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse, the dropout seed, both cu_seqlens and the relative bias."""
    q, k, v, cu_q, cu_k, seed, *args = inputs
    relative_bias, window = (*args[6:], None, None)[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, relative_bias)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.args, ctx.window = args[:6], window


def _varlen_grad(ctx, grad_out, _grad_lse):
    if grad_out is None:  # the output got no gradient
        return (None,) * 14
    q, k, v, out, lse, seed, cu_q, cu_k, relative_bias = ctx.saved_tensors
    dq, dk, dv, dbias = direct(varlen_attention_backward_op)(
        grad_out, q, k, v, out, lse, seed, cu_q, cu_k, *ctx.args, relative_bias, ctx.window
    )
    return dq, dk, dv, *(None,) * 9, _bias_grad_or_none(dbias, relative_bias), None


run_varlen_attention = eager_autograd(varlen_attention_op, _varlen_grad, _varlen_setup_context)


# id(cu_seqlens) -> (a weak reference to it, the (version, rows, longest sequence) it has
# passed ``check_cu_seqlens`` at): every layer of a packed batch passes the same one,
# checked once. (A WeakKeyDictionary would compare tensors with ==, elementwise.)
_CHECKED_CU_SEQLENS: dict[int, tuple[weakref.ref, set]] = {}


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, tensor_name: str) -> None:
    """Value checks of one cu_seqlens: exact errors on CPU; on GPU device-side asserts,
    so that no check costs a host sync. A tensor is checked once for given ``total`` and
    ``max_seqlen`` until it is written in place (its version counter; a write through
    ``.data`` goes unseen). An inference tensor, which keeps no version counter, is checked
    on every call."""
    if cu.is_inference():
        _check_cu_seqlens(name, cu, total, max_seqlen, tensor_name)
        return
    passed = (cu._version, total, max_seqlen)
    entry = _CHECKED_CU_SEQLENS.get(id(cu))
    if entry is not None and entry[0]() is cu and passed in entry[1]:
        return
    _check_cu_seqlens(name, cu, total, max_seqlen, tensor_name)
    if entry is None or entry[0]() is not cu:
        key = id(cu)
        entry = (weakref.ref(cu, lambda _, key=key: _CHECKED_CU_SEQLENS.pop(key, None)), set())
        _CHECKED_CU_SEQLENS[key] = entry
    entry[1].add(passed)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, tensor_name: str) -> None:
    if cu.is_cuda:
        lengths = cu.diff()
        torch._assert_async(cu[0] == 0, f"{name}[0] must be 0")
        torch._assert_async(cu[-1] == total, f"{name}[-1] must equal {tensor_name}'s {total} rows")
        torch._assert_async((lengths >= 0).all(), f"{name} must be non-decreasing")
        torch._assert_async((lengths <= max_seqlen).all(), f"{name}'s sequences must be at most {max_seqlen} long")
        return
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"{name} must be non-decreasing, got {values[index]} then {values[index + 1]} at index {index}"
            )
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal {tensor_name}'s number of rows {total}, got {values[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"max_seqlen for {name} must be at least its longest sequence {max(lengths)}, got {max_seqlen}"
        )
