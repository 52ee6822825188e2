"""The loss of a masked-language-model head computed on the labelled positions only.

A BERT-style head maps every position's hidden state through a transform (dense,
activation, LayerNorm) and a decoder to vocabulary logits, then takes the
cross-entropy at the positions whose label is not ``ignore_index`` (about 15% in
pre-training). ``masked_token_loss`` gathers those positions first, runs the transform
on them alone and fuses the decoder with the cross-entropy
(``slimformer.kernels.linear_cross_entropy``), so no (positions, vocab) logits are
formed or kept: for backward it keeps the gathered rows' transform activations, the
transformed rows and one fp32 log-sum-exp per row.
"""

from collections.abc import Callable

import torch

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
) -> torch.Tensor:
    """``F.cross_entropy(decoder(transform(hidden)).view(-1, V), labels.view(-1))``,
    evaluated at the labelled positions only.

    hidden: (..., H) float. labels: int64 with as many elements as hidden has positions
    (``hidden.shape[:-1]`` or flattened), each in [0, V) or ``ignore_index``.
    transform: applied row-wise to a (rows, H) tensor (it must not mix positions, as
    dense + activation + LayerNorm do not). decoder_weight: (V, H), e.g. the tied word
    embedding; decoder_bias: (V,) or None.
    Returns the mean loss over labelled positions: NaN when none is labelled, as in
    ``F.cross_entropy``. Gathering the positions costs one host sync; under
    ``torch.compile`` nothing is gathered (the transform runs on every position, the
    logits are still never formed) and the label range is checked on the device.
    Raises ValueError / TypeError naming ``labels`` for a wrong shape, dtype or a label
    outside the vocabulary.
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
    flat_labels = labels.to(hidden.device).reshape(-1)
    rows = hidden.reshape(positions, hidden.shape[-1])
    if not torch.compiler.is_compiling():  # a graph cannot hold a data-dependent row count
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
