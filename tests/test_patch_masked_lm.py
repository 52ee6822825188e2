"""patch on HF *ForMaskedLM models: the fused masked-LM loss against HF's own, tiny configs.

Models run the PyTorch references (TRITON_INTERPRET=0), as in test_patch.py; the
interpreted kernels are tested against them in tests/kernels/."""

import copy
import pickle

import pytest
import torch

import slimformer as sf
from slimformer.masked_lm import FusedMaskedLM

transformers = pytest.importorskip("transformers")

VOCAB = 97
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="Bert", dropout=0.0, **config):
    config_class = getattr(transformers, f"{name}Config")
    model_class = getattr(transformers, f"{name}ForMaskedLM")
    torch.manual_seed(0)
    cfg = config_class(**SIZES, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **config)
    return model_class(cfg).train()


def _batch(seed=1, masked=0.3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 17), generator=generator)
    labels = torch.where(torch.rand(3, 17, generator=generator) < masked, ids, -100)
    return ids, labels


def _loss_and_grads(model, ids, labels, seed=2, **kwargs):
    model.zero_grad()
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(grads, reference):
    assert grads.keys() == reference.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], reference[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("name", ["Bert", "Roberta", "XLMRoberta", "Ernie"])
def test_loss_and_grads_match_hf(name):
    reference = _model(name)
    model = sf.patch(copy.deepcopy(reference))
    assert isinstance(model, FusedMaskedLM) and isinstance(model, type(reference))
    ids, labels = _batch()
    out, grads = _loss_and_grads(model, ids, labels)
    expected, expected_grads = _loss_and_grads(reference, ids, labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(grads, expected_grads)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding and embedding.grad.abs().sum() > 0


def test_other_calls_run_hf_forward_exactly():
    reference = _model()
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    for mode in ("eval", "train"):
        model.train(mode == "train"), reference.train(mode == "train")
        with torch.no_grad():
            out, expected = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.loss, expected.loss)
    model.train(), reference.train()
    out = model(input_ids=ids, labels=labels, return_dict=False)
    expected = reference(input_ids=ids, labels=labels, return_dict=False)
    assert len(out) == len(expected) == 2
    torch.testing.assert_close(out[1], expected[1])
    model.fused_loss = False
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, expected[1])


def test_with_dropout_same_masks_same_result():
    model = sf.patch(_model(dropout=0.1))
    ids, labels = _batch()
    fused, grads = _loss_and_grads(model, ids, labels)
    model.fused_loss = False
    unfused, unfused_grads = _loss_and_grads(model, ids, labels)
    torch.testing.assert_close(fused.loss, unfused.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(grads, unfused_grads)
    model.fused_loss = True
    other_seed, _ = _loss_and_grads(model, ids, labels, seed=3)
    assert other_seed.loss != fused.loss  # dropout is live


def test_untied_decoder_matches_hf():
    reference = _model(tie_word_embeddings=False)
    assert reference.get_output_embeddings().weight is not reference.get_input_embeddings().weight
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    out, grads = _loss_and_grads(model, ids, labels)
    expected, expected_grads = _loss_and_grads(reference, ids, labels)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(grads, expected_grads)


def test_all_labels_ignored_is_nan_like_hf():
    reference = _model()
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    labels[:] = -100
    out, grads = _loss_and_grads(model, ids, labels)
    expected, expected_grads = _loss_and_grads(reference, ids, labels)
    assert out.loss.isnan() and expected.loss.isnan()
    _assert_same_grads(grads, expected_grads)


def test_flat_labels_accepted_like_hf():
    reference = _model()
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    out, _ = _loss_and_grads(model, ids, labels.reshape(-1))
    expected, _ = _loss_and_grads(reference, ids, labels.reshape(-1))
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("labels", "error", "match"),
    [
        (lambda labels: labels[:, :-1], ValueError, "labels must have one entry per position"),
        (lambda labels: labels.int(), TypeError, "labels must be torch.int64"),
        (lambda labels: labels.float(), TypeError, "labels must be torch.int64"),
        (lambda labels: labels.clamp(min=0) + VOCAB, ValueError, f"labels must be in \\[0, {VOCAB}\\)"),
    ],
)
def test_bad_labels(labels, error, match):
    model = sf.patch(_model())
    ids, good = _batch()
    with pytest.raises(error, match=match):
        model(input_ids=ids, labels=labels(good))


@pytest.mark.parametrize("max_labelled_tokens", [16, 51])
def test_fixed_shape_loss_matches_hf(max_labelled_tokens):
    """``max_labelled_tokens``: that many rows gathered (no host sync), the extra ones
    ignored; the loss and gradients are HF's, with padding and with every position."""
    reference = _model()
    model = sf.patch(copy.deepcopy(reference))
    model.max_labelled_tokens = max_labelled_tokens
    ids, labels = _batch()
    assert (labels != -100).sum() <= 16
    out, grads = _loss_and_grads(model, ids, labels)
    expected, expected_grads = _loss_and_grads(reference, ids, labels)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(grads, expected_grads)


def test_fixed_shape_gathers_without_a_sync_and_refuses_too_small_a_bound(monkeypatch):
    from slimformer.layers import mlm_head

    hidden = torch.randn(2, 5, 4)
    labels = torch.tensor([[-100, 3, -100, 7, 1], [-100] * 5])
    rows, row_labels = mlm_head._fixed_labelled_rows(hidden.view(10, 4), labels.view(10), -100, 5)
    assert row_labels.tolist() == [3, 7, 1, -100, -100]
    assert torch.equal(rows[:3], hidden.view(10, 4)[[1, 3, 4]])
    with pytest.raises(ValueError, match="max_labelled_tokens=2 is less than the batch's labelled positions, 3"):
        mlm_head._fixed_labelled_rows(hidden.view(10, 4), labels.view(10), -100, 2)
    with pytest.raises(TypeError, match="max_labelled_tokens must be an int or None, got float"):
        mlm_head.masked_token_loss(hidden, labels, lambda r: r, torch.ones(9, 4), None, max_labelled_tokens=2.0)
    with pytest.raises(ValueError, match="max_labelled_tokens must be >= 1, got 0"):
        mlm_head.masked_token_loss(hidden, labels, lambda r: r, torch.ones(9, 4), None, max_labelled_tokens=0)
    asserted = []  # a GPU's path: the bound checked on the device
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch, "_assert_async", lambda flag, message: asserted.append((bool(flag), message)))
    mlm_head._fixed_labelled_rows(hidden.view(10, 4), labels.view(10), -100, 2)
    assert asserted == [(False, "max_labelled_tokens=2 is less than the batch's labelled positions")]


def test_fixed_shape_loss_compiles_without_graph_breaks():
    from slimformer.layers import mlm_head

    hidden = torch.randn(2, 5, 4, requires_grad=True)
    labels = torch.tensor([[-100, 3, -100, 7, 1], [-100] * 5])
    weight = torch.randn(9, 4)

    def loss(h):
        return mlm_head.masked_token_loss(h, labels, torch.tanh, weight, None, max_labelled_tokens=4)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden), loss(hidden))


def test_unpatch_summary_and_copies():
    model = _model()
    keys = list(model.state_dict())
    patched = sf.patch(model)
    assert patched is model and list(model.state_dict()) == keys
    assert "(masked-LM loss fused" in str(sf.patch_summary(model))
    assert sf.patch_summary(model).title().startswith("slimformer.patch(BertForMaskedLM")
    ids, labels = _batch()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(copied) is type(model)
        assert copied(input_ids=ids, labels=labels).logits is None
    sf.unpatch(model)
    assert type(model) is transformers.BertForMaskedLM
    assert model(input_ids=ids, labels=labels).logits is not None
    assert "would fuse its masked-LM loss" in str(sf.patch_summary(model))


def test_autocast_close_to_hf_autocast():
    reference = _model()
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = _loss_and_grads(model, ids, labels)
        expected, _ = _loss_and_grads(reference, ids, labels)
    exact, _ = _loss_and_grads(reference, ids, labels)
    assert out.loss.dtype == expected.loss.dtype == torch.float32
    # bf16 logits in both: each within a few bf16 roundings of the fp32 loss
    assert abs(out.loss - exact.loss) <= 2 * abs(expected.loss - exact.loss) + 4 * 2**-8 * exact.loss


def test_bert_for_pretraining_mlm_part():
    torch.manual_seed(0)
    config = transformers.BertConfig(**SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    reference = transformers.BertForPreTraining(config).train()
    model = sf.patch(copy.deepcopy(reference))
    ids, labels = _batch()
    next_sentence = torch.tensor([0, 1, 1])
    out, grads = _loss_and_grads(model, ids, labels, next_sentence_label=next_sentence)
    expected, expected_grads = _loss_and_grads(reference, ids, labels, next_sentence_label=next_sentence)
    assert out.prediction_logits is None
    torch.testing.assert_close(out.seq_relationship_logits, expected.seq_relationship_logits)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(grads, expected_grads)
    # without next_sentence_label HF computes no loss: its forward runs, logits and all
    unfused = model(input_ids=ids, labels=labels)
    assert unfused.loss is None and unfused.prediction_logits is not None


def _train(model, steps, fused=True, lr=0.5):
    model.fused_loss = fused
    # SGD: AdamW would blow the key bias's zero-in-theory, rounding-noise gradient up to lr-sized steps
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, labels = _batch(seed=100 + step, masked=0.15)
        torch.manual_seed(step)  # the same dropout draws in both runs
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), dict(model.named_parameters())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_training_curve_and_final_weights_match(dropout):
    """30 SGD steps: the fused loss against the unfused head on the same patched model
    (dropout masks from the same seeds), and without dropout against HF itself."""
    reference = _model(dropout=dropout)
    model = sf.patch(copy.deepcopy(reference))
    unfused = sf.patch(copy.deepcopy(reference)) if dropout else reference
    # lr 0.2 keeps 30 steps where the per-step error estimate below holds; at 0.5 the
    # trajectory amplifies fp32 rounding differences between two heads that are equal
    # in exact arithmetic to ~3e-4 in the embeddings, whichever head is the more exact
    losses, weights = _train(model, 30, lr=0.2)
    expected_losses, expected_weights = _train(unfused, 30, fused=False, lr=0.2)
    assert losses[-10:].mean() < losses[:10].mean() - 0.1  # it learns
    torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=1e-5)
    for name, weight in weights.items():
        # per step the grads agree to ~2e-6 (test_loss_and_grads_match_hf): lr · steps · 2e-6 = 1.2e-5, plus slack
        torch.testing.assert_close(
            weight, expected_weights[name], rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
