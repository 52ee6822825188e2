"""What transformers' own model tests check of a model, on patched DistilBERT, ALBERT, MPNet and DeBERTa-v2:
every class patch made keeps the original forward signature, ``inputs_embeds`` gives the
``input_ids`` result (padded and unpadded), and the attention implementation can change
after patching while the layers stay fused.

Tiny models from configs, on the PyTorch path (TRITON_INTERPRET=0)."""

import copy
import inspect
from unittest import mock

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    AlbertModel,
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    DebertaV2Model,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertModel,
    MPNetConfig,
    MPNetForMaskedLM,
    MPNetModel,
)

import slimformer as sf

ALBERT = AlbertConfig(
    vocab_size=100,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
DISTILBERT = DistilBertConfig(
    vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
    attention_dropout=0.0,
)  # fmt: skip
MPNET = MPNetConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
DEBERTA = DebertaV2Config(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"], share_att_key=True,
    norm_rel_ebd="layer_norm", position_biased_input=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
BASE_MODELS = {
    "ALBERT": (ALBERT, AlbertModel),
    "DistilBERT": (DISTILBERT, DistilBertModel),
    "MPNet": (MPNET, MPNetModel),
    "DeBERTa-v2": (DEBERTA, DebertaV2Model),
}
MASKED_LM = {
    "ALBERT": AlbertForMaskedLM,
    "DistilBERT": DistilBertForMaskedLM,
    "MPNet": MPNetForMaskedLM,
    "DeBERTa-v2": DebertaV2ForMaskedLM,
}
# the families transformers runs on more than one attention implementation (MPNet: eager only)
SWITCHABLE = ["ALBERT", "DistilBERT"]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(model_class, config, attn="eager"):
    torch.manual_seed(0)
    config = copy.deepcopy(config)
    config._attn_implementation = attn
    return model_class(config).eval()


def _batch(config):
    ids = torch.randint(5, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    return ids, mask


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpad"])
@pytest.mark.parametrize("family", list(BASE_MODELS))
def test_every_generated_class_has_the_original_forward_signature(family, unpad):
    config = BASE_MODELS[family][0]
    for model_class in (BASE_MODELS[family][1], MASKED_LM[family]):
        model = sf.patch(_model(model_class, config), unpad=unpad)
        generated = {n: type(m) for n, m in model.named_modules() if hasattr(type(m), "_original_class")}
        assert generated, "patch made no class"
        for name, kind in generated.items():
            module = model.get_submodule(name)
            expected = inspect.signature(kind._original_class.forward.__get__(module))
            assert inspect.signature(module.forward) == expected, f"{name} ({kind.__name__})"


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpad"])
@pytest.mark.parametrize("family", list(BASE_MODELS))
def test_inputs_embeds(family, unpad):
    config, model_class = BASE_MODELS[family]
    reference = _model(model_class, config)
    model = sf.patch(copy.deepcopy(reference), unpad=unpad)
    ids, mask = _batch(config)
    with torch.no_grad():
        from_ids = model(input_ids=ids, attention_mask=mask).last_hidden_state
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).last_hidden_state
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(from_embeds[real], from_ids[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_ids[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SWITCHABLE)
def test_can_set_attention_dynamically_and_the_layers_stay_fused(family):
    config, model_class = BASE_MODELS[family]
    reference = _model(model_class, config)
    model = sf.patch(copy.deepcopy(reference))
    ids, mask = _batch(config)
    attention_class = type(model.get_submodule(_attention_path(family)))
    original_forward = attention_class.forward
    for implementation in ("sdpa", "slimformer", "eager"):
        for m in (model, reference):
            m.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        with torch.no_grad(), mock.patch.object(attention_class, "forward", autospec=True) as spy:
            spy.side_effect = original_forward
            out = model(ids, attention_mask=mask).last_hidden_state
            assert spy.call_count == 0, implementation  # the fused kernel ran
            expected = reference(ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert sf.unpatch(model).config._attn_implementation == "eager"


def _attention_path(family: str) -> str:
    return {
        "ALBERT": "encoder.albert_layer_groups.0.albert_layers.0.attention",
        "DistilBERT": "transformer.layer.0.attention",
    }[family]
