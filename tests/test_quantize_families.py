"""sf.quantize of the families after BERT (DistilBERT, MPNet, ModernBERT, ALBERT): a model fine-tuned here on
a small synthetic task keeps its accuracy within one point in int8, and saves and
reloads through ``save_pretrained`` / ``from_pretrained`` bit for bit."""

import copy

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    AutoModelForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    MPNetConfig,
    MPNetForSequenceClassification,
)

import slimformer as sf
from slimformer.quantize import quantized_modules

VOCAB, SEQ, STEPS, BATCH = 64, 16, 250, 32
CONFIGS = {
    "DistilBERT": lambda: DistilBertForSequenceClassification(
        DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=SEQ)
    ),
    "MPNet": lambda: MPNetForSequenceClassification(
        MPNetConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=SEQ + 2,
        )
    ),
    "ModernBERT": lambda: ModernBertForSequenceClassification(
        ModernBertConfig(
            vocab_size=VOCAB,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=96,
            local_attention=8,
            classifier_pooling="mean",
        )
    ),
    "ALBERT": lambda: AlbertForSequenceClassification(
        AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=SEQ,
        )
    ),
}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels): label 1 when most real tokens are in the vocabulary's lower
    half, a task that needs attention over the whole sequence; lengths 4..SEQ."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    mask = (torch.arange(SEQ) < torch.randint(4, SEQ + 1, (n, 1), generator=g)).long()
    ids = ids.masked_fill(mask == 0, 0)
    low = ((ids < (VOCAB + 2) // 2) & (mask == 1)).sum(1)
    return ids, mask, (2 * low > mask.sum(1)).long()


def _accuracy(model, ids, mask, labels) -> float:
    with torch.no_grad():
        return (model(ids, attention_mask=mask).logits.argmax(-1) == labels).float().mean().item()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_fine_tuned_model_keeps_its_accuracy_in_int8_and_round_trips(family, tmp_path):
    torch.manual_seed(0)
    model = sf.patch(CONFIGS[family]()).train()
    ids, mask, labels = _task(STEPS * BATCH, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = model(ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    test = _task(1000, seed=2)
    float_accuracy = _accuracy(model, *test)
    assert float_accuracy > 0.9, f"{family}: the float model did not learn the task ({float_accuracy:.3f})"
    for mode in ("int8", "int8-weight-only"):
        quantized = sf.quantize(sf.unpatch(copy.deepcopy(model)), mode)
        accuracy = _accuracy(quantized, *test)
        assert accuracy >= float_accuracy - 0.01, f"{family} {mode}: {accuracy:.3f} vs float {float_accuracy:.3f}"
        quantized.save_pretrained(tmp_path / mode)
        reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / mode).eval()
        assert quantized_modules(reloaded) == quantized_modules(quantized)
        with torch.no_grad():
            assert torch.equal(
                reloaded(test[0], attention_mask=test[1]).logits, quantized(test[0], attention_mask=test[1]).logits
            )
