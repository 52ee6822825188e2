"""slimformer as a transformers quantization method: from_pretrained with SlimformerInt8Config,
save_pretrained and reload, the interplay with save_quantized / load_quantized, and the
memory of loading a saved int8 model (small BERTs built from configs, no download)."""

import copy
import json
import logging
import sys
import types

import pytest
import torch
from torch import nn

from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.quantize import load_quantized, quantize, quantized_modules, save_quantized
from tests.helpers import TINY_BERT

transformers = pytest.importorskip("transformers")

from slimformer.transformers_quantizer import SlimformerHfQuantizer, SlimformerInt8Config  # noqa: E402

NO_LOAD_ISSUES = {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}


def _model(cls=transformers.BertModel, seed=0):
    torch.manual_seed(seed)
    return cls(transformers.BertConfig(**TINY_BERT)).eval()


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _output(model, batch=None):
    with torch.no_grad():
        output = model(**(batch or _inputs()))
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _load(directory, cls=transformers.AutoModel, **kwargs):
    model, info = cls.from_pretrained(directory, output_loading_info=True, **kwargs)
    assert info == NO_LOAD_ISSUES
    return model


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.fixture
def float_dir(tmp_path):
    _model().save_pretrained(tmp_path / "float")
    return tmp_path / "float"


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only", "fp16"])
def test_quantized_on_load_as_quantize_does_then_saved_and_reloaded(tmp_path, float_dir, mode):
    loaded = _load(float_dir, quantization_config=SlimformerInt8Config(mode))
    expected = quantize(_model(), mode)
    assert quantized_modules(loaded) == quantized_modules(expected)
    assert type(loaded.pooler.dense) is (Linear16bit if mode == "fp16" else Linear8bit)
    _assert_same_state(loaded, expected)
    assert torch.equal(_output(loaded), _output(expected))

    loaded.save_pretrained(tmp_path / "quantized")
    saved = json.loads((tmp_path / "quantized" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "slimformer" and saved["modules"] == quantized_modules(expected)
    reloaded = _load(tmp_path / "quantized")
    assert isinstance(reloaded.hf_quantizer, SlimformerHfQuantizer)
    _assert_same_state(reloaded, expected)
    assert torch.equal(_output(reloaded), _output(expected))


def test_a_smoothquant_model_with_mixed_modes_round_trips(tmp_path):
    model = _model(transformers.BertForSequenceClassification)
    quantize(model, "int8", calibration=[_inputs(seed=2)], skip=("pooler", "classifier"))
    quantize(model, "fp16", skip=lambda name, m: name != "bert.pooler.dense")
    record = model.config.quantization_config
    assert record.modules == quantized_modules(model) and record.modules["bert.pooler.dense"] == "fp16"
    assert len(record.smoothed_modules) == 12 and record.modules_to_not_convert == ["classifier"]
    model.save_pretrained(tmp_path)
    reloaded = _load(tmp_path, transformers.AutoModelForSequenceClassification)
    query = reloaded.bert.encoder.layer[0].attention.self.query
    assert query.smooth.shape == (32,)
    assert torch.equal(query.smooth, model.bert.encoder.layer[0].attention.self.query.smooth)
    _assert_same_state(reloaded, model)
    assert torch.equal(_output(reloaded), _output(model))


def test_a_record_converts_exactly_the_modules_it_names(float_dir):
    record = {"encoder.layer.1.intermediate.dense": "int8-weight-only", "pooler.dense": "fp16"}
    loaded = _load(float_dir, quantization_config=SlimformerInt8Config(modules=record))
    assert quantized_modules(loaded) == record
    expected = quantize(_model(), "int8-weight-only", skip=lambda name, m: name != "encoder.layer.1.intermediate.dense")
    quantize(expected, "fp16", skip=lambda name, m: name != "pooler.dense")
    assert torch.equal(_output(loaded), _output(expected))


def test_heads_and_tied_linears_stay_float(tmp_path):
    _model(transformers.BertForMaskedLM).save_pretrained(tmp_path)
    default = _load(tmp_path, transformers.AutoModelForMaskedLM, quantization_config=SlimformerInt8Config())
    assert not any(name.startswith("cls.") for name in quantized_modules(default))
    nothing_skipped = SlimformerInt8Config(modules_to_not_convert=[])
    loaded = _load(tmp_path, transformers.AutoModelForMaskedLM, quantization_config=nothing_skipped)
    # the decoder shares the word embeddings' weight; the dense layer before it is free
    assert type(loaded.cls.predictions.decoder) is nn.Linear
    assert loaded.cls.predictions.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
    assert isinstance(loaded.cls.predictions.transform.dense, Linear8bit)


def test_save_pretrained_refuses_a_quantized_tied_linear(tmp_path):
    model = quantize(_model(transformers.BertForMaskedLM), "int8", skip=())
    with pytest.raises(ValueError, match=r"\['cls.predictions.decoder'\] share a tensor with another module"):
        model.save_pretrained(tmp_path)


def test_a_model_quantized_by_quantize_saves_with_save_pretrained(tmp_path):
    model = quantize(_model(), "int8-weight-only")
    assert isinstance(model.hf_quantizer, SlimformerHfQuantizer) and model.hf_quantizer.pre_quantized
    model.save_pretrained(tmp_path)
    reloaded = _load(tmp_path)
    _assert_same_state(reloaded, model)
    assert torch.equal(_output(reloaded), _output(model))


def test_load_quantized_reads_a_save_pretrained_directory(tmp_path, float_dir):
    quantized = _load(float_dir, quantization_config=SlimformerInt8Config("int8"))
    quantized.save_pretrained(tmp_path / "pretrained")
    loaded = load_quantized(_model(seed=3), tmp_path / "pretrained")
    assert loaded.config.quantization_config.modules == quantized_modules(quantized)
    assert torch.equal(_output(loaded), _output(quantized))
    save_quantized(quantized, tmp_path / "slimformer")  # and the other way round
    assert torch.equal(_output(load_quantized(_model(seed=4), tmp_path / "slimformer")), _output(quantized))


def test_load_quantized_says_which_loader_a_directory_needs(tmp_path, float_dir):
    with pytest.raises(ValueError, match=r"config.json has no slimformer quantization_config \(quant_method None\)"):
        load_quantized(_model(), float_dir)
    with pytest.raises(FileNotFoundError, match="neither slimformer_quantization.json .* nor config.json"):
        load_quantized(_model(), tmp_path)


def test_conversion_errors_name_the_module(tmp_path, caplog, monkeypatch):
    model = _model()
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[0, 0] = float("inf")
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # the load report, to caplog
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        transformers.AutoModel.from_pretrained(tmp_path, quantization_config=SlimformerInt8Config())
    assert "cannot quantize 'encoder.layer.1.output.dense': weight must be finite" in caplog.text


def test_dequantize_gives_back_float_linears():
    model = _model()
    quantized = quantize(copy.deepcopy(model), "int8", calibration=[_inputs(seed=2)])
    dequantized = quantized.dequantize()
    assert not quantized_modules(dequantized) and getattr(dequantized, "hf_quantizer", None) is None
    assert not hasattr(dequantized.config, "quantization_config")
    query, original = dequantized.encoder.layer[0].attention.self.query, model.encoder.layer[0].attention.self.query
    assert type(query) is nn.Linear and query.weight.dtype == torch.float32
    torch.testing.assert_close(query.weight, original.weight, atol=original.weight.abs().max().item() / 100, rtol=0)
    assert torch.equal(query.bias, original.bias)


def test_config_validates_its_arguments():
    with pytest.raises(ValueError, match=r"mode must be one of \(.*'bf16'\), got 'int4'"):
        SlimformerInt8Config("int4")
    with pytest.raises(TypeError, match="modules_to_not_convert must be a sequence of module names, got 'cls'"):
        SlimformerInt8Config(modules_to_not_convert="cls")
    with pytest.raises(ValueError, match=r"module 'pooler.dense' has mode 'int2'"):
        SlimformerInt8Config(modules={"pooler.dense": "int2"})
    with pytest.raises(ValueError, match=r"smoothed_modules must be 'int8' modules of the record"):
        SlimformerInt8Config(modules={"pooler.dense": "fp16"}, smoothed_modules=["pooler.dense"])
    with pytest.raises(ValueError, match="quant_method must be 'slimformer', got 'torchao'"):
        SlimformerInt8Config.from_dict({"quant_method": "torchao"})
    with pytest.raises(TypeError, match="quantization_config must be a SlimformerInt8Config, got dict"):
        SlimformerHfQuantizer({"quant_method": "slimformer"})
    config = SlimformerInt8Config("fp16", modules={"pooler.dense": "int8"}, smoothed_modules=["pooler.dense"])
    assert SlimformerInt8Config.from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()


def test_a_model_quantized_by_another_method_is_refused():
    model = _model()
    model.hf_quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="quantized by transformers with 'bitsandbytes'"):
        quantize(model, "int8")
    assert not quantized_modules(model)


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak resident memory from /proc")
def test_loading_a_saved_int8_model_never_holds_its_float_linears(tmp_path):
    # BERT-base's widths, two layers and a small vocabulary: 57 MB of fp32 Linear weights.
    from bench.quantized_load import measure, save_checkpoints

    config = transformers.BertConfig(
        hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072, vocab_size=1024
    )
    float_dir, int8_dir = save_checkpoints(config, tmp_path)
    int8, float_ = measure([("int8", str(int8_dir), None), ("float", str(float_dir), None)])
    linear_fp32_bytes = 4 * sum(
        m.in_features * m.out_features for m in transformers.BertModel(config).modules() if type(m) is nn.Linear
    )
    # The measure sees the model: loading the float model pages in all of its bytes.
    assert float_["peak_bytes"] >= 0.95 * float_["model_bytes"]
    # A saved int8 model loads into the int8 model and little else: the fp32 weights of its
    # quantized Linears, were a quarter of them ever allocated at once, would cross this.
    assert int8["peak_bytes"] <= int8["model_bytes"] + linear_fp32_bytes / 4
    assert int8["peak_bytes"] <= 0.5 * float_["peak_bytes"]
