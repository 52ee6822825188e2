"""What keeps quantization from giving silently wrong outputs: ``quantize`` and
``load_quantized`` leave the model in eval mode (a model quantized in training mode kept its
dropout on), and a slimformer int8 checkpoint that transformers loads in a process without
slimformer raises instead of loading int8 values into float Linears (tiny BERTs built from
configs, no download)."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimformer.quantize import load_quantized, quantize, quantized_modules, save_quantized, sqnr_db
from tests.helpers import TINY_BERT

transformers = pytest.importorskip("transformers")

from slimformer.transformers_quantizer import SlimformerInt8Config  # noqa: E402
from tests.test_quantize_transformers import NO_LOAD_ISSUES, _inputs  # noqa: E402

MODES = ["int8", "int8-weight-only", "fp16", "bf16"]


def _bert(cls=transformers.BertModel, seed=0):
    """A tiny BERT in training mode, with BERT's dropout (0.1)."""
    torch.manual_seed(seed)
    return cls(transformers.BertConfig(**TINY_BERT)).train()


def _hidden(model, batch=None):
    with torch.no_grad():
        return model(**(batch or _inputs())).last_hidden_state


def _assert_follows(quantized, float_model):
    """``quantized``, called as it is, follows ``float_model`` in eval mode as closely as
    test_quantize's fidelity bound asks (mean cosine > 0.999, SQNR > 30 dB)."""
    assert not float_model.training
    got, want = _hidden(quantized), _hidden(float_model)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1).mean().item()
    assert cosine > 0.999 and sqnr_db(got, want) > 30, (cosine, sqnr_db(got, want))


def _in_eval_mode(model):
    return not any(module.training for module in model.modules())


@pytest.mark.parametrize("mode", MODES)
def test_a_model_quantized_in_training_mode_gives_the_float_models_eval_outputs(mode):
    model = _bert()
    float_model = copy.deepcopy(model).eval()
    assert quantize(model, mode) is model
    assert _in_eval_mode(model)
    _assert_follows(model, float_model)


def test_smoothquant_calibration_of_a_training_model_leaves_it_in_eval_mode():
    model = _bert()
    float_model = copy.deepcopy(model).eval()
    quantize(model, "int8", calibration=[_inputs(seed=2)])
    assert _in_eval_mode(model)
    _assert_follows(model, float_model)


def test_a_refused_quantization_leaves_the_training_mode_as_it_was():
    model = _bert()
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize(model, "int4")
    assert all(module.training for module in model.modules())


def test_load_quantized_into_a_training_model_leaves_it_in_eval_mode(tmp_path):
    float_model = _bert().eval()
    quantized = quantize(copy.deepcopy(float_model), "int8")
    save_quantized(quantized, tmp_path)
    loaded = load_quantized(_bert(seed=3), tmp_path)
    assert _in_eval_mode(loaded)
    assert torch.equal(_hidden(loaded), _hidden(quantized))
    _assert_follows(loaded, float_model)


def test_quantized_on_load_the_model_is_in_eval_mode(tmp_path):
    float_model = _bert().eval()
    float_model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, quantization_config=SlimformerInt8Config("int8"))
    assert _in_eval_mode(loaded)
    _assert_follows(loaded, float_model)


# Runs in a fresh interpreter that never imports slimformer: prints how
# AutoModel.from_pretrained(argv[1]) ended, as JSON, on its last line.
_WITHOUT_SLIMFORMER = textwrap.dedent(
    """
    import json, sys
    import torch, transformers

    try:
        model = transformers.AutoModel.from_pretrained(sys.argv[1])
    except Exception as error:
        result = {"raised": type(error).__name__, "message": str(error)}
    else:
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        result = {"raised": None, "largest_weight": max(m.weight.abs().max().item() for m in linears)}
    result["slimformer_imported"] = any(name.partition(".")[0] == "slimformer" for name in sys.modules)
    print(json.dumps(result))
    """
)


def _load_without_slimformer(directory):
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_SLIMFORMER, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=directory,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["slimformer_imported"]
    return result, done.stderr


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_transformers_without_slimformer_refuses_an_int8_checkpoint(tmp_path, mode):
    model = quantize(_bert(transformers.BertModel), mode, skip=("pooler",))
    quantize(model, "fp16")  # a 16-bit layer beside the int8 ones
    model.save_pretrained(tmp_path)
    result, log = _load_without_slimformer(tmp_path)
    # never float Linears holding the int8 values (up to 127)
    assert result["raised"] == "RuntimeError", result
    assert "ignore_mismatched_sizes" in result["message"]
    assert "Unknown quantization type, got slimformer" in log
    assert "encoder.layer.{0, 1}.attention.self.query.weight" in log  # the load report's mismatched keys


def test_slimformer_loads_what_it_saved_as_before(tmp_path):
    model = quantize(_bert(transformers.BertModel), "int8", calibration=[_inputs(seed=2)])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["checkpoint_format"] == 2
    reloaded, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info == NO_LOAD_ISSUES
    query = reloaded.encoder.layer[0].attention.self.query
    assert query.weight.shape == (32, 32) and query.weight.dtype == torch.int8
    assert torch.equal(_hidden(reloaded), _hidden(model))
    assert torch.equal(_hidden(load_quantized(_bert(seed=3), tmp_path)), _hidden(model))


def test_a_checkpoint_of_the_earlier_layout_still_loads(tmp_path):
    # what save_pretrained wrote before checkpoint_format: int8 weights (out, in), no format in the record
    model = quantize(_bert(transformers.BertModel), "int8-weight-only")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    shapes = {
        f"{name}.weight": (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if hasattr(m, "out_features")
    }
    flat = [key for key, tensor in weights.items() if tensor.dtype == torch.int8]
    assert flat and all(weights[key].dim() == 1 for key in flat)
    save_file({k: v.view(shapes[k]) if k in flat else v for k, v in weights.items()}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["checkpoint_format"]
    (tmp_path / "config.json").write_text(json.dumps(config))

    reloaded, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info == NO_LOAD_ISSUES and quantized_modules(reloaded) == quantized_modules(model)
    assert torch.equal(_hidden(reloaded), _hidden(model))
    assert torch.equal(_hidden(load_quantized(_bert(seed=3), tmp_path)), _hidden(model))
    assert reloaded.config.quantization_config.checkpoint_format == 2  # saved again, it is flat


def test_an_unknown_checkpoint_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint_format must be one of \(1, 2\), got 3"):
        SlimformerInt8Config(checkpoint_format=3)
    quantize(_bert(transformers.BertModel), "int8").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: checkpoint_format must be one of \(1, 2\), got 3"):
        load_quantized(_bert(), tmp_path)
