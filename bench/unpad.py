"""Unpadded BERT fine-tuning and inference on the CPU: ``patch(model, unpad=True)`` vs padded.

The batch: 32 sentences whose token lengths are drawn (fixed seed) from a log-normal
distribution, median 62 tokens, clipped to [4, 128], padded to 128 (as a tokenizer with
``padding="max_length", max_length=128`` does): about half the tokens are padding.
The model: ``BertForSequenceClassification`` with BERT-base dims (hidden 768, 12 heads,
FFN 3072, vocab 30522), 2 layers, random weights, fp32, dropout 0.1, two labels. Columns:

* ``HF eager``, ``HF SDPA``: the model as transformers runs it (padded);
* ``slimformer padded``: ``slimformer.patch(model)``;
* ``slimformer unpadded``: ``slimformer.patch(model, unpad=True)``.

Measured in one process, one intra-op thread, the columns interleaved round after round
(A B C D, A B C D ...), process CPU time, median with min–max:

* kept activations: bytes saved for backward by the training forward
  (``slimformer.memory.measure_activation_memory``, the parameters excluded);
* training: forward + backward of the classification loss (the optimizer step, the
  same for every column, is left out), and tokens/s = real tokens / that time;
* inference: an eval forward under ``torch.no_grad``;
* loss curves: 50 SGD steps of a small model (hidden 128, 2 layers, dropout 0) on the
  same batch, padded vs unpadded patched: the largest difference of the losses.

INT8 inference (``slimformer.quantize(model, "int8")``: W8A8, per-token activation
scales; the pooler and classifier stay fp32), eval forwards under ``torch.no_grad``,
the columns interleaved in rounds of their own (4x as many: a round takes a second or
two, so more of them steady the medians): ``HF SDPA int8`` (the unpatched model
quantized), ``slimformer padded int8`` (patched, then quantized), ``slimformer unpadded
int8`` (``patch(unpad=True)``, then quantized) and ``slimformer unpadded fp32``; and the
difference of ``last_hidden_state`` between unpadded and padded int8 at the real tokens
(largest, and SQNR next to int8's own SQNR vs fp32). The Linears give each token the
same bits packed or padded (per-token scales); the attention's fp32 rounding differs
(varlen vs padded), which can move a rounding to int8 in the next Linear by one step.

Targets (issue 15): kept bytes of the unpadded model <= 1.1 x (real / padded tokens) x
the padded patched model's; training tokens/s >= 1.6x the padded patched model's,
inference likewise; identical loss curves.

    python -m bench.unpad [--rounds 5] [--layers 2]
"""

import argparse
import copy
import gc
import statistics
import time

from slimformer._cli_args import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.unpad", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--layers", type=positive_int, default=2)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from transformers import BertConfig, BertForSequenceClassification

from slimformer.memory import measure_activation_memory
from slimformer.patch import patch
from slimformer.quantize import quantize, sqnr_db

BATCH, MAX_LEN, SEED = 32, 128, 0
MEDIAN_LENGTH, SIGMA = 62, 0.5
KEPT_SLACK, SPEEDUP = 1.1, 1.6
COLUMNS = ("HF eager", "HF SDPA", "slimformer padded", "slimformer unpadded")
INT8_ROUNDS_PER_ROUND = 4
INT8_COLUMNS = ("HF SDPA int8", "slimformer padded int8", "slimformer unpadded int8", "slimformer unpadded fp32")
MiB = 2**20


def _patched(base, unpad: bool = False):
    """A patched copy of ``base`` on slimformer's attention (its layers get the (batch, seq)
    padding mask; ``patch`` keeps the model's own implementation)."""
    model = patch(copy.deepcopy(base), unpad=unpad)
    model.set_attn_implementation("slimformer")
    return model


def sentence_lengths(batch: int = BATCH, max_len: int = MAX_LEN, seed: int = SEED) -> list[int]:
    """Token lengths of ``batch`` sentences, log-normal around MEDIAN_LENGTH, in [4, max_len]."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(batch).log_normal_(torch.tensor(MEDIAN_LENGTH).log().item(), SIGMA, generator=generator)
    return lengths.round().clamp(4, max_len).int().tolist()


def padded_batch(config: BertConfig, lengths: list[int], max_len: int = MAX_LEN) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask (right padding to max_len) and labels."""
    generator = torch.Generator().manual_seed(SEED + 1)
    mask = (torch.arange(max_len) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, config.vocab_size, mask.shape, generator=generator).masked_fill(mask == 0, 0)
    labels = torch.randint(0, 2, (len(lengths),), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _config(layers: int, **overrides) -> BertConfig:
    dims = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
    return BertConfig(**{**dims, **overrides}, num_hidden_layers=layers, num_labels=2, max_position_embeddings=512)


def build_models(config: BertConfig) -> dict[str, torch.nn.Module]:
    """Column -> model, all with the same weights, in training mode."""
    torch.manual_seed(0)
    base = BertForSequenceClassification(config)
    models = {}
    for name, implementation in (("HF eager", "eager"), ("HF SDPA", "sdpa")):
        models[name] = copy.deepcopy(base)
        models[name].set_attn_implementation(implementation)
    base.set_attn_implementation("sdpa")
    models["slimformer padded"] = _patched(base)
    models["slimformer unpadded"] = _patched(base, unpad=True)
    return {name: model.train() for name, model in models.items()}


def build_inference_models(models: dict) -> dict[str, torch.nn.Module]:
    """INT8 column -> eval model, from ``build_models``' models (copied, same weights)."""
    sources = dict(zip(INT8_COLUMNS, ("HF SDPA", "slimformer padded", "slimformer unpadded", "slimformer unpadded")))
    inference = {}
    for name, source in sources.items():
        model = copy.deepcopy(models[source]).eval()
        inference[name] = model if name.endswith("fp32") else quantize(model, "int8")
    return inference


def int8_agreement(models: dict, int8_models: dict, inputs: dict) -> dict[str, float]:
    """How far unpadded int8 is from padded int8, next to int8's own error, on last_hidden_state at
    the real tokens: {"max": largest |unpadded - padded int8|, "sqnr": its SQNR in dB,
    "int8 sqnr": SQNR of padded int8 vs the padded fp32 patched model}."""
    real = inputs["attention_mask"].bool()
    runs = {"fp32": models["slimformer padded"].eval(), **int8_models}
    with torch.no_grad():
        states = {
            name: runs[name].bert(inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state[real]
            for name in ("fp32", "slimformer padded int8", "slimformer unpadded int8")
        }
    padded, unpadded = states["slimformer padded int8"], states["slimformer unpadded int8"]
    return {
        "max": (unpadded - padded).abs().max().item(),
        "sqnr": sqnr_db(unpadded, padded),
        "int8 sqnr": sqnr_db(padded, states["fp32"]),
    }


def kept_bytes(models: dict, inputs: dict) -> dict[str, int]:
    """Column -> bytes saved for backward by the training forward."""
    kept = {}
    for name, model in models.items():
        torch.manual_seed(0)
        kept[name] = measure_activation_memory(lambda m=model: m(**inputs).loss, exclude=model.parameters()).saved_bytes
    return kept


def _train_step(model, inputs) -> None:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def _infer(model, inputs) -> None:
    with torch.no_grad():
        model(**{k: v for k, v in inputs.items() if k != "labels"})


def interleaved_times(models: dict, inputs: dict, rounds: int, log=print) -> dict[str, dict[str, list[float]]]:
    """{"train": column -> CPU s per round, "infer": likewise}, one thread, interleaved."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {"train": {name: [] for name in models}, "infer": {name: [] for name in models}}
    try:
        for model in models.values():  # warm-up
            _train_step(model, inputs)
        for round_ in range(rounds):
            for name, model in models.items():
                for kind, run in (("train", _train_step), ("infer", _infer)):
                    model.train(kind == "train")
                    gc.collect()
                    start = time.process_time()
                    run(model, inputs)
                    times[kind][name].append(time.process_time() - start)
            log(f"round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times["train"].items()))
    finally:
        torch.set_num_threads(threads)
    return times


def interleaved_inference_times(models: dict, inputs: dict, rounds: int, log=print) -> dict[str, list[float]]:
    """Column -> CPU s of one eval forward per round, one thread, interleaved, after a warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {name: [] for name in models}
    try:
        for model in models.values():
            _infer(model, inputs)
        for round_ in range(rounds):
            for name, model in models.items():
                gc.collect()
                start = time.process_time()
                _infer(model, inputs)
                times[name].append(time.process_time() - start)
            log(f"int8 round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    finally:
        torch.set_num_threads(threads)
    return times


def loss_curves(steps: int = 50) -> tuple[list[float], list[float]]:
    """(padded, unpadded) losses of ``steps`` SGD steps of a small patched model, dropout 0."""
    config = _config(
        2,
        hidden_size=128,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=1000,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    inputs = padded_batch(config, sentence_lengths())
    torch.manual_seed(0)
    base = BertForSequenceClassification(config)
    curves = []
    for unpad in (False, True):
        model = _patched(base, unpad=unpad).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(losses)
    return curves[0], curves[1]


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def report_lines(layers: int = 2, rounds: int = 5, log=print) -> list[str]:
    """The benchmark's Markdown lines (measures everything)."""
    lengths = sentence_lengths()
    config = _config(layers)
    inputs = padded_batch(config, lengths)
    real = sum(lengths)
    fraction = real / (BATCH * MAX_LEN)
    models = build_models(config)
    kept = kept_bytes(models, inputs)
    times = interleaved_times(models, inputs, rounds, log)
    int8_models = build_inference_models(models)
    int8_times = interleaved_inference_times(int8_models, inputs, INT8_ROUNDS_PER_ROUND * rounds, log)
    agreement = int8_agreement(models, int8_models, inputs)
    padded_curve, unpadded_curve = loss_curves()
    curve_gap = max(abs(a - b) for a, b in zip(padded_curve, unpadded_curve))

    padded = "slimformer padded"
    lines = [
        f"Batch {BATCH}, padded to {MAX_LEN}: {real} real tokens of {BATCH * MAX_LEN} ({fraction:.1%}; lengths "
        f"{min(lengths)}–{max(lengths)}, median {statistics.median(lengths):.0f}). BertForSequenceClassification, "
        f"BERT-base dims, {layers} layers, fp32, dropout 0.1; CPU, one thread, {rounds} interleaved rounds, "
        "process CPU time, median (min–max):",
        "",
        "| | kept activations | train fwd+bwd s | train tokens/s | vs padded | inference s | vs padded |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in models:
        train, infer = times["train"][name], times["infer"][name]
        lines.append(
            f"| {name} | {kept[name] / MiB:,.1f} MiB | {_median(train)} | {real / statistics.median(train):,.0f} | "
            f"{statistics.median(times['train'][padded]) / statistics.median(train):.2f}x | {_median(infer)} | "
            f"{statistics.median(times['infer'][padded]) / statistics.median(infer):.2f}x |"
        )
    unpadded = "slimformer unpadded"
    kept_bound = KEPT_SLACK * fraction * kept[padded]
    train_speedup = statistics.median(times["train"][padded]) / statistics.median(times["train"][unpadded])
    infer_speedup = statistics.median(times["infer"][padded]) / statistics.median(times["infer"][unpadded])

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines += [
        "",
        f"- kept bytes: {kept[unpadded] / MiB:,.1f} MiB vs the target {KEPT_SLACK} x {fraction:.3f} x "
        f"{kept[padded] / MiB:,.1f} = {kept_bound / MiB:,.1f} MiB ({kept[unpadded] / (fraction * kept[padded]):.3f}"
        f" x the real-token share): {verdict(kept[unpadded] <= kept_bound)}",
        f"- training tokens/s: {train_speedup:.2f}x padded patched (target >= {SPEEDUP}x): "
        f"{verdict(train_speedup >= SPEEDUP)}",
        f"- inference: {infer_speedup:.2f}x padded patched (target >= {SPEEDUP}x): {verdict(infer_speedup >= SPEEDUP)}",
        f"- loss curves, 50 SGD steps (hidden 128, 2 layers, dropout 0, same batch): largest |difference| "
        f"{curve_gap:.2e} (losses {padded_curve[0]:.4f} -> {padded_curve[-1]:.4f}): {verdict(curve_gap < 1e-4)}",
    ]
    return lines + ["", *int8_lines(int8_times, agreement, INT8_ROUNDS_PER_ROUND * rounds)]


def int8_lines(times: dict[str, list[float]], agreement: dict[str, float], rounds: int) -> list[str]:
    """The INT8 inference table and its verdict."""
    hf, padded, unpadded = (statistics.median(times[name]) for name in INT8_COLUMNS[:3])
    lines = [
        f'INT8 inference (`slimformer.quantize(model, "int8")`, W8A8 per-token activation scales; pooler and '
        f"classifier fp32), same batch, eval forward under no_grad; {rounds} interleaved rounds of its own, "
        "process CPU time, median (min–max):",
        "",
        "| | inference s | vs padded int8 | vs HF SDPA int8 |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {_median(values)} | {padded / median:.2f}x | {hf / median:.2f}x |")
    speedup = padded / unpadded
    lines += [
        "",
        f"- INT8 inference: unpadded {speedup:.2f}x padded int8 (target >= {SPEEDUP}x, as fp32): "
        f"{'met' if speedup >= SPEEDUP else 'MISSED'}; unpadded int8 vs unpadded fp32: "
        f"{statistics.median(times['slimformer unpadded fp32']) / unpadded:.2f}x",
        f"- unpadded vs padded int8, last_hidden_state at the real tokens: largest |difference| "
        f"{agreement['max']:.2e}, SQNR {agreement['sqnr']:.1f} dB (int8's own error, padded int8 vs fp32: "
        f"SQNR {agreement['int8 sqnr']:.1f} dB)",
    ]
    return lines


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    print("\n".join(report_lines(args.layers, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
