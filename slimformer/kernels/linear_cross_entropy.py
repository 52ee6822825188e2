"""A linear layer fused with cross-entropy over vocabulary chunks: the loss of
``F.cross_entropy(x Wᵀ + b, labels)`` without ever forming the (rows, vocab) logits.

For row i with label y and logits z = x_i Wᵀ + b over a vocabulary of V tokens and
label smoothing ε:

    lse_i  = log Σ_j exp(z_j)                       (online, chunk after chunk)
    loss_i = lse_i - (1 - ε) z_y - ε · mean_j z_j   (0 for rows labelled ignore_index)
    dz_j   = g_i · (exp(z_j - lse_i) - (1 - ε)·[j = y] - ε / V)

The vocabulary is walked in chunks of C tokens, C chosen so that one chunk of logits
(rows × C, fp32 statistics) stays under a fixed budget whatever V is. Per chunk the
logits come from one matmul (cuBLAS or PyTorch's CPU GEMM) written into one buffer
whose rows start 16-element aligned (so a last, narrower chunk still gets vector
loads); the Triton kernels do the memory-bound part in place on that chunk: the
forward kernel (a program per row) folds it into each row's running max, Σexp, Σz
(with label smoothing only) and z_y (one load from the chunk holding the label); the
backward kernel (a program per row and 1024 columns) turns it into dz, which two more
matmuls send to dx (accumulated in fp32 over the chunks), dW and db (written chunk by
chunk). Saved for backward: x, W, b, the labels and lse (one fp32 per row); backward
recomputes each chunk's logits (one extra matmul, a third of the backward's FLOPs)
instead of keeping rows × V of them.
"""

import torch
import triton
import triton.language as tl

from slimformer.kernels.dispatch import (
    FLOAT_DTYPES,
    absent_output,
    cdiv,
    direct,
    eager_autograd,
    next_power_of_2,
    use_triton,
)

# One chunk of logits holds at most this many elements (16 MiB in fp32).
_CHUNK_ELEMENTS = 1 << 22
_REDUCTIONS = ("mean", "sum", "none")
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _chunk_statistics_kernel(
    LOGITS,  # (rows, chunk) logits of vocabulary entries [v_start, v_start + chunk), rows stride_row apart
    LABELS,  # (rows,) int64 target per row
    ROW_MAX,  # (rows,) fp32 running max, updated in place
    ROW_SUMEXP,  # (rows,) fp32 running Σ exp(z - max), updated in place
    ROW_SUM,  # (rows,) fp32 running Σ z, updated in place when SUM_LOGITS
    ROW_TARGET,  # (rows,) fp32 z_label, written by the chunk holding the label
    stride_row,
    chunk,
    chunk_padded,  # chunk rounded up to 16: the buffer holds (unused) columns up to there
    v_start,
    SUM_LOGITS: tl.constexpr,  # Σz is needed only with label smoothing
    RAGGED: tl.constexpr,  # chunk != chunk_padded
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_row
    running_max = tl.load(ROW_MAX + row)
    running_sumexp = tl.load(ROW_SUMEXP + row)
    if SUM_LOGITS:
        running_sum = tl.load(ROW_SUM + row)
    for start in range(0, chunk_padded, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        # Loads up to chunk_padded (a multiple of 16) stay 16-byte vectors; columns past the
        # chunk become -inf, whose exp is 0 (the max is finite once one logit is).
        z = tl.load(logits + cols, mask=cols < chunk_padded, other=-float("inf")).to(tl.float32)
        if RAGGED:
            z = tl.where(cols < chunk, z, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        # exp(-inf - -inf) is NaN: an all -inf prefix contributes nothing.
        rescale = tl.where(running_max == new_max, 1.0, tl.exp2((running_max - new_max) * _LOG2E))
        running_sumexp = running_sumexp * rescale + tl.sum(tl.exp2(z * _LOG2E - new_max * _LOG2E), axis=0)
        running_max = new_max
        if SUM_LOGITS:
            running_sum += tl.sum(tl.where(cols < chunk, z, 0.0), axis=0)
    tl.store(ROW_MAX + row, running_max)
    tl.store(ROW_SUMEXP + row, running_sumexp)
    if SUM_LOGITS:
        tl.store(ROW_SUM + row, running_sum)
    local = tl.load(LABELS + row) - v_start
    if (local >= 0) & (local < chunk):  # one load, not a search of every block
        tl.store(ROW_TARGET + row, tl.load(logits + local).to(tl.float32))


@triton.jit
def _chunk_logits_grad_kernel(
    LOGITS,  # (rows, chunk) logits in, dz out (in place), rows stride_row apart
    LABELS,  # (rows,) int64 target per row
    LSE,  # (rows,) fp32 log-sum-exp over the whole vocabulary
    ROW_GRAD,  # (rows,) fp32 g_i: d loss / d loss_i, 0 for ignored rows
    stride_row,
    chunk_padded,  # chunk rounded up to 16: the buffer's columns past the chunk are scratch
    v_start,
    target_weight,  # 1 - ε
    uniform_weight,  # ε / V
    BLOCK_V: tl.constexpr,
):
    """One program per (row, BLOCK_V columns): elementwise, no loop. It also writes the
    scratch columns up to chunk_padded, so that loads and stores stay 16-byte vectors."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < chunk_padded
    logits = LOGITS + row * stride_row + cols
    label = tl.load(LABELS + row)
    lse_log2 = tl.load(LSE + row) * _LOG2E
    g = tl.load(ROW_GRAD + row)
    z = tl.load(logits, mask=mask, other=0.0).to(tl.float32)
    dz = tl.exp2(z * _LOG2E - lse_log2) - uniform_weight - tl.where(cols == label - v_start, target_weight, 0.0)
    tl.store(logits, (g * dz).to(LOGITS.dtype.element_ty), mask=mask)


def _block_v(chunk: int, largest: int) -> int:
    return min(largest, next_power_of_2(max(chunk, 16)))


def _chunk_width(rows: int, vocab: int) -> int:
    """Vocabulary entries per chunk: rows × width ≤ _CHUNK_ELEMENTS, a multiple of 128."""
    width = max(128, (_CHUNK_ELEMENTS // max(rows, 1)) // 128 * 128)
    return min(vocab, width)


def _padded(width: int) -> int:
    return cdiv(width, 16) * 16


def _chunk_buffer(x, width: int) -> torch.Tensor:
    """(rows, width rounded up to 16) buffer that every chunk's logits are written into:
    each row starts 16-element aligned and has columns up to a multiple of 16 even in a
    last, narrower chunk, so the kernels move whole 16-byte vectors there too (an odd
    row stride or column count would make them scalar). Zeroed, not empty: the columns
    past a chunk must hold finite values, as torch's CPU bf16 GEMM (2.13, one thread)
    reads a row-strided operand's padding and lets a NaN or inf there into the product."""
    return torch.zeros(x.shape[0], _padded(width), dtype=x.dtype, device=x.device)


def _chunk_logits(x, weight, bias, start, stop, buffer):
    """(rows, stop - start) logits of one vocabulary chunk, in x's dtype, in ``buffer``."""
    out = buffer[:, : stop - start]
    if torch.compiler.is_compiling():  # Dynamo traces no out= into a strided view: copied in
        w = weight[start:stop].T
        return out.copy_(x @ w if bias is None else torch.addmm(bias[start:stop], x, w))
    if bias is None:
        return torch.mm(x, weight[start:stop].T, out=out)
    return torch.addmm(bias[start:stop], x, weight[start:stop].T, out=out)


def _chunk_statistics(logits, labels, stats, start, sum_logits: bool, triton_kernel: bool) -> None:
    """Fold one chunk of logits into stats = (max, Σexp, Σz (if ``sum_logits``), z_label), in place."""
    row_max, row_sumexp, row_sum, row_target = stats
    if triton_kernel:
        chunk, padded = logits.shape[1], _padded(logits.shape[1])
        _chunk_statistics_kernel[(logits.shape[0],)](
            logits,
            labels,
            row_max,
            row_sumexp,
            row_sum,
            row_target,
            logits.stride(0),
            chunk,
            padded,
            start,
            SUM_LOGITS=sum_logits,
            RAGGED=padded != chunk,
            BLOCK_V=_block_v(chunk, 4096),
        )
        return
    _chunk_statistics_reference(logits, labels, stats, start, sum_logits)


def _chunk_statistics_reference(logits, labels, stats, start, sum_logits: bool) -> None:
    """What ``_chunk_statistics_kernel`` computes, with PyTorch ops on the chunk."""
    row_max, row_sumexp, row_sum, row_target = stats
    z = logits.float()
    new_max = torch.maximum(row_max, z.amax(dim=1))
    rescale = torch.where(row_max == new_max, 1.0, torch.exp(row_max - new_max))
    row_sumexp.mul_(rescale).add_(torch.exp(z - new_max[:, None]).sum(dim=1))
    row_max.copy_(new_max)
    if sum_logits:
        row_sum.add_(z.sum(dim=1))
    local = labels - start
    hit = (local >= 0) & (local < z.shape[1])
    row_target.copy_(torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], row_target))


def _logits_grad(logits, labels, lse, row_grad, start, vocab, label_smoothing, triton_kernel: bool):
    """One chunk of logits -> d loss / d logits, in place."""
    if triton_kernel:
        padded = _padded(logits.shape[1])
        block_v = _block_v(padded, 4096)
        _chunk_logits_grad_kernel[(logits.shape[0], cdiv(padded, block_v))](
            logits,
            labels,
            lse,
            row_grad,
            logits.stride(0),
            padded,
            start,
            1.0 - label_smoothing,
            label_smoothing / vocab,
            BLOCK_V=block_v,
        )
        return logits
    return _logits_grad_reference(logits, labels, lse, row_grad, start, vocab, label_smoothing)


def _logits_grad_reference(logits, labels, lse, row_grad, start, vocab, label_smoothing):
    """What ``_chunk_logits_grad_kernel`` computes."""
    dz = torch.exp(logits.float() - lse[:, None]) - label_smoothing / vocab
    target = torch.arange(start, start + dz.shape[1], device=dz.device) == labels[:, None]
    dz -= (1.0 - label_smoothing) * target
    return logits.copy_(dz.mul_(row_grad[:, None]))


def _linear_cross_entropy_fwd(x, weight, bias, labels, ignore_index, label_smoothing):
    """Per-row (loss, lse), both fp32 (rows,); loss is 0 on ignored rows."""
    rows, vocab = x.shape[0], weight.shape[0]
    triton_kernel = use_triton(x)
    fp32 = dict(dtype=torch.float32, device=x.device)
    stats = (
        torch.full((rows,), -float("inf"), **fp32),
        torch.zeros(rows, **fp32),
        torch.zeros(rows, **fp32),
        torch.zeros(rows, **fp32),
    )
    width = _chunk_width(rows, vocab)
    buffer = _chunk_buffer(x, width)
    for start in range(0, vocab, width):
        logits = _chunk_logits(x, weight, bias, start, min(start + width, vocab), buffer)
        _chunk_statistics(logits, labels, stats, start, label_smoothing > 0, triton_kernel)
    row_max, row_sumexp, row_sum, row_target = stats
    lse = row_max + torch.log(row_sumexp)
    loss = lse - (1.0 - label_smoothing) * row_target - label_smoothing * row_sum / vocab
    return torch.where(labels == ignore_index, 0.0, loss), lse


def _linear_cross_entropy_bwd(row_grad, x, weight, bias, labels, lse, label_smoothing, needs):
    """(dx, dW, db) for per-row grads ``row_grad`` (fp32, 0 on ignored rows); None where
    ``needs`` says the input needs no grad."""
    rows, vocab = x.shape[0], weight.shape[0]
    triton_kernel = use_triton(x)
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if needs[0] else None
    dweight = torch.empty_like(weight) if needs[1] else None
    dbias = torch.empty_like(bias) if needs[2] else None
    width = _chunk_width(rows, vocab)
    buffer = _chunk_buffer(x, width)
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        logits = _chunk_logits(x, weight, bias, start, stop, buffer)
        dz = _logits_grad(logits, labels, lse, row_grad, start, vocab, label_smoothing, triton_kernel)
        if dx is not None:
            dx += dz @ weight[start:stop]
        if dweight is not None:
            torch.mm(dz.T, x, out=dweight[start:stop])
        if dbias is not None:
            dbias[start:stop] = dz.sum(dim=0, dtype=torch.float32)
    return (dx.to(x.dtype) if dx is not None else None), dweight, dbias


# The differentiable op: forward and backward ``torch.library`` ops joined by
# ``register_autograd``, so that torch.compile keeps x, the weights, the labels and the
# fp32 lse and never the logits.


@torch.library.custom_op("slimformer::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss in x's dtype, reduced as asked; per-row fp32 lse)."""
    row_loss, lse = _linear_cross_entropy_fwd(x, weight, bias, labels, ignore_index, label_smoothing)
    if reduction == "none":
        return row_loss.to(x.dtype), lse
    total = row_loss.sum()
    if reduction == "mean":
        total = total / (labels != ignore_index).sum()
    return total.to(x.dtype), lse


@_linear_cross_entropy_op.register_fake
def _(x, weight, bias, labels, ignore_index, label_smoothing, reduction):
    loss = x.new_empty(labels.shape if reduction == "none" else ())
    return loss, x.new_empty(labels.shape, dtype=torch.float32)


@torch.library.custom_op("slimformer::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    needs_input_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db); each an empty placeholder where ``needs_input_grad`` says it is not needed."""
    valid = labels != ignore_index
    row_grad = grad_loss.float().expand(labels.shape)
    if reduction == "mean":
        row_grad = row_grad / valid.sum()
    row_grad = torch.where(valid, row_grad, 0.0).contiguous()
    grads = _linear_cross_entropy_bwd(row_grad, x, weight, bias, labels, lse, label_smoothing, needs_input_grad)
    return tuple(absent_output(x.device) if grad is None else grad for grad in grads)


@_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, x, weight, bias, labels, lse, ignore_index, label_smoothing, reduction, needs_input_grad):
    shapes = (x, weight, bias)
    return tuple(
        torch.empty_like(like) if need and like is not None else absent_output(x.device)
        for like, need in zip(shapes, needs_input_grad)
    )


def _linear_cross_entropy_setup_context(ctx, inputs, output):
    x, weight, bias, labels, ignore_index, label_smoothing, reduction = inputs
    ctx.save_for_backward(x, weight, bias, labels, output[1])
    ctx.ignore_index, ctx.label_smoothing, ctx.reduction = ignore_index, label_smoothing, reduction
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _linear_cross_entropy_grad(ctx, grad_loss, _grad_lse):
    if grad_loss is None:  # the loss got no gradient
        return (None,) * 7
    x, weight, bias, labels, lse = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    grads = direct(_linear_cross_entropy_backward_op)(
        grad_loss, x, weight, bias, labels, lse, ctx.ignore_index, ctx.label_smoothing, ctx.reduction, needs
    )
    return *(grad if need else None for grad, need in zip(grads, needs)), None, None, None, None


_linear_cross_entropy = eager_autograd(
    _linear_cross_entropy_op, _linear_cross_entropy_grad, _linear_cross_entropy_setup_context
)


def _check_inputs(x, weight, bias, labels, ignore_index, label_smoothing, reduction) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, labels)):
        raise TypeError("input, weight and labels must be torch.Tensors")
    if x.dim() != 2:
        raise ValueError(f"input must be 2-d (rows, hidden), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be (vocab >= 1, {x.shape[1]}), got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},) or None, got shape {tuple(bias.shape)}")
    if labels.shape != (x.shape[0],):
        raise ValueError(f"labels must be ({x.shape[0]},) to match input's rows, got shape {tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be torch.int64 class indices, got {labels.dtype}")
    for name, tensor in (("input", x), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, input on {x.device}")
    if labels.device != x.device:
        raise ValueError(f"labels are on {labels.device}, input on {x.device}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    vocab = weight.shape[0]
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    # On a GPU (and in a graph) the range is checked on the device, as F.cross_entropy's
    # CUDA kernel checks it: a device-side assert, no host sync in the step.
    if labels.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(~outside.any(), f"labels must be in [0, {vocab}) or ignore_index={ignore_index}")
    elif outside.any():
        bad = labels[outside][0].item()
        raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}, got {bad}")


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    return_lse: bool = False,
):
    """``F.cross_entropy(F.linear(input, weight, bias), labels, ...)`` without the logits.

    input: (rows, hidden) float32/float16/bfloat16. weight: (vocab, hidden), bias:
    (vocab,) or None, same dtype as input outside autocast (under autocast all three are
    cast to the autocast dtype, as ``F.linear`` does). labels: (rows,) int64 in
    [0, vocab) or ``ignore_index``.
    reduction "mean" divides by the number of labelled rows, so with none labelled the
    loss is NaN, as in ``F.cross_entropy``; "sum" and "none" (per-row, 0 on ignored
    rows) as there too.
    Returns the loss, in input's dtype (float32 under autocast), and with
    ``return_lse`` also each row's fp32 log-sum-exp (not differentiable).
    Gradients flow to input, weight and bias (dW and db as whole (vocab, ...) tensors,
    accumulated by autograd into a tied Parameter's grad).
    Raises TypeError / ValueError naming the argument for bad shapes, dtypes, devices,
    and on CPU for labels outside the vocabulary; on a GPU and under torch.compile those
    trip a device-side assert instead, as in ``F.cross_entropy`` (no host sync).
    """
    _check_inputs(input, weight, bias, labels, ignore_index, label_smoothing, reduction)
    autocast = torch.is_autocast_enabled(input.device.type)
    if autocast:
        dtype = torch.get_autocast_dtype(input.device.type)
        input, weight = input.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    elif len({t.dtype for t in (input, weight, bias) if t is not None}) > 1:
        raise TypeError(
            f"input, weight and bias must share a dtype outside autocast, got "
            f"{input.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}"
        )
    with torch.autocast(input.device.type, enabled=False):
        loss, lse = _linear_cross_entropy(
            input.contiguous(),
            weight.contiguous(),
            None if bias is None else bias.contiguous(),
            labels.contiguous(),
            ignore_index,
            float(label_smoothing),
            reduction,
        )
    if autocast:
        loss = loss.float()
    return (loss, lse) if return_lse else loss
