"""The model part of the report: training memory of a HF BERT, eager vs every policy.

``slimformer.memory`` measures a ``BertModel`` with HF's eager and SDPA attention and a
``slimformer.patch``ed copy under each recompute policy, side by side, on the benchmark
device. On a GPU that is BERT-base (12 layers) at batch 32, seq 512 in bf16, with the
forward+backward peak and step time, checked against the target of issue 5: ``none``
at least as fast as HF with SDPA with less than half its activation memory. On a CPU it
is BERT-base with 2 layers at batch 1, seq 512 in fp32 (each layer keeps the same, so
the per-layer rows hold for 12), activations and the step peak (live tensor bytes), the
slimformer layers on their PyTorch path; ``bench/cpu_step.py`` measures a CPU training
step at larger sizes, with time. The plot sweeps the sequence length for every column.
"""

import gc
from pathlib import Path

import torch

from slimformer.memory.cli import bert_config, bert_inputs, bert_variants
from slimformer.memory.report import (
    MemoryReport,
    activation_sweep,
    measure_model,
    plot_activation_sweep,
    progress_bar,
    sweep_title,
)
from slimformer.recompute import POLICIES

BASELINES = ("eager", "sdpa")
# device type -> (layers, batch, seq, dtype, sweep lengths)
SETTINGS = {
    "cuda": (12, 32, 512, torch.bfloat16, (128, 256, 512, 1024, 2048, 4096)),
    "cpu": (2, 1, 512, torch.float32, (64, 128, 256, 512)),
}
TARGET_POLICY, TARGET_BASELINE = "slimformer (none)", "sdpa"
TARGET_ACTIVATION_FRACTION = 0.5


def _target_lines(report: MemoryReport) -> list[str]:
    columns = {m.name: m for m in report.models}
    ours, sdpa = columns[TARGET_POLICY], columns[TARGET_BASELINE]
    fraction = ours.activation_bytes / sdpa.activation_bytes
    speed = sdpa.step_seconds / ours.step_seconds
    met = fraction < TARGET_ACTIVATION_FRACTION and speed >= 1.0
    return [
        f"- target, `none` vs HF SDPA: activations {fraction:.2f}x (< {TARGET_ACTIVATION_FRACTION}x), "
        f"step {speed:.2f}x as fast (>= 1.00x): **{'met' if met else 'NOT met'}**"
    ]


def bert_memory_section(device: torch.device, plot_path: Path, log=print, selected=lambda name: True) -> list[str]:
    """Measure, write the sweep plot to ``plot_path``, and return the markdown lines.

    ``selected(column name)`` picks the columns (``bench.report -k``); none selected: no
    section (an empty list)."""
    layers, batch, seq, dtype, sweep_seqs = SETTINGS[device.type]
    config = bert_config("bert-base")
    config.num_hidden_layers = layers
    baselines = [name for name in BASELINES if selected(name)]
    policies = [policy for policy in POLICIES if selected(f"slimformer ({policy})")]
    if not baselines and not policies:
        return []
    variants = bert_variants(config, 0, max(seq, *sweep_seqs), dtype, device, baselines, policies)
    inputs = bert_inputs(config, batch, seq, device)
    measured = []
    models = {name: ready() for name, ready in variants.items()}
    log(f"BERT memory: measuring {', '.join(models)}")
    with progress_bar(models) as step:
        for name, ready in variants.items():
            measured.append(measure_model(ready(), inputs, name=name, progress=step))
    title = f"BERT-base dims, {layers} layers, batch {batch} x seq {seq}, {str(dtype).removeprefix('torch.')}, training"
    report = MemoryReport(tuple(measured), title)
    gc.collect()
    sweep = activation_sweep(variants, lambda s: bert_inputs(config, batch, s, device), sweep_seqs, log=log)
    plot_title = sweep_title(f"BERT-base dims, {layers} layers", batch, dtype, config.hidden_dropout_prob, device)
    plot_activation_sweep(sweep, sweep_seqs, plot_path, title=plot_title)
    lines = [
        f"## Training memory of a BERT ({device.type})",
        "",
        "`slimformer.memory.report`: HF `BertModel` with eager and SDPA attention vs a `slimformer.patch`ed copy "
        f"under each recompute policy (dropout 0.1). Activation memory vs sequence length: `{plot_path.name}`.",
        "",
        "```text",
        *(line.rstrip() for line in str(report).strip("\n").splitlines()),
        "```",
    ]
    if device.type == "cuda" and {TARGET_POLICY, TARGET_BASELINE} <= set(variants):
        lines += ["", *_target_lines(report)]
    return lines
