"""Phase 3: the curated kernel rows, every family's cases in the order they run."""

import torch

from bench.gpu_check import attention, deberta, gemms, norms
from bench.gpu_check.cases import Case

# BERT-base's attention shape in its three variants and causal: these run before the other families
ATTENTION_FIRST = 4


def all_cases(dry_run: bool, device: torch.device, copies: int) -> list[Case]:
    """Most important first, so that a short budget drops the least: BERT-base's attention
    (the targets), DeBERTa's disentangled attention, norms, MLP and GEMMs, then the longer
    and causal attention shapes."""
    attention_cases = attention.cases(dry_run, device, copies)
    return [
        *attention_cases[:ATTENTION_FIRST],
        *deberta.cases(dry_run, device, copies),
        *norms.cases(dry_run, device, copies),
        *gemms.cases(dry_run, device, copies),
        *attention_cases[ATTENTION_FIRST:],
    ]
