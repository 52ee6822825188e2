"""slimformer.memory.report and ``python -m slimformer.memory``: numbers that agree with
``measure_activation_memory``, slimformer layers below torch's, the table, the sequence
sweep and its plot, and the command line end to end on a tiny HF BERT config."""

import copy
import gc
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import slimformer as sf
from slimformer.memory import ActivationMemory, measure_activation_memory
from slimformer.memory.cli import main
from slimformer.memory.report import MemoryReport, ModelMemory, activation_sweep, plot_activation_sweep, report

D_MODEL, HEADS, FFN, LAYERS = 64, 4, 128, 2
BATCH, SEQ = 2, 32
FP32 = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path saves what the kernels save, and is quicker


@pytest.fixture(autouse=True, scope="module")
def frozen_garbage_collector():
    """Every measurement runs gc.collect() twice; leaving out the objects made before the
    tests (torch, transformers) cuts each from ~0.2 s to microseconds."""
    gc.freeze()
    yield
    gc.unfreeze()


def _encoder(layer_class, device="cpu"):
    torch.manual_seed(0)
    layer = layer_class(D_MODEL, HEADS, FFN, dropout=0.1, activation="gelu", batch_first=True, device=device)
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).train()


@pytest.fixture(scope="module")
def encoders():
    return {"torch": _encoder(nn.TransformerEncoderLayer), "slimformer": _encoder(sf.TransformerEncoderLayer)}


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(1)
    return torch.randn(BATCH, SEQ, D_MODEL)


@pytest.fixture(scope="module")
def measured(encoders, x):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return sf.memory.report(encoders, x)


def _kept(memory: ActivationMemory) -> int:
    return max(memory.saved_bytes, memory.alive_bytes)


def test_parameters_gradients_and_adamw_state(encoders, measured):
    for column in measured.models:
        numel = sum(p.numel() for p in encoders[column.name].parameters())
        assert column.parameter_bytes == numel * FP32
        assert column.gradient_bytes == numel * FP32
        assert column.optimizer_bytes == 2 * numel * FP32


def test_activations_agree_with_measure_activation_memory(encoders, x, measured):
    for column in measured.models:
        model = encoders[column.name]
        whole = measure_activation_memory(model, x)
        assert (column.activations.saved_bytes, column.activations.alive_bytes) == (
            whole.saved_bytes,
            whole.alive_bytes,
        )
        # Each layer alone, on what it gets in the model: x, then layer 0's output (which requires grad).
        hidden = [x, model.layers[0](x).detach().requires_grad_()]
        assert [name for name, _ in column.layers] == ["layers.0", "layers.1"]
        for (name, kept), layer, h in zip(column.layers, model.layers, hidden):
            alone = measure_activation_memory(layer, h)
            assert (kept.saved_bytes, kept.alive_bytes) == (alone.saved_bytes, alone.alive_bytes), name
        assert column.rest_bytes == column.activation_bytes - sum(_kept(kept) for _, kept in column.layers)
        assert column.rest_bytes >= 0
        # CPU: a step peak (live tensor bytes) holding at least the activations, no time
        assert column.peak_bytes >= column.activations.alive_bytes > 0 and column.step_seconds is None


def test_slimformer_layers_keep_less_than_torch(measured):
    torch_column, slim_column = measured.models
    assert 0 < slim_column.activation_bytes < torch_column.activation_bytes / 2
    for (name, torch_layer), (_, slim_layer) in zip(torch_column.layers, slim_column.layers):
        assert 0 < _kept(slim_layer) < _kept(torch_layer), name
    assert slim_column.training_bytes < torch_column.training_bytes


def test_table(measured):
    text = str(measured)
    torch_column, slim_column = measured.models
    ratio = slim_column.activation_bytes / torch_column.activation_bytes
    for expected in (
        "Training memory on cpu",
        "torch",
        "slimformer",
        "parameters",
        "gradients",
        "AdamW state",
        "layers.0–1, each",  # both layers keep the same bytes, so they share a row
        "rest (embeddings, layer I/O, heads)",
        "activations (saved tensors)",
        "activations (alive)",
        f"{ratio:.2f}x",
        "training total",
        "exp_avg + exp_avg_sq in fp32",
    ):
        assert expected in text, expected
    words = " ".join(text.split())  # the notes wrap at the table's width
    assert "KiB" in text and "step peak, fwd+bwd" in text and "(CPU allocator events" in words
    assert "step time" not in text


def _cells(report: MemoryReport, label: str) -> list[str]:
    """The model columns of the table's row ``label``."""
    row = next(line for line in str(report).splitlines() if line.startswith(f"│ {label} "))
    return [cell.strip() for cell in row.split("│")[2:-1]]


def test_step_peak_says_when_adamw_update_sets_it(measured):
    # The encoders' activations at batch 2 x seq 32 outweigh their gradients: the forward+backward sets the peak.
    for column in measured.models:
        assert column.update_peak_bytes == column.peak_bytes and not column.update_sets_peak
    assert _cells(measured, "step peak set by") == ["fwd+bwd", "fwd+bwd"]
    # One wide Linear on one row keeps almost nothing: its gradients and AdamW's temporaries set the peak.
    wide = nn.Linear(512, 512)
    weight = wide.weight.detach().clone()
    result = sf.memory.report(wide, torch.randn(1, 512), progress=False)
    column = result.models[0]
    assert column.update_peak_bytes > column.peak_bytes >= column.gradient_bytes and column.update_sets_peak
    assert _cells(result, "step peak set by") == ["AdamW update"]
    assert torch.equal(wide.weight, weight)  # the update ran at learning rate 0


def test_layer_rows_collapse_only_equal_neighbours_and_units():
    def memory(kib):
        return ActivationMemory(kib * 1024, kib * 1024, (), ())

    layers = tuple((f"blocks.{i}", memory(kib)) for i, kib in enumerate([4, 4, 4, 8]))
    column = ModelMemory("m", "cpu", 2**20, 2**20, 2**21, memory(40), layers)
    text = str(MemoryReport((column,), "t"))
    assert "blocks.0–2, each" in text and "blocks.3 " in text
    assert "rest (embeddings, layer I/O, heads)" in text and "KiB" in text
    big = ModelMemory("m", "cpu", 2**30, 2**30, 2**31, memory(40), layers)
    assert "MiB" in str(MemoryReport((big,), "t"))


def test_single_model_input_forms_and_layers_argument(encoders, x):
    model = encoders["torch"]
    positional = sf.memory.report(model, x)
    keyword = sf.memory.report(model, {"src": x}, layers=["layers.1"], title="one layer")
    assert [column.name for column in positional.models] == ["model"]
    assert keyword.models[0].activations.saved_bytes == positional.models[0].activations.saved_bytes
    assert [name for name, _ in keyword.models[0].layers] == ["layers.1"]
    assert keyword.models[0].layers[0][1].saved_bytes == positional.models[0].layers[1][1].saved_bytes
    assert "one layer" in str(keyword) and "vs model" not in str(keyword)


def test_bad_arguments(encoders, x):
    model = encoders["torch"]
    with pytest.raises(ValueError, match=r"layers names no submodule of TransformerEncoder: \['layers.7'\]"):
        sf.memory.report(model, x, layers=["layers.7"])
    with pytest.raises(TypeError, match="layers must be a sequence of submodule names"):
        sf.memory.report(model, x, layers="layers.0")
    with pytest.raises(ValueError, match="non-empty dict"):
        sf.memory.report({}, x)

    class SkipsABlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(D_MODEL, D_MODEL), nn.Linear(D_MODEL, D_MODEL)])

        def forward(self, h):
            return self.blocks[0](h)

    with pytest.raises(ValueError, match=r"did not call the layers \['blocks.1'\]"):
        sf.memory.report(SkipsABlock(), x)


class _ReluTwice(nn.Module):
    """Keeps relu's output, (1, seq, 8) fp32; raises OutOfMemoryError from ``limit`` on."""

    def __init__(self, limit):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.limit = limit

    def forward(self, h):
        if h.shape[1] >= self.limit:
            raise torch.OutOfMemoryError("pretend")
        return self.linear(h).relu() * 2


def test_activation_sweep_and_plot(tmp_path):
    seqs = [4, 8, 16]
    fits, runs_out = _ReluTwice(limit=1000), _ReluTwice(limit=8)
    lines = []
    sweep = activation_sweep(
        {"fits": lambda: fits, "runs out": lambda: runs_out},
        lambda seq: torch.randn(1, seq, 8),
        seqs,
        log=lines.append,
    )
    assert sweep == {"fits": [seq * 8 * FP32 for seq in seqs], "runs out": [4 * 8 * FP32, None, None]}
    assert len(lines) == 5 and lines[3] == "seq     8  runs out               out of memory"  # then skipped
    path = tmp_path / "sweep.png"
    plot_activation_sweep(sweep, seqs, path, title="sweep")
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.fixture
def tiny_bert_config(tmp_path):
    path = tmp_path / "config.json"
    config = {
        "model_type": "bert",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        # Attention-dropout masks drawn by the CPU path's PyTorch Philox cost seconds even
        # here; the hidden dropout (0.1) stays on.
        "attention_probs_dropout_prob": 0.0,
    }
    path.write_text(json.dumps(config))
    return path


def test_cli_end_to_end_on_a_tiny_hf_config(tiny_bert_config, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    argv = ["--model", str(tiny_bert_config), "--batch", "1", "--seq", "32", "--recompute", "none", "full"]
    argv += ["--baseline", "eager", "sdpa", "--plot", str(png), "--max-seq", "128"]

    assert main(argv) == 0

    out = " ".join(capsys.readouterr().out.split())  # the title wraps at the table's width
    assert "batch 1 x seq 32, fp32" in out
    for expected in ("eager", "sdpa", "(none)", "(full)", "encoder.layer.0–1, each", "AdamW state", "wrote"):
        assert expected in out, expected
    assert "seq 128 slimformer (qkv+mlp)" in out  # the sweep covers every policy, past max_position_embeddings
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_cli_rejects_bad_arguments(tiny_bert_config, capsys):
    for argv, message in (
        (["--model", "gpt-9"], "--model must be one of ['bert-base', 'bert-large'] or a path to a config.json"),
        (["--model", str(tiny_bert_config), "--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
        (
            ["--model", str(tiny_bert_config), "--plot", "x.png", "--max-seq", "64"],
            "argument --max-seq: expected an integer >= 128",
        ),
        (["--recompute", "some"], "invalid choice: 'some'"),
        (["--model", str(tiny_bert_config), "--device", "gpu"], "--device: device must be a torch device"),
        *(
            [(["--model", str(tiny_bert_config), "--device", "cuda"], "--device: device 'cuda' needs CUDA")]
            if not torch.cuda.is_available()
            else []
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "slimformer.memory", "--model", "no/such/config.json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "usage: python -m slimformer.memory" in result.stderr
    assert "--model must be one of" in result.stderr


@pytest.mark.gpu
def test_cuda_peak_and_step_time():
    model = _encoder(sf.TransformerEncoderLayer, device="cuda")
    x = torch.randn(BATCH, SEQ, D_MODEL, device="cuda")
    measured = sf.memory.report(model, x)
    column = measured.models[0]
    assert column.device.startswith("cuda")
    assert column.peak_bytes >= column.activations.alive_bytes > 0  # all of them are allocated at the peak
    assert column.step_seconds > 0
    assert "step peak, fwd+bwd" in str(measured) and "step time" in str(measured)


def test_masked_lm_head_gets_its_own_row():
    # head + loss = the whole forward minus the base model measured alone; the fused
    # masked-LM loss of a patched model keeps far less there than HF's logits and softmax.
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=D_MODEL,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        vocab_size=500,
        max_position_embeddings=SEQ,
    )
    eager = BertForMaskedLM(config).train()
    ids = torch.randint(5, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(SEQ) % 7 == 0, ids, -100)
    models = {"eager": eager, "slimformer": sf.patch(copy.deepcopy(eager))}
    result = sf.memory.report(models, {"input_ids": ids, "labels": labels}, progress=False)
    for column, model in zip(result.models, models.values()):
        assert column.base[0] == "bert"
        alone = measure_activation_memory(model.bert, input_ids=ids)
        assert column.base[1].saved_bytes == alone.saved_bytes
        assert column.head_bytes == column.activation_bytes - max(alone.saved_bytes, alone.alive_bytes)
        layers = sum(max(m.saved_bytes, m.alive_bytes) for _, m in column.layers)
        assert column.rest_bytes == column.activation_bytes - layers - column.head_bytes >= 0
    eager_head, fused_head = (column.head_bytes for column in result.models)
    assert eager_head > BATCH * SEQ * 500 * FP32 > 4 * fused_head  # at least the logits vs a fraction of them
    text = str(result)
    assert "head + loss (all but bert)" in text and "rest (embeddings, layer I/O)" in text


def test_a_shared_layer_counts_every_application():
    # ALBERT applies one layer object num_hidden_layers times; its row sums every
    # application, each measured alone, so "rest" keeps only embeddings and layer I/O.
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=100,
        embedding_size=16,
        hidden_size=D_MODEL,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(5, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for model in (AlbertModel(config).train(), sf.patch(AlbertModel(config).train())):
        column = sf.memory.report(model, {"input_ids": ids}, progress=False).models[0]
        (name, memory), *others = column.layers
        assert not others and name == "encoder.albert_layer_groups.0 (applied 3×)"
        hidden_states = model.embeddings(input_ids=ids)
        once = measure_activation_memory(
            model.encoder.albert_layer_groups[0], model.encoder.embedding_hidden_mapping_in(hidden_states)
        )
        assert memory.saved_bytes == 3 * once.saved_bytes
        assert 0 <= column.rest_bytes < max(once.saved_bytes, once.alive_bytes)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_decoder_is_measured_without_its_kv_cache(attn):
    # A decoder's forward fills a KV cache by default; the forward that catches the layers' inputs must not,
    # or each layer measured alone attends to that cache too (eager: shapes disagree; sdpa: rows too large).
    # The truth: the same model told by its config never to make a cache.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=D_MODEL,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation=attn,
    )
    assert config.use_cache
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(5, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    column = report(model, {"input_ids": ids}, progress=False).models[0]
    model.config.use_cache = False
    truth = report(model, {"input_ids": ids}, progress=False).models[0]
    assert [name for name, _ in column.layers] == ["model.layers.0", "model.layers.1"]
    for (_, measured), (_, expected) in zip(column.layers, truth.layers):
        assert (measured.saved_bytes, measured.alive_bytes) == (expected.saved_bytes, expected.alive_bytes)
    assert column.activations.saved_bytes == truth.activations.saved_bytes
