"""slimformer.quantize on a small HF BERT built from a config (no download) and on toy models."""

import copy
import importlib
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.quantize import (
    calibrate_activations,
    fidelity_report,
    load_quantized,
    quantize,
    quantized_modules,
    save_quantized,
    smoothing_factors,
    sqnr_db,
)

transformers = pytest.importorskip("transformers")

MODES = ["int8", "int8-weight-only", "fp16", "bf16"]
LINEARS_PER_LAYER = 6  # query, key, value, attention output, intermediate, output


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    return transformers.BertModel(config).eval()


def batches(count=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 100, (3, 11), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, 7:] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def hidden(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def test_quantize_replaces_encoder_linears_and_keeps_the_rest_float():
    model = tiny_bert()
    assert quantize(model, "int8") is model
    modules = quantized_modules(model)
    assert len(modules) == 2 * LINEARS_PER_LAYER + 1 and set(modules.values()) == {"int8"}
    assert all(name.startswith("encoder.layer.") for name in modules if name != "pooler.dense")
    assert isinstance(model.pooler.dense, Linear8bit)  # as quantize_dynamic quantizes it
    assert type(model.embeddings.word_embeddings) is nn.Embedding
    assert type(model.encoder.layer[0].output.LayerNorm) is nn.LayerNorm


@pytest.mark.parametrize("mode", MODES)
def test_quantized_bert_follows_the_float_model(mode):
    model = tiny_bert()
    quantized = quantize(copy.deepcopy(model), mode)
    report = fidelity_report(model, quantized, batches(1))
    assert set(report.layer_sqnr_db) == set(quantized_modules(quantized))
    assert report.min_layer_sqnr_db > 30
    assert report.mean_cosine > 0.999 and report.output_sqnr_db > 30
    assert "min SQNR" in str(report)


def test_bert_output_is_the_pytorch_references_on_every_backend(backend):
    model = quantize(tiny_bert(), "int8", calibration=batches(1), smooth_alpha=0.5)
    batch = batches(1)[0]
    torch.testing.assert_close(hidden(model, batch), _reference_hidden(model, batch), rtol=1e-4, atol=1e-4)


def _reference_hidden(model, batch):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        return hidden(model, batch)


@pytest.mark.parametrize("skip", [("encoder.layer.1", "pooler"), lambda name, m: not name.endswith("query")])
def test_skip_by_names_or_predicate(skip):
    model = quantize(tiny_bert(), "int8-weight-only", skip=skip)
    names = set(quantized_modules(model))
    if callable(skip):
        assert names == {f"encoder.layer.{i}.attention.self.query" for i in range(2)}
    else:
        assert len(names) == LINEARS_PER_LAYER and all(n.startswith("encoder.layer.0.") for n in names)


def test_head_is_quantized_when_skip_is_empty():
    model = quantize(tiny_bert(), "fp16", skip=())
    assert isinstance(model.pooler.dense, Linear16bit)


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trips_through_safetensors(tmp_path, mode):
    calibration = batches(2) if mode == "int8" else None
    model = quantize(tiny_bert(), mode, calibration=calibration)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    fresh = quantize(tiny_bert(seed=1), mode)
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    batch = batches(1, seed=3)[0]
    assert torch.equal(hidden(fresh, batch), hidden(model, batch))


def test_save_and_load_helpers(tmp_path):
    model = quantize(tiny_bert(), "int8", calibration=batches(1), skip=("pooler",))
    quantize(model, "fp16", skip=lambda name, m: name != "pooler.dense")
    save_quantized(model, tmp_path)
    assert (tmp_path / "slimformer_quantization.json").exists()
    smooth = load_file(tmp_path / "model.safetensors")["encoder.layer.0.attention.self.query.smooth"]
    assert torch.equal(smooth, model.encoder.layer[0].attention.self.query.smooth)
    loaded = load_quantized(tiny_bert(seed=2), tmp_path)
    assert quantized_modules(loaded) == quantized_modules(model)
    batch = batches(1, seed=4)[0]
    assert torch.equal(hidden(loaded, batch), hidden(model, batch))
    assert torch.equal(loaded(**batch).pooler_output, model(**batch).pooler_output)


def test_loading_a_state_dict_of_another_mode_raises():
    saved = quantize(tiny_bert(), "int8-weight-only").state_dict()
    fresh = quantize(tiny_bert(), "int8")
    with pytest.raises(RuntimeError, match="saved from a 'int8-weight-only' layer, but this layer is 'int8'"):
        fresh.load_state_dict(saved)


def test_smoothquant_helps_activations_with_outlier_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48)).eval()
    scale = torch.ones(64)
    scale[:3] = 60.0  # a few channels far larger than the rest, as after LayerNorm in BERT
    inputs = [torch.randn(16, 64) * scale for _ in range(4)]
    plain = quantize(copy.deepcopy(model), "int8")
    smoothed = quantize(copy.deepcopy(model), "int8", calibration=[(x,) for x in inputs])
    plain_sqnr = fidelity_report(model, plain, inputs).layer_sqnr_db["0"]
    smoothed_sqnr = fidelity_report(model, smoothed, inputs).layer_sqnr_db["0"]
    assert smoothed_sqnr > plain_sqnr + 3


def test_smoothing_factors_balance_activation_and_weight_ranges():
    activation_max = torch.tensor([100.0, 1.0, 0.0, 4.0])
    weight = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.5, -1.0, 2.0, 0.0]])
    smooth = smoothing_factors(activation_max, weight, alpha=0.5)
    assert torch.allclose(smooth, torch.tensor([1 / 10.0, 1.0, 1.0, 1.0]))


def test_bad_arguments_raise_and_leave_the_model_unchanged():
    model = tiny_bert()
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize(model, "int4")
    with pytest.raises(ValueError, match="no torch.nn.Linear left to quantize"):
        quantize(nn.Sequential(nn.ReLU()), "int8")
    with pytest.raises(ValueError, match="no torch.nn.Linear left to quantize"):
        quantize(model, "int8", skip=lambda name, m: True)
    with pytest.raises(ValueError, match="calibration yielded no batch"):
        quantize(model, "int8", calibration=iter([]))
    with pytest.raises(ValueError, match="smooth_alpha needs calibration"):
        quantize(model, "int8", smooth_alpha=0.5)
    with pytest.raises(ValueError, match="smooth_alpha must be in"):
        quantize(model, "int8", calibration=batches(1), smooth_alpha=1.5)
    with pytest.raises(ValueError, match="apply to mode 'int8' only"):
        quantize(model, "int8-weight-only", calibration=batches(1))
    with pytest.raises(TypeError, match="skip must be a sequence of module names or a callable"):
        quantize(model, "int8", skip="pooler")
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize 'encoder.layer.1.output.dense'.*finite"):
        quantize(model, "int8")
    assert not quantized_modules(model)
    assert model.training is False


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only", "fp16"])
def test_non_finite_bias_is_refused(mode):
    model = tiny_bert()
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.bias[3] = float("inf")
    with pytest.raises(ValueError, match="cannot quantize 'encoder.layer.0.attention.self.query'.*bias must be finite"):
        quantize(model, mode)
    assert not quantized_modules(model)


class _SharedLinear(nn.Module):
    """One Linear registered under two names, used twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.second = self.first
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.second(torch.relu(self.first(x))))


def test_a_shared_linear_is_converted_once_under_every_name(tmp_path):
    model = quantize(_SharedLinear(), "int8", skip=())
    assert model.first is model.second and quantized_modules(model) == dict.fromkeys(["first", "second", "out"], "int8")
    x = torch.randn(5, 8)
    save_quantized(model, tmp_path)
    loaded = load_quantized(_SharedLinear(), tmp_path)
    assert loaded.first is loaded.second
    assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match="skipped under some of its names only"):
        quantize(_SharedLinear(), "int8", skip=("second",))


def test_a_failed_load_leaves_the_model_untouched(tmp_path):
    save_quantized(quantize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), "int8", skip=()), tmp_path)
    wider = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16))
    before = copy.deepcopy(wider.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_quantized(wider, tmp_path)
    assert not quantized_modules(wider)
    assert all(torch.equal(wider.state_dict()[k], v) for k, v in before.items())


def test_calibration_must_reach_every_linear():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    model = Unused()
    with pytest.raises(ValueError, match=r"calibration never reached these Linears: \['unused'\]"):
        quantize(model, "int8", calibration=[torch.randn(2, 4)])
    assert type(model.used) is nn.Linear


def test_calibration_restores_training_mode_and_removes_hooks():
    model = tiny_bert().train()
    query = model.encoder.layer[0].attention.self.query
    calibrate_activations(model, {"encoder.layer.0.attention.self.query": query}, batches(1))
    assert model.training and model.encoder.layer[0].training
    assert all(not m._forward_pre_hooks for m in model.modules())
    quantize(model, "int8", calibration=batches(1))  # which then leaves the model in eval mode
    assert not any(m.training for m in model.modules())
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_backward_through_a_quantized_model_raises():
    model = quantize(tiny_bert(), "int8")
    with pytest.raises(RuntimeError, match="inference-only"):
        model(**batches(1)[0]).last_hidden_state.sum().backward()


def test_loader_rejects_another_architecture(tmp_path):
    save_quantized(quantize(tiny_bert(), "int8"), tmp_path)
    with pytest.raises(ValueError, match="not the architecture that was saved"):
        load_quantized(nn.Sequential(nn.Linear(4, 4)), tmp_path)
    with pytest.raises(ValueError, match="no slimformer quantized layer"):
        save_quantized(tiny_bert(), tmp_path / "float")


def _saved_sequential(tmp_path):
    model = quantize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), "int8", skip=())
    save_quantized(model, tmp_path)
    return model


def _fresh_sequential():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def test_loader_refuses_a_tensor_of_another_dtype(tmp_path):
    _saved_sequential(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    scale_key = next(k for k in state if k.startswith("0.") and state[k].is_floating_point() and "scale" in k)
    state[scale_key] = (state[scale_key] * 1000).to(torch.int32)
    save_file(state, tmp_path / "model.safetensors")
    fresh = _fresh_sequential()
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(
        RuntimeError,
        match=rf"model.safetensors: module '0': {scale_key[2:]} is torch.int32, the layer's is torch.bfloat16 or torch.float32",
    ):
        load_quantized(fresh, tmp_path)
    assert not quantized_modules(fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_loader_reads_the_first_format(tmp_path):
    # Files written before the scales were bfloat16 values: fp32 scales, an all-ones smooth.
    model = _saved_sequential(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    for layer in ("0", "2"):
        state[f"{layer}.weight_scale"] = state[f"{layer}.weight_scale"].float()
        state[f"{layer}.smooth"] = torch.ones(8)
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_quantized(_fresh_sequential(), tmp_path)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize(
    "damage", ["truncated_weights", "corrupt_config", "config_is_a_list", "unknown_mode", "file_path"]
)
def test_load_errors_name_the_file_and_leave_the_model_untouched(tmp_path, damage):
    _saved_sequential(tmp_path)
    weights, config = tmp_path / "model.safetensors", tmp_path / "slimformer_quantization.json"
    directory, error, message = tmp_path, ValueError, None
    if damage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:100])
        message = rf"{weights}: cannot read the quantized weights"
    elif damage == "corrupt_config":
        config.write_text(config.read_text()[:20])
        message = rf"{config}: cannot read the slimformer quantization config"
    elif damage == "config_is_a_list":
        config.write_text("[1, 2]")
        message = rf"{config} is not a slimformer quantization config"
    elif damage == "unknown_mode":
        config.write_text(config.read_text().replace('"0": "int8"', '"0": "int4"'))
        message = rf"{config}: module '0' has mode 'int4'"
    else:
        directory, message = weights, rf"needs the directory save_quantized wrote, got '{weights}' \(a file\)"
    fresh = _fresh_sequential()
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(error, match=message):
        load_quantized(fresh, directory)
    assert not quantized_modules(fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_arguments_of_the_wrong_type_raise_type_errors_naming_them(tmp_path):
    model = quantize(tiny_bert(), "int8")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        load_quantized("model", tmp_path)
    with pytest.raises(TypeError, match="directory must be a str or pathlib.Path, got int"):
        load_quantized(tiny_bert(), 3)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got OrderedDict"):
        save_quantized(model.state_dict(), tmp_path)
    with pytest.raises(TypeError, match="directory must be a str or pathlib.Path, got NoneType"):
        save_quantized(model, None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        quantized_modules("model")
    with pytest.raises(TypeError, match="quantized_model must be a torch.nn.Module, got str"):
        fidelity_report(tiny_bert(), "quantized", batches(1))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        calibrate_activations("model", {}, batches(1))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got list"):
        smoothing_factors(torch.ones(2), [[1.0, 2.0]], alpha=0.5)
    with pytest.raises(TypeError, match="exact must be a torch.Tensor, got float"):
        sqnr_db(torch.ones(2), 1.0)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("calibrated", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_torch_compile_of_a_quantized_model_runs_the_fused_ops_in_one_graph(monkeypatch, mode, calibrated):
    # torch.compile traces the quantized layers without a graph break (no host read of the
    # smoothing buffer, no inference-mode test) and calls the CPU loops as ops: the eager bits
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = dict(calibration=batches(1), smooth_alpha=0.5) if calibrated and mode == "int8" else {}
    model = quantize(tiny_bert(), mode, **kwargs)
    batch = batches(1)[0]
    with torch.no_grad():
        x = model.embeddings(input_ids=batch["input_ids"])
    layer = model.encoder.layer[0]
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # raises at a graph break
    with torch.no_grad():
        eager, ours = layer(x), compiled(x)
    eager, ours = (out[0] if isinstance(out, tuple) else out for out in (eager, ours))
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_int8_warns_once_where_it_is_slower_than_fp32(monkeypatch):
    # without VNNI or AMX an exact int8 GEMM is no faster than fp32: one warning per process,
    # naming the CPU's ISA and what is faster
    from slimformer.kernels import int8_cpu

    quantize_module = importlib.import_module("slimformer.quantize")

    monkeypatch.setattr(quantize_module, "_warned_int8_is_slow", False)
    monkeypatch.setattr(int8_cpu, "int8_gemm_is_fast", lambda: False)
    with pytest.warns(UserWarning, match=r"'int8' on this CPU \(.+\) is slower than fp32.*'int8-weight-only'"):
        quantize(tiny_bert(), "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(tiny_bert(), "int8")  # once
        quantize(tiny_bert(), "int8-weight-only")
    monkeypatch.setattr(quantize_module, "_warned_int8_is_slow", False)
    monkeypatch.setattr(int8_cpu, "int8_gemm_is_fast", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(tiny_bert(), "int8")


@pytest.mark.parametrize("mode", ["int8", "int8-weight-only"])
def test_a_model_quantized_in_inference_mode_runs(monkeypatch, mode):
    # its buffers are inference tensors, which have no version counter to check
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled CPU path, which checks them
    with torch.inference_mode():
        model = quantize(tiny_bert(), mode)
        out = model(**batches(1)[0]).last_hidden_state
    torch.testing.assert_close(out, hidden(quantize(tiny_bert(), mode), batches(1)[0]), rtol=0, atol=0)


def test_load_state_dict_swaps_weights_after_a_forward(monkeypatch):
    # the int8 GEMM's packing cache holds a weak reference to each weight, which
    # torch.utils.swap_tensors refuses: the layers drop it before a load or a .to
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled CPU path, which packs
    model = quantize(tiny_bert(), "int8")
    hidden(model, batches(1)[0])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(state)
        hidden(model, batches(1)[0])
        model.to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    torch.testing.assert_close(hidden(model, batches(1)[0]), hidden(quantize(tiny_bert(), "int8"), batches(1)[0]))
