"""Run the benchmarks in bench/ and report them: ``python -m bench.report``.

    python -m bench.report                          # the quick run (make bench): a few minutes
    python -m bench.report --full                   # everything (make bench ARGS=--full): tens of minutes
    python -m bench.report -k add_layer_norm        # a partial run: what -k selects from everything
    python -m bench.report -k norm -- --benchmark-min-rounds=3   # after --: more pytest arguments
    python -m bench.report --out DIR [--overwrite]  # write elsewhere / replace files of the same names

The quick run, the default, is one size of one op and mode of each kernel family against
its baselines (``QUICK_BENCHMARKS``) and the memory sections (``QUICK_SECTIONS``), named
``<device-slug>-quick*``; ``--full`` runs every benchmark and section. It runs pytest on
bench/ in a subprocess with ``--benchmark-json`` (which keeps every
round's time), then prints one table per family/op/mode with rich and writes, into
``bench/results/local/`` (git-ignored) unless ``--out DIR`` names another folder,

    <device-slug>.md            header, tables, targets, memory, skipped benchmarks
    <device-slug>-<family>.png  metric vs the swept size, per op and mode
    <device-slug>-bert-memory.png  a BERT's activation memory vs sequence length
    <device-slug>-int8.png  INT8 inference of all-MiniLM-L6-v2: latency and fidelity per mode

and, on a CPU, the unpadded-BERT section (``bench.unpad``, selected as ``-k unpad``).
The committed reference results are in ``bench/results/``: a run replaces no file that
exists in its folder unless ``--overwrite`` is given (it checks before running), and
prints the files it wrote.

Its own options are parsed first (``--help`` prints them and runs nothing); ``-k EXPR``
and ``-m MARKEXPR`` go on to pytest, as do test paths and, after ``--``, any other
pytest argument. A run that selects benchmarks (``-k``, ``-m`` or test paths) is
partial: its files are named ``<device-slug>-partial-<selection>*`` and the full report
is left as it is. ``-k`` also selects the memory sections, matched like a test name:
the norm table as ``norm_memory``, the torch.compile section (CPU) as
``compile_memory``, each column of the BERT section as ``bert_memory <column>``
(``-k "bert_memory and not sdpa"``, ``-k "bert_memory and (eager or none)"``), the
masked-LM section (``bench/mlm_memory.py``) as ``mlm_memory``.

The report knows no family: each benchmark's ``extra_info`` names its ``family``,
``op``, ``mode``, ``provider``, ``implementation``, the swept parameter (``sweep``, e.g.
"hidden") and its value, and the ``work`` one call does in terms of its metric's
``unit`` ("GB/s": bytes, "TFLOP/s": FLOPs), so the metric is work / median time. On a
GPU it also checks the norm targets (``TARGET``) and the attention targets
(``ATTENTION_TARGETS``).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from slimformer.layers.policies import POLICIES
from tools.results import ROOT, add_output_arguments, refuse_to_replace, shown

# One plot per family, named after its benchmark file, bench/test_<family>_bench.py.
FAMILIES = tuple(sorted(p.name[len("test_") : -len("_bench.py")] for p in ROOT.glob("bench/test_*_bench.py")))
UNIT_SCALE = {"GB/s": 1e9, "TFLOP/s": 1e12}
# A table gets a "vs X" column for each of these providers that it has.
BASELINES = ("torch", "torch.compile", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")
# Peak HBM bandwidth in bytes/s, by a substring of torch.cuda.get_device_name (first match).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12}
# Fused add + LayerNorm, forward + backward: >= 1.5x torch eager and >= 80% of peak bandwidth.
TARGET = {"family": "norm", "op": "add_layer_norm", "mode": "full", "provider": "slimformer"}
TARGET_SIZES = (768, 8192)
TARGET_SPEEDUP = 1.5
TARGET_PEAK_FRACTION = 0.8
# slimformer attention at head dim 128 and seq >= 4096, causal or not, on an H100/H200:
# mode -> (least ratio to the fastest baseline (SDPA backend) of the same size, least TFLOP/s).
ATTENTION_TARGETS = {"fwd": (1.0, 350.0), "bwd": (0.8, None)}
ATTENTION_TARGET_OPS = ("d128 non-causal", "d128 causal")
ATTENTION_TARGET_MIN_SEQ = 4096
ATTENTION_TARGET_DEVICES = ("H100", "H200")


@dataclass
class Result:
    """One benchmark: what ran, its 20/50/80th percentile times (s) and its metric."""

    family: str
    op: str
    mode: str
    provider: str
    implementation: str
    sweep: str
    size: int
    p20: float
    p50: float
    p80: float
    unit: str
    metric: float
    peak_memory_mib: float | None
    ratio: dict[str, float] = field(default_factory=dict)  # baseline median / this median
    dtype: str = ""

    @property
    def table_key(self) -> tuple[str, str, str]:
        return self.family, self.op, self.mode


# The report's sections besides the benchmarks, as -k names them (and "bert_memory <column>"); the
# last three run on a CPU only.
SECTIONS = ("norm_memory", "mlm_memory", "int8_inference", "cpu_step", "unpad", "compile_memory")
# The quick run (the default, make bench): per device type, one size of one op and mode of each
# kernel family, every provider of it (pytest -k over the benchmarks' ids), and of the sections
# the memory ones, norm_memory and bert_memory; --full runs everything.
QUICK_BENCHMARKS = {
    "cpu": "add_layer_norm-full-768 or d32-non-causal-full-seq128 or linear-256x384-256",
    "cuda": "add_layer_norm-full-4096 or d128-causal-fwd-seq4096 or linear-768x3072-4096",
}
QUICK_SECTIONS = ("norm_memory", "bert_memory")
LOG_WIDTH = 120  # the console width when the output is a log, not a terminal
_NO_TESTS_COLLECTED = 5  # pytest's exit code when the selection leaves no benchmark


@dataclass(frozen=True)
class Selection:
    """Which part of the report a run makes, from its pytest arguments."""

    keyword: str | None  # -k EXPR
    partial: bool  # -k, -m or paths given: the run writes its own files
    tag: str  # file-name part of a partial run
    arguments: str = ""  # the pytest arguments, as given
    quick: bool = False  # no selection and no --full: QUICK_BENCHMARKS and QUICK_SECTIONS

    def selects(self, name: str) -> bool:
        """Whether ``-k`` selects ``name`` (a memory section and column), matched as pytest matches a test."""
        if self.quick:
            return name.split()[0] in QUICK_SECTIONS
        if self.keyword is None:
            return True
        from _pytest.mark.expression import Expression

        text = name.lower()
        return Expression.compile(self.keyword).evaluate(lambda ident, **kwargs: ident.lower() in text)

    def stem(self, slug: str) -> str:
        if self.quick:
            return f"{slug}-quick"
        return f"{slug}-partial-{self.tag}" if self.partial else slug


def selection(pytest_args: list[str], quick: bool = False) -> Selection:
    """The -k / -m expressions and test paths among ``pytest_args``; ``quick`` (no --full) makes a
    run without any of them the quick one."""
    keyword = marker = None
    paths = []
    args = iter(pytest_args)
    for arg in args:
        if arg in ("-k", "-m"):
            value = next(args, "")
        elif arg.startswith(("-k", "-m")) and not arg.startswith("--"):
            value = arg[2:].lstrip("=")
        else:
            if not arg.startswith("-"):
                paths.append(arg)
            continue
        if arg.startswith("-k"):
            keyword = value
        else:
            marker = value
    parts = [p for p in (keyword, marker, *paths) if p]
    tag = re.sub(r"[^A-Za-z0-9]+", "-", "-".join(parts)).strip("-").lower()[:60] or "selection"
    return Selection(keyword, bool(parts), tag, " ".join(pytest_args), quick=quick and not parts)


def run_benchmarks(json_path: Path, pytest_args: list[str]) -> list[str]:
    """Run pytest on bench/, streaming its output; return the reasons of skipped benchmarks.

    TRITON_INTERPRET is dropped: the interpreter is for tests, and timing it means nothing.
    A selection that leaves no benchmark writes no JSON (the memory sections may still run).
    """
    command = [sys.executable, "-m", "pytest", "bench", "-p", "no:xdist", "-p", "no:cacheprovider", "-rs"]
    command += ["--benchmark-quiet", f"--benchmark-json={json_path}", *pytest_args]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    skipped = []
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    with subprocess.Popen(command, cwd=ROOT, env=env, **output) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if match := re.match(r"SKIPPED \[\d+\] (.*)", line):
                skipped.append(match.group(1).strip())
    if proc.returncode == _NO_TESTS_COLLECTED:
        print("no benchmark selected; only the memory sections the selection names run", flush=True)
    elif proc.returncode != 0:
        sys.exit(f"pytest failed (exit code {proc.returncode}); no report written")
    return skipped


def load_results(benchmarks: list[dict]) -> list[Result]:
    """Results from pytest-benchmark's JSON, with ratios against the baselines of the same run."""
    import numpy as np

    results = []
    for bench in benchmarks:
        info = bench["extra_info"]
        p20, p50, p80 = np.percentile(bench["stats"]["data"], [20, 50, 80])
        results.append(
            Result(
                family=info["family"],
                op=info["op"],
                mode=info["mode"],
                provider=info["provider"],
                implementation=info["implementation"],
                sweep=info["sweep"],
                size=info[info["sweep"]],
                p20=p20,
                p50=p50,
                p80=p80,
                unit=info["unit"],
                metric=info["work"] / p50 / UNIT_SCALE[info["unit"]],
                peak_memory_mib=info.get("peak_memory_mib"),
                dtype=info.get("dtype", ""),
            )
        )
    medians = {(*r.table_key, r.size, r.provider): r.p50 for r in results}
    for r in results:
        for baseline in BASELINES:
            if (base := medians.get((*r.table_key, r.size, baseline))) is not None:
                r.ratio[baseline] = base / r.p50
    return results


def group_by(results: list[Result], key) -> dict:
    """Results grouped by ``key(result)``, groups and members in run order."""
    groups = defaultdict(list)
    for r in results:
        groups[key(r)].append(r)
    return groups


def table(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    """Column names and cells of one family/op/mode table, rows by size then provider."""
    first = results[0]
    show_memory = any(r.peak_memory_mib is not None for r in results)
    baselines = [b for b in BASELINES if any(r.provider == b for r in results)]
    columns = [first.sweep, "provider", "p20 ms", "p50 ms", "p80 ms", first.unit]
    columns += [f"vs {b}" for b in baselines] + (["peak MiB"] if show_memory else [])
    rows = []
    for r in sorted(results, key=lambda r: r.size):  # stable: providers stay in run order
        ratios = [f"{r.ratio[b]:.2f}x" if b in r.ratio else "-" for b in baselines]
        row = [str(r.size), r.provider, *(f"{t * 1e3:.3g}" for t in (r.p20, r.p50, r.p80))]
        row += [f"{r.metric:.1f}" if r.metric >= 0.1 else f"{r.metric:.2g}", *ratios]  # tiny: CPU runs
        if show_memory:
            row.append("-" if r.peak_memory_mib is None else f"{r.peak_memory_mib:.1f}")
        rows.append(row)
    return columns, rows


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def peak_bandwidth(device: str) -> float | None:
    """Peak memory bandwidth (bytes/s) of a known GPU, else None."""
    return next((bw for name, bw in PEAK_BANDWIDTH.items() if name in device), None)


def target_lines(results: list[Result], device: str) -> list[str]:
    """Whether fused add + LayerNorm forward + backward meets its speed and bandwidth targets."""
    peak = peak_bandwidth(device)
    lo, hi = TARGET_SIZES
    checked = [r for r in results if all(getattr(r, k) == v for k, v in TARGET.items()) and lo <= r.size <= hi]
    if not checked:
        return ["No fused add + LayerNorm forward+backward results in this run: targets not checked."]
    lines = []
    all_met = peak is not None
    for r in sorted(checked, key=lambda r: r.size):
        speedup = r.ratio.get("torch")
        fast = speedup is not None and speedup >= TARGET_SPEEDUP
        speed = f"{speedup:.2f}x torch eager" if speedup is not None else "no torch eager baseline"
        if peak is None:
            bandwidth = f"{r.metric:.0f} GB/s, peak bandwidth of {device!r} unknown"
            full = False
        else:
            fraction = r.metric * 1e9 / peak
            full = fraction >= TARGET_PEAK_FRACTION
            bandwidth = f"{r.metric:.0f} GB/s = {fraction:.0%} of {peak / 1e9:.0f} GB/s ({'met' if full else 'MISSED'})"
        all_met = all_met and fast and full
        lines.append(f"- hidden {r.size}: {speed} ({'met' if fast else 'MISSED'}); {bandwidth}")
    verdict = "all met" if all_met else ("unknown (peak bandwidth unknown)" if peak is None else "NOT all met")
    goal = f">= {TARGET_SPEEDUP}x torch eager and >= {TARGET_PEAK_FRACTION:.0%} of peak bandwidth"
    return [f"Fused add + LayerNorm forward+backward, hidden {lo}..{hi}, {goal}: **{verdict}**", "", *lines]


def attention_target_lines(results: list[Result], device: str) -> list[str]:
    """Whether slimformer attention at head dim 128, seq >= 4096 meets its speed targets, each mode
    against the fastest baseline (SDPA backend) of the same size."""
    checked = [
        r
        for r in results
        if r.family == "attention"
        and r.provider == "slimformer"
        and r.op in ATTENTION_TARGET_OPS
        and r.mode in ATTENTION_TARGETS
        and r.size >= ATTENTION_TARGET_MIN_SEQ
    ]
    if not checked:
        scope = f"head dim 128, seq >= {ATTENTION_TARGET_MIN_SEQ}"
        return [f"No attention results at {scope} in this run: targets not checked."]
    lines = []
    all_met = True
    for r in sorted(checked, key=lambda r: (list(ATTENTION_TARGETS).index(r.mode), r.op, r.size)):
        least_ratio, least_tflops = ATTENTION_TARGETS[r.mode]
        if r.ratio:
            fastest, ratio = min(r.ratio.items(), key=lambda item: item[1])
            met = ratio >= least_ratio
            parts = [f"{ratio:.2f}x {fastest} (fastest baseline) ({'met' if met else 'MISSED'})"]
        else:
            met = False
            parts = ["no SDPA baseline ran (MISSED)"]
        if least_tflops is not None:
            high = r.metric >= least_tflops
            parts.append(f"{r.metric:.0f} TFLOP/s ({'met' if high else 'MISSED'})")
            met = met and high
        all_met = all_met and met
        lines.append(f"- {r.mode} {r.op}, seq {r.size}: " + "; ".join(parts))
    goals = [
        f"{mode} >= {ratio}x the fastest SDPA backend" + (f" and >= {tflops:.0f} TFLOP/s" if tflops else "")
        for mode, (ratio, tflops) in ATTENTION_TARGETS.items()
    ]
    verdict = "all met" if all_met else "NOT all met"
    if not any(name in device for name in ATTENTION_TARGET_DEVICES):
        verdict += f" (targets set for {' / '.join(ATTENTION_TARGET_DEVICES)}, not this GPU)"
    scope = f"Attention, head dim 128, seq >= {ATTENTION_TARGET_MIN_SEQ}, {', '.join(goals)}"
    return [f"{scope}: **{verdict}**", "", *lines]


def header(machine: dict, results: list[Result], rounds: int, chosen: Selection) -> list[str]:
    """The markdown header: what ran where, and how to read the tables."""
    from bench.harness import device_slug, git_revision

    by_provider = group_by(results, lambda r: r.provider)
    runs = {p: " / ".join(sorted({r.implementation for r in group})) for p, group in by_provider.items()}
    lines = [f"# Benchmarks on {machine['bench_device']}", ""]
    if chosen.quick:
        lines += [
            "**Quick run** (`make bench`): one size of one op of each kernel family against its baselines, and "
            "the memory sections; the full sweep and every section: `python -m bench.report --full` "
            f"(`{device_slug(machine['bench_device'], machine['bench_device_type'])}.md`).",
            "",
        ]
    if chosen.partial:
        lines += [
            f"**Partial run** (`python -m bench.report {chosen.arguments}`); the full report is "
            f"`{device_slug(machine['bench_device'], machine['bench_device_type'])}.md`.",
            "",
        ]
    lines += [
        f"- device: {machine['bench_device']} ({machine['bench_device_type']})",
        f"- torch {machine['torch']}, triton {machine['triton']}, CUDA {machine['cuda'] or 'none'}, "
        f"Python {machine['python_version']}",
        f"- git revision: {git_revision()}",
        "- providers run: " + (", ".join(f"{p} = {impl}" for p, impl in runs.items()) or "none"),
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"Times are the 20th/50th/80th percentiles of {rounds} rounds, in ms (on a GPU: CUDA-event time of "
        "one call after an L2 flush, see `bench/harness.py`). The metric is the call's work (bytes or FLOPs, "
        "see each benchmark module's docstring) / median time. `vs X` = X's median / this median "
        "(> 1: faster than X), both from this run.",
    ]
    if machine["bench_device_type"] == "cpu":
        lines += [
            "",
            f"CPU runs use {machine['torch_threads']} intra-op thread(s), so that other load on the machine "
            "disturbs them less.",
            "",
            "**CPU run: these numbers time the PyTorch reference path only (no Triton kernel runs on CPU); "
            "they exercise the benchmark harness and say nothing about the GPU kernels.**",
        ]
    return lines


def plot(results: list[Result], device: str, device_type: str, path: Path) -> None:
    """One subplot per op x mode: the metric against the swept size, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))  # same colour in every subplot
    fig, axes = plt.subplots(len(ops), len(modes), figsize=(4.2 * len(modes), 3.2 * len(ops)), squeeze=False)
    peak = peak_bandwidth(device)
    for (op, mode), group in group_by(results, lambda r: (r.op, r.mode)).items():
        ax = axes[ops.index(op)][modes.index(mode)]
        for provider, points in group_by(group, lambda r: r.provider).items():
            points.sort(key=lambda r: r.size)
            color = f"C{providers.index(provider) % 10}"
            ax.plot([r.size for r in points], [r.metric for r in points], marker="o", color=color, label=provider)
        if peak is not None and group[0].unit == "GB/s":
            ax.axhline(peak / 1e9, color="gray", linestyle="--", linewidth=1, label="peak bandwidth")
        sizes = sorted({r.size for r in group})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_title(f"{op} · {mode}")
        ax.set_xlabel(group[0].sweep)
        ax.set_ylabel(group[0].unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    legend = {}  # label -> handle, from every subplot: a provider skipped in one still appears
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        legend.update(zip(labels, handles))
    labels, handles = list(legend), list(legend.values())
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 1.0))
    backend = " - PyTorch reference path (CPU)" if device_type == "cpu" else ""
    dtypes = ", ".join(sorted({r.dtype for r in results if r.dtype}))
    fig.suptitle(f"{results[0].family}{f' ({dtypes})' if dtypes else ''} on {device}{backend}", y=1.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def memory_lines(machine: dict) -> list[str]:
    """The activation-memory section, measured now on the benchmark device in its dtype."""
    import torch

    from bench.memory_table import HIDDEN, TOKENS, norm_memory_table

    device = torch.device(machine["bench_device_type"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    columns, rows = norm_memory_table(device, dtype)
    return [
        f"## Activation memory kept for backward ({TOKENS} tokens, hidden {HIDDEN}, {dtype})",
        "",
        "Measured with `slimformer.memory` (saved tensors and live weak references; input, output and"
        " parameters excluded).",
        "",
        markdown_table(columns, rows),
    ]


def section_names() -> list[str]:
    """What ``-k`` matches for each section: ``SECTIONS`` and each column of the BERT memory section."""
    from bench.bert_memory import BASELINES as BERT_BASELINES

    bert_columns = [*BERT_BASELINES, *(f"slimformer ({policy})" for policy in POLICIES)]
    return [*SECTIONS, *(f"bert_memory {column}" for column in bert_columns)]


def report_paths(out: Path, stem: str) -> list[Path]:
    """Every file a report named ``stem`` may write into ``out``."""
    plots = [*FAMILIES, "bert-memory", "int8"]
    return [out / f"{stem}.md", *(out / f"{stem}-{plot}.png" for plot in plots)]


def write_report(data: dict | None, skipped: list[str], console, chosen: Selection, out: Path) -> list[Path]:
    """Print the report of one pytest-benchmark JSON run (None: no benchmark selected) on the
    rich ``console``, write it into ``out``; return the files written."""
    import torch
    from rich.markdown import Markdown
    from rich.table import Table

    from bench.bert_memory import bert_memory_section
    from bench.compile_memory import SHAPE as COMPILE_SHAPE, lines as compile_memory_lines, measure as measure_compile
    from bench.cpu_step import measure_times, time_lines
    from bench.harness import device_slug, report_machine_info
    from bench.int8_inference import int8_inference_section
    from bench.mlm_memory import mlm_memory_section
    from bench.unpad import report_lines as unpad_lines

    machine = data["machine_info"] if data else report_machine_info()
    device, device_type = machine["bench_device"], machine["bench_device_type"]
    benchmarks = data["benchmarks"] if data else []
    results = load_results(benchmarks)
    rounds = max((len(b["stats"]["data"]) for b in benchmarks), default=0)

    md = header(machine, results, rounds, chosen)
    console.print(Markdown("\n".join(md)))
    for (family, op, mode), group in group_by(results, lambda r: r.table_key).items():
        columns, rows = table(group)
        rich_table = Table(*columns, title=f"{family}: {op}, {mode} ({device})")
        for row in rows:
            rich_table.add_row(*row)
        console.print(rich_table)
        md += ["", f"## {family}: {op}, {mode}", "", markdown_table(columns, rows)]
    if device_type == "cuda" and results:
        targets = ["## Targets", "", *target_lines(results, device), "", *attention_target_lines(results, device)]
        console.print(Markdown("\n".join(targets)))
        md += ["", *targets]
    if chosen.selects("norm_memory"):
        memory = memory_lines(machine)
        console.print(Markdown("\n".join(memory)))
        md += ["", *memory]
    out.mkdir(parents=True, exist_ok=True)
    stem = chosen.stem(device_slug(device, device_type))
    written = [out / f"{stem}.md"]
    bert_plot = out / f"{stem}-bert-memory.png"
    bert = bert_memory_section(
        torch.device(device_type),
        bert_plot,
        log=console.log,
        selected=lambda name: chosen.selects(f"bert_memory {name}"),
    )
    if bert:  # plain text: the table's lines fit a log's width, a Markdown code block would indent them
        console.print("\n".join(bert), markup=False, highlight=False, soft_wrap=True)
        md += ["", *bert]
        written.append(bert_plot)
    if chosen.selects("mlm_memory"):
        mlm = mlm_memory_section(torch.device(device_type), log=console.log)
        console.print(Markdown("\n".join(mlm)))
        md += ["", *mlm]
    if chosen.selects("int8_inference"):
        int8_plot = out / f"{stem}-int8.png"
        int8 = int8_inference_section(torch.device(device_type), int8_plot, log=console.log)
        console.print("\n".join(int8), markup=False, highlight=False, soft_wrap=True)
        md += ["", *int8]
        if int8_plot.exists():
            written.append(int8_plot)
    if device_type == "cpu" and chosen.selects("cpu_step"):
        # the CPU step's time is cheap (seconds a round); its peak is ``python -m bench.cpu_step``
        step = ["## A BERT training step on CPU", "", *time_lines(measure_times(rounds=5, log=console.log))]
        console.print(Markdown("\n".join(step)))
        md += ["", *step]
    if device_type == "cpu" and chosen.selects("unpad"):
        unpad = ["## Unpadded BERT batches on CPU", "", *unpad_lines(log=console.log)]
        console.print(Markdown("\n".join(unpad)))
        md += ["", *unpad]
    if device_type == "cpu" and chosen.selects("compile_memory"):
        # torch.compile vs eager per policy and compiled HF with memory budgets (minutes: it compiles 13 models)
        compiled = compile_memory_lines(measure_compile(*COMPILE_SHAPE, log=console.log), COMPILE_SHAPE)
        compiled = ["## torch.compile keeps the savings", "", *compiled]
        console.print(Markdown("\n".join(compiled)))
        md += ["", *compiled]
    if skipped:
        md += ["", "## Skipped", "", *(f"- {reason}" for reason in skipped)]
    written[0].write_text("\n".join(md) + "\n")
    for family, group in group_by(results, lambda r: r.family).items():
        written.append(out / f"{stem}-{family}.png")
        plot(group, device, device_type, written[-1])
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Run the pytest-benchmark suite in bench/ and the memory sections, print the tables, and write "
        "a Markdown report with its plots. By default (make bench) a quick run: one size of one op per kernel "
        "family and the memory sections, a few minutes on a CPU; --full: every benchmark and section.",
        epilog="Other pytest arguments go after --, e.g. python -m bench.report -k norm -- --benchmark-min-rounds=3. "
        "See bench/README.md.",
    )
    parser.add_argument(
        "-k",
        metavar="EXPR",
        dest="keyword",
        help="pytest -k: only the benchmarks and the sections whose names match, as pytest matches test names "
        f"(sections: {', '.join(SECTIONS)}, bert_memory <column>); a partial run",
    )
    parser.add_argument("-m", metavar="MARKEXPR", dest="marker", help="pytest -m: only benchmarks so marked")
    parser.add_argument(
        "--full",
        action="store_true",
        help="every benchmark at every size and every section (tens of minutes on a CPU); -k, -m and test "
        "paths select from these",
    )
    parser.add_argument(
        "pytest_args", nargs="*", metavar="PYTEST_ARG", help="test paths, and after -- any other pytest argument"
    )
    add_output_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    parser = _parser()
    args = parser.parse_args(argv)
    pytest_args = [*(["-k", args.keyword] if args.keyword else []), *(["-m", args.marker] if args.marker else [])]
    pytest_args += args.pytest_args
    chosen = selection(pytest_args, quick=not args.full)
    from rich.console import Console

    from bench.harness import device_slug, report_machine_info

    machine = report_machine_info()
    stem = chosen.stem(device_slug(machine["bench_device"], machine["bench_device_type"]))
    refuse_to_replace(parser, report_paths(args.out, stem), args.overwrite)
    print(f"bench.report: the report goes to {shown(args.out / stem)}.md", flush=True)
    if chosen.quick:
        pytest_args = ["-k", QUICK_BENCHMARKS[machine["bench_device_type"]], *pytest_args]
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / "benchmarks.json"
        skipped = run_benchmarks(json_path, pytest_args)
        data = json.loads(json_path.read_text()) if json_path.exists() else None
    console = Console() if sys.stdout.isatty() else Console(width=LOG_WIDTH)  # logs: don't cut columns at 80
    if data is None and not any(chosen.selects(name) for name in section_names()):
        sys.exit("no benchmark and no section selected; no report written")
    for path in write_report(data, skipped, console, chosen, args.out):
        console.print(f"wrote {shown(path)}")
    console.print(f"bench.report took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
