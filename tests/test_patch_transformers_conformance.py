"""A patched HF model passes what transformers' own model tests check of a model
(transformers 5.24): the forward signature, the attention outputs however they are asked
for, the attention implementation the user set, ``inputs_embeds``. And what patch warns
about, and the attention registered on import.

A test named after one of transformers' reproduces, on patched models, transformers'
``tests/models/bert/test_modeling_bert.py::BertModelTest::<name>`` and
``tests/models/roberta/test_modeling_roberta.py::RobertaModelTest::<name>`` (both
``ModelTesterMixin.<name>`` of ``tests/test_modeling_common.py``).

Tiny BERT and RoBERTa models from configs, on the PyTorch path (TRITON_INTERPRET=0).
"""

import copy
import inspect
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertModel,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaModel,
    Trainer,
)
from transformers.models.bert.modeling_bert import BertLayer, BertSelfAttention
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention

import slimformer as sf
from slimformer.integrations.hf.bert import FusedBertFamilyLayer
from slimformer.patch import patch_summary
from tests.helpers import TINY_BERT as TINY

ROOT = Path(__file__).resolve().parents[1]
BASE_MODELS = {
    "Bert": (BertConfig, BertModel, BertSelfAttention),
    "Roberta": (RobertaConfig, RobertaModel, RobertaSelfAttention),
}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _config(name, **config):
    return BASE_MODELS[name][0](**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config)


def _model(model_class, config):
    torch.manual_seed(0)
    return model_class(config).eval()


def _batch(config):
    """Token ids (no padding token) and a mask (1 = token) whose first row ends in padding."""
    ids = torch.randint(5, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    return ids, mask


def _generated_classes(model):
    """{module name: class} of the modules whose class patch made at run time."""
    return {name: type(module) for name, module in model.named_modules() if hasattr(type(module), "_original_class")}


# --- forward signatures (the "HF Trainer sees no arguments") ---

SIGNATURE_CASES = {
    "BertForMaskedLM": (lambda: BertForMaskedLM(_config("Bert")), False),
    "BertForPreTraining": (lambda: BertForPreTraining(_config("Bert")), False),
    "RobertaForMaskedLM, unpad": (lambda: RobertaForMaskedLM(_config("Roberta")), True),
    "BertModel, unpad": (lambda: BertModel(_config("Bert")), True),
    "LlamaRMSNorm": (lambda: nn.Sequential(LlamaRMSNorm(8)), False),
}


@pytest.mark.parametrize("case", list(SIGNATURE_CASES))
def test_every_generated_class_has_the_original_forward_signature(case):
    build, unpad = SIGNATURE_CASES[case]
    model = sf.patch(build(), unpad=unpad)
    generated = _generated_classes(model)
    assert generated, "patch made no class"
    for name, kind in generated.items():
        module = model.get_submodule(name)
        expected = inspect.signature(kind._original_class.forward.__get__(module))
        assert inspect.signature(module.forward) == expected, f"{name} ({kind.__name__})"


@pytest.mark.parametrize("model_class", [BertForMaskedLM, BertForPreTraining])
def test_trainer_keeps_the_dataset_columns_the_model_takes(model_class):
    # transformers' Trainer._set_signature_columns_if_needed (remove_unused_columns=True)
    # keeps the dataset columns named by inspect.signature(model.forward)
    def columns(model):
        trainer = types.SimpleNamespace(model=model, _signature_columns=None, label_names=[])
        Trainer._set_signature_columns_if_needed(trainer)
        return trainer._signature_columns

    expected = columns(model_class(_config("Bert")))
    got = columns(sf.patch(model_class(_config("Bert")), unpad=True))
    assert got == expected
    assert {"input_ids", "attention_mask", "token_type_ids", "labels"} <= set(got)


def test_positional_and_keyword_calls_work_as_before():
    reference = _model(BertForMaskedLM, _config("Bert")).train()
    model = sf.patch(copy.deepcopy(reference), unpad=True)
    ids, mask = _batch(reference.config)
    labels = torch.where((torch.arange(7) % 3 == 0) & (mask == 1), ids, -100)
    # BertForMaskedLM.forward(input_ids, attention_mask, token_type_ids, position_ids,
    # inputs_embeds, encoder_hidden_states, encoder_attention_mask, labels)
    positional = (ids, mask, None, None, None, None, None, labels)
    torch.testing.assert_close(model(*positional).loss, reference(*positional).loss, rtol=1e-5, atol=1e-5)
    real = mask.bool()  # the unpadded model's padded positions differ (zeros)
    torch.testing.assert_close(model(ids, mask).logits[real], reference(ids, mask).logits[real], rtol=1e-5, atol=1e-5)
    hidden = torch.randn(2, 7, 32)
    layer, reference_layer = model.bert.encoder.layer[0], reference.bert.encoder.layer[0]
    torch.testing.assert_close(layer(hidden, None), reference_layer(hidden, None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(hidden_states=hidden), reference_layer(hidden_states=hidden), rtol=1e-5, atol=1e-5)
    for m in (model, reference):  # an argument the model does not take fails as before
        with pytest.raises(TypeError, match="positional argument"):
            m(*positional, None)


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpad"])
@pytest.mark.parametrize("name", list(BASE_MODELS))
def test_inputs_embeds(name, unpad):
    # transformers' test_inputs_embeds (which skips itself where "inputs_embeds" is not a
    # forward parameter) and test_inputs_embeds_matches_input_ids
    reference = _model(BASE_MODELS[name][1], _config(name))
    model = sf.patch(copy.deepcopy(reference), unpad=unpad)
    assert "inputs_embeds" in inspect.signature(model.forward).parameters
    ids, _ = _batch(model.config)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        from_ids = model(input_ids=ids, attention_mask=mask).last_hidden_state
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).last_hidden_state
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(from_embeds, from_ids, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_ids, expected, rtol=1e-5, atol=1e-5)


# --- attention outputs and the attention implementation ---


def _assert_attentions_match(got, expected, layers):
    assert len(got) == len(expected) == layers
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BASE_MODELS))
def test_attention_outputs(name):
    # transformers' test_attention_outputs. The model is built "eager" and patched; the
    # attentions come by argument, then by config.output_attentions (set on the shared
    # config, which must not raise: the implementation is still "eager").
    _, model_class, _ = BASE_MODELS[name]
    config = _config(name, attn_implementation="eager")
    patched_first = sf.patch(_model(model_class, config))
    reference = _model(model_class, copy.deepcopy(config))
    ids, mask = _batch(config)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    with torch.no_grad():
        out = patched_first(ids, attention_mask=mask, output_attentions=True, output_hidden_states=False)
        expected = reference(ids, attention_mask=mask, output_attentions=True)
    _assert_attentions_match(out.attentions, expected.attentions, layers)

    config.output_attentions = True  # after patching, on the patched model's config
    reference.config.output_attentions = True
    model = sf.patch(_model(model_class, config))  # and a model patched with it set
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask)
        for patched in (patched_first, model):
            out = patched(ids, attention_mask=mask)
            _assert_attentions_match(out.attentions, expected.attentions, layers)
            assert list(out.attentions[0].shape[-3:]) == [heads, 7, 7]
        out_len = len(out)
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        as_tuple = model(ids, attention_mask=mask, output_hidden_states=True, return_dict=False)
        expected_tuple = reference(ids, attention_mask=mask, output_hidden_states=True, return_dict=False)
    assert len(out) == out_len + 1  # the hidden states are added
    _assert_attentions_match(out.attentions, expected.attentions, layers)
    torch.testing.assert_close(as_tuple, expected_tuple, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BASE_MODELS))
def test_retain_grad_hidden_states_attentions(name):
    # transformers' test_retain_grad_hidden_states_attentions, and the issue's repro (a
    # 2-layer eager model with output_attentions=True in its config)
    _, model_class, _ = BASE_MODELS[name]
    config = _config(name, attn_implementation="eager", output_attentions=True, output_hidden_states=True)
    model = sf.patch(_model(model_class, config).train())
    ids, _ = _batch(config)
    outputs = model(ids)
    assert len(outputs.attentions) == config.num_hidden_layers
    hidden_states, attentions = outputs.hidden_states[0], outputs.attentions[0]
    hidden_states.retain_grad()
    attentions.retain_grad()
    outputs[0].flatten()[0].backward(retain_graph=True)
    assert hidden_states.grad is not None and attentions.grad is not None


@pytest.mark.parametrize("name", list(BASE_MODELS))
def test_can_set_attention_dynamically(name):
    # transformers' test_can_set_attention_dynamically; here also: the layers stay fused
    # (the self-attention module runs only for calls asking for the weights) and every
    # implementation gives the unpatched model's outputs
    _, model_class, self_attention_class = BASE_MODELS[name]
    config = _config(name)
    config._attn_implementation = "eager"
    reference = _model(model_class, config)
    model = sf.patch(copy.deepcopy(reference))
    assert model.config._attn_implementation == "eager"
    ids, mask = _batch(config)
    layers = config.num_hidden_layers
    original_forward = self_attention_class.forward
    for implementation in ("sdpa", "slimformer", "eager"):
        for m in (model, reference):
            m.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        assert all(isinstance(layer, FusedBertFamilyLayer) for layer in model.encoder.layer)
        with torch.no_grad():
            expected = reference(ids, attention_mask=mask)
            expected_weights = reference(ids, attention_mask=mask, output_attentions=True)
            with mock.patch.object(self_attention_class, "forward", autospec=True) as spy:
                spy.side_effect = original_forward
                out = model(ids, attention_mask=mask)
                assert spy.call_count == 0, implementation  # the fused kernel ran
                weights = model(ids, attention_mask=mask, output_attentions=True)
                assert spy.call_count == layers, implementation  # the original ran
        torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)
        if implementation == "sdpa":  # sdpa returns no weights, patched or not (transformers warns)
            assert weights.attentions == expected_weights.attentions == ()
        else:
            _assert_attentions_match(weights.attentions, expected_weights.attentions, layers)
    assert sf.unpatch(model).config._attn_implementation == "eager"


@pytest.mark.parametrize("name", list(BASE_MODELS))
def test_sdpa_can_dispatch_non_composite_models(name, tmp_path):
    # transformers' test_sdpa_can_dispatch_non_composite_models, the loaded models
    # patched: the default reads back "sdpa", an explicit "eager" "eager"
    _, model_class, _ = BASE_MODELS[name]
    model_class(_config(name)).save_pretrained(tmp_path)
    for requested, expected in ((None, "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")):
        extra = {} if requested is None else {"attn_implementation": requested}
        model = sf.patch(model_class.from_pretrained(tmp_path, **extra).eval())
        assert model.config._attn_implementation == expected, requested
        assert isinstance(model.encoder.layer[0], FusedBertFamilyLayer)
        assert sf.unpatch(model).config._attn_implementation == expected


def test_unfused_calls_pass_the_cache_on_without_warning():
    # transformers 5.24 renamed past_key_values to cache; the fallback passed both and each
    # unfused call warned "Both `past_key_values` and `cache` are set", and a cache passed
    # as `cache` was not written (the fused path ran)
    reference = _model(BertModel, _config("Bert", attn_implementation="eager"))
    model = sf.patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    model.encoder.layer[1].attention.register_forward_hook(lambda *args: None)  # layer 1 runs unfused
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(ids, attention_mask=mask, output_attentions=True)
        model(ids, attention_mask=mask)
        caches = {}
        for key, m in (("patched", model), ("reference", reference)):
            caches[key] = DynamicCache(config=m.config)
            out = m(ids, attention_mask=mask, cache=caches[key])
    assert not [str(w.message) for w in caught if "are set for" in str(w.message)]
    assert caches["patched"].get_seq_length() == caches["reference"].get_seq_length() == ids.shape[1]
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(caches["patched"].layers[layer].keys, caches["reference"].layers[layer].keys)
    torch.testing.assert_close(out.last_hidden_state, reference(ids, attention_mask=mask).last_hidden_state)


def test_a_mask_that_is_not_a_tensor_goes_to_the_original_layer():
    # flex attention hands the layers a BlockMask (flex attention compiles for a minute on
    # the CPU, so a stand-in object here); the original layer reads it
    model = sf.patch(_model(BertModel, _config("Bert")))
    hidden, block_mask = torch.randn(2, 7, 32), object()
    with mock.patch.object(BertLayer, "forward", return_value="original") as original:
        assert model.encoder.layer[0](hidden, block_mask) == "original"
    assert original.call_args.args == (hidden, block_mask)


def test_unpadded_model_runs_a_call_with_a_cache_padded():
    reference = _model(BertModel, _config("Bert"))
    model = sf.patch(copy.deepcopy(reference), unpad=True)
    ids, mask = _batch(model.config)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache)
        expected = reference(ids, attention_mask=mask, cache=DynamicCache(config=reference.config))
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)


# --- warnings ---


def test_recompute_policy_that_applies_to_nothing_warns_once():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sf.patch(gpt2, recompute="full")
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "recompute='full' applies to nothing in GPT2LMHeadModel" in messages[0], messages
    summary = patch_summary(gpt2)
    assert summary.recompute is None and summary.unused_recompute == "full"
    assert str(summary).splitlines()[0] == (
        "slimformer.patch(GPT2LMHeadModel, recompute='full' applies to nothing): 5 swapped, 4 left"
    )
    with pytest.warns(UserWarning, match="recompute='qkv' applies to nothing in Sequential"):
        sf.patch(nn.Sequential(nn.LayerNorm(8), nn.MultiheadAttention(8, 2)), recompute="qkv")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a policy that applies to a layer does not warn
        bert = sf.patch(BertModel(_config("Bert")), recompute="full")
    assert patch_summary(bert).recompute == "full" and patch_summary(bert).unused_recompute is None


# --- registration of the attention on import ---

# One interpreter for both orders (starting one costs seconds): first without transformers,
# then, after slimformer is re-imported, with transformers imported after it.
_IMPORT_CHECK = """
import importlib, sys
sys.modules["transformers"] = None  # as if transformers were not installed
import slimformer as sf
assert sf.patch and not any(type(f).__name__ == "_RegisterAfterLoading" for f in sys.meta_path)
try:
    sf.register_transformers_attention()
except ImportError:
    pass
else:
    raise AssertionError("registered without transformers")

del sys.modules["transformers"]
importlib.reload(sf)
assert "transformers.modeling_utils" not in sys.modules, "import slimformer imported transformers"
import torch
from transformers import BertConfig, BertModel
config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    vocab_size=50, attn_implementation="slimformer")
model = BertModel(config)
assert model.config._attn_implementation == "slimformer"
model(torch.randint(0, 50, (1, 5)))
model.set_attn_implementation("sdpa")
model.set_attn_implementation("slimformer")
print("ok")
"""


def test_attention_is_registered_when_transformers_is_imported():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("name", BASE_MODELS)
def test_slimformer_attention_gives_the_weights_a_config_asks_for(name):
    # a model built with output_attentions=True in its config, then switched to "slimformer"
    config = _config(name, attn_implementation="eager", output_attentions=True)
    model = _model(BASE_MODELS[name][1], config)
    ids, mask = _batch(config)
    eager = model(input_ids=ids, attention_mask=mask).attentions
    model.set_attn_implementation("slimformer")
    ours = model(input_ids=ids, attention_mask=mask).attentions
    assert len(ours) == len(eager) == config.num_hidden_layers
    for got, expected in zip(ours, eager):
        torch.testing.assert_close(got, expected)
