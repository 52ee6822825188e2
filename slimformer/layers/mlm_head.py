"""The loss of a masked-language-model head computed on the labelled positions only.

A BERT-style head maps every position's hidden state through a transform (dense,
activation, LayerNorm) and a decoder to vocabulary logits, then takes the
cross-entropy at the positions whose label is not ``ignore_index`` (about 15% in
pre-training). ``masked_token_loss`` gathers those positions first, runs the transform
on them alone and fuses the decoder with the cross-entropy
(``slimformer.kernels.linear_cross_entropy``), so no (positions, vocab) logits are
formed or kept: for backward it keeps the gathered rows' transform activations, the
transformed rows and one fp32 log-sum-exp per row.

Gathering a data-dependent number of rows reads that number on the host (a sync). Given
``max_labelled_tokens`` it gathers a fixed number of rows instead, with no sync, as
MLPerf's BERT gathers ``max_predictions_per_seq``: the labelled positions in order, then
rows labelled ``ignore_index`` that the loss skips. Where no host read is possible at all
(torch.compile, CUDA graph capture) and no such bound is given, every position's row goes
through the head.
"""

from collections.abc import Callable

import torch

from slimformer.kernels.dispatch import capturing_graph
from slimformer.kernels.linear_cross_entropy import linear_cross_entropy


def masked_token_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    transform: Callable[[torch.Tensor], torch.Tensor],
    decoder_weight: torch.Tensor,
    decoder_bias: torch.Tensor | None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    max_labelled_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(decoder(transform(hidden)).view(-1, V), labels.view(-1))``,
    evaluated at the labelled positions only.

    hidden: (..., H) float. labels: int64 with as many elements as hidden has positions
    (``hidden.shape[:-1]`` or flattened), each in [0, V) or ``ignore_index``.
    transform: applied row-wise to a (rows, H) tensor (it must not mix positions, as
    dense + activation + LayerNorm do not). decoder_weight: (V, H), e.g. the tied word
    embedding; decoder_bias: (V,) or None.
    max_labelled_tokens: None, or an upper bound on the labelled positions of the batch:
    exactly that many rows are gathered, no host sync (the fixed-shape path, for CUDA
    graphs and steps without syncs). More labelled positions than that raise ValueError
    on CPU and trip a device-side assert on a GPU.
    Returns the mean loss over labelled positions: NaN when none is labelled, as in
    ``F.cross_entropy``. Without ``max_labelled_tokens`` gathering the positions costs
    one host sync; under ``torch.compile`` and CUDA graph capture nothing is gathered
    (the transform runs on every position, the logits are still never formed).
    Raises ValueError / TypeError naming ``labels`` for a wrong shape, dtype or (on CPU)
    a label outside the vocabulary, and naming ``max_labelled_tokens`` for a bad bound.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    positions = hidden.shape[:-1].numel()
    if labels.numel() != positions:
        raise ValueError(
            f"labels must have one entry per position, shape {tuple(hidden.shape[:-1])} "
            f"({positions} elements), got shape {tuple(labels.shape)}"
        )
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be torch.int64 token ids, got {labels.dtype}")
    _check_max_labelled_tokens(max_labelled_tokens)
    flat_labels = labels.to(hidden.device).reshape(-1)
    rows = hidden.reshape(positions, hidden.shape[-1])
    if max_labelled_tokens is not None and positions:
        rows, flat_labels = _fixed_labelled_rows(rows, flat_labels, ignore_index, max_labelled_tokens)
    elif not (torch.compiler.is_compiling() or capturing_graph(hidden.device)):
        # a graph cannot hold a data-dependent row count
        labelled = (flat_labels != ignore_index).nonzero()[:, 0]
        rows, flat_labels = rows.index_select(0, labelled), flat_labels.index_select(0, labelled)
    return linear_cross_entropy(
        transform(rows),
        decoder_weight,
        decoder_bias,
        flat_labels,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )


def _check_max_labelled_tokens(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_labelled_tokens must be an int or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_labelled_tokens must be >= 1, got {value}")


def _fixed_labelled_rows(
    rows: torch.Tensor, labels: torch.Tensor, ignore_index: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(size, H) rows and (size,) labels: the labelled positions' in order, then copies of
    the last row labelled ``ignore_index``; no host sync on a GPU.

    The s-th labelled position is the first whose running count of labelled positions
    reaches s + 1, a binary search in that count (nondecreasing); past the last one the
    search returns ``positions``.
    """
    positions = labels.shape[0]
    count = (labels != ignore_index).cumsum(0)
    message = f"max_labelled_tokens={size} is less than the batch's labelled positions"
    if rows.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(count[-1] <= size, message)
    elif count[-1] > size:
        raise ValueError(f"{message}, {int(count[-1])}")
    slots = torch.searchsorted(count, torch.arange(1, size + 1, device=labels.device))
    present = slots < positions
    slots = slots.clamp_max(positions - 1)
    return rows.index_select(0, slots), torch.where(present, labels.index_select(0, slots), ignore_index)
