"""Long commands show progress; partial benchmark reports get their own files; plots keep
coinciding lines visible and say what was timed; measure_activation_memory explains
how to pass a dict of inputs."""

import json

import pytest
import torch
from torch import nn

from slimformer.memory import measure_activation_memory
from slimformer.memory.cli import main as memory_main
from slimformer.memory.report import plot_activation_sweep, report, sweep_title


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


class _Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, input_ids, attention_mask=None):
        h = input_ids
        for layer in self.layers:
            h = layer(h).relu()
        return h


def test_measure_activation_memory_takes_a_dict_as_keywords_or_says_how():
    model = _Keywords()
    inputs = {"input_ids": torch.randn(2, 8, requires_grad=True), "attention_mask": None}
    with pytest.raises(TypeError, match=r"call measure_activation_memory\(model, \*\*inputs\)"):
        measure_activation_memory(model, inputs)
    kept = measure_activation_memory(model, **inputs)
    assert kept.saved_bytes > 0
    assert report(model, inputs, progress=False).models[0].activation_bytes == max(kept.saved_bytes, kept.alive_bytes)


def test_memory_report_shows_a_progress_bar(capsys):
    model = _Keywords()
    report({"a": model, "b": model}, {"input_ids": torch.randn(2, 8, requires_grad=True)})
    err = capsys.readouterr().err
    assert (
        "memory report" in err and "10/10" in err
    )  # 2 models x (2 layers + capture + forward+backward step + whole forward)


def test_memory_cli_shows_progress(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 32, "attention_probs_dropout_prob": 0.0,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert memory_main(["--model", str(tmp_path / "config.json"), "--batch", "1", "--seq", "16"]) == 0
    captured = capsys.readouterr()
    assert "measuring 2 models (eager, slimformer (none))" in " ".join(captured.out.split())
    assert "10/10" in captured.err and "slimformer (none): whole forward measured" in captured.err


def test_sweep_plot_keeps_coinciding_lines_visible(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = {}
    real_savefig = Figure.savefig

    def keep(figure, path, **kwargs):
        drawn["lines"] = figure.axes[0].get_lines()
        drawn["title"] = figure.axes[0].get_title()
        return real_savefig(figure, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    same = [2**20, 2**21, 2**22, 2**23]
    sweep = {"eager": same, "sdpa": same, "slimformer (none)": [2**18, 2**19, 2**20, 2**21]}
    title = sweep_title("BERT", 1, torch.float32, 0.1, torch.device("cpu"))
    plot_activation_sweep(sweep, [64, 128, 256, 512], tmp_path / "sweep.png", title=title)
    eager, sdpa, ours = drawn["lines"]
    assert eager.get_marker() != sdpa.get_marker()
    assert eager.get_markersize() > sdpa.get_markersize() and eager.get_markerfacecolor() == "none"
    assert eager.get_linestyle() == "--" and ours.get_linestyle() == "-"
    assert eager.get_zorder() < sdpa.get_zorder()
    for words in ("float32", "dropout 0.1", "cpu", "PyTorch reference path (CPU)"):
        assert words in drawn["title"]


def _benchmark(op, provider, size, seconds):
    return {
        "extra_info": {
            "family": "norm",
            "op": op,
            "mode": "fwd",
            "provider": provider,
            "implementation": "x",
            "sweep": "hidden",
            "hidden": size,
            "unit": "GB/s",
            "work": 1e6,
            "dtype": "float32",
        },
        "stats": {"data": [seconds] * 5},
    }


def test_bench_report_selection_and_partial_files(tmp_path):
    pytest.importorskip("matplotlib")
    from rich.console import Console

    from bench import report as bench_report

    chosen = bench_report.selection(["-k", "layer_norm and not rms"])
    assert chosen.partial and chosen.stem("cpu-x") == "cpu-x-partial-layer-norm-and-not-rms"
    assert not chosen.selects("norm_memory") and not chosen.selects("bert_memory eager")
    memory = bench_report.selection(["-k", "bert_memory and (eager or none)"])
    assert memory.selects("bert_memory eager") and memory.selects("bert_memory slimformer (none)")
    assert not memory.selects("bert_memory sdpa") and not memory.selects("norm_memory")
    assert not bench_report.selection(["--benchmark-min-rounds=3"]).partial

    machine = {
        "bench_device": "Test CPU", "bench_device_type": "cpu", "torch": "t", "triton": "t", "cuda": None,
        "python_version": "3", "torch_threads": 1,
    }  # fmt: skip
    data = {
        "machine_info": machine,
        "benchmarks": [
            _benchmark("layer_norm", provider, size, seconds)
            for size in (128, 768)
            for provider, seconds in (("slimformer", 2e-4), ("torch", 1e-4))
        ],
    }
    (tmp_path / "cpu-test-cpu.md").write_text("the full report\n")
    console = Console(width=bench_report.LOG_WIDTH, quiet=True)
    written = bench_report.write_report(data, [], console, chosen, tmp_path)
    stem = "cpu-test-cpu-partial-layer-norm-and-not-rms"
    assert [p.name for p in written] == [f"{stem}.md", f"{stem}-norm.png"]
    assert (tmp_path / "cpu-test-cpu.md").read_text() == "the full report\n"  # untouched
    text = written[0].read_text()
    assert "**Partial run** (`python -m bench.report -k layer_norm and not rms`)" in text
    assert "Activation memory" not in text and "Training memory of a BERT" not in text


def test_bench_plot_title_says_pytorch_reference_path_on_cpu(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from bench import report as bench_report

    titles = []
    monkeypatch.setattr(plt.Figure, "suptitle", lambda self, text, **kwargs: titles.append(text))
    results = bench_report.load_results([_benchmark("layer_norm", "torch", s, 1e-4) for s in (128, 256, 512, 768)])
    bench_report.plot(results, "Test CPU", "cpu", tmp_path / "norm.png")
    assert titles == ["norm (float32) on Test CPU - PyTorch reference path (CPU)"]
    assert [p.name for p in tmp_path.iterdir()] == ["norm.png"]  # the plot goes where it is asked to


def test_quantize_bert_shows_progress(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from examples import quantize_bert

    words = "the a of and to in is was it on for with at by cat dog rain sun music team bank".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=len(vocab)
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    quantize_bert.compare(tmp_path, sentences=quantize_bert.SENTENCES[:8], modes=("float", "int8"), repeats=1)
    err = capsys.readouterr().err
    total = 2 * 2 + quantize_bert.WARMUP + 1
    assert "quantize_bert" in err and f"{total}/{total}" in err
