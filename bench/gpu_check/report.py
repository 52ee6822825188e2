"""The check's output: ``gpu-<device>.json`` (every number) and ``gpu-<device>.md`` (the
tables a person reads), both rewritten after every phase and every speed case, so a run
that is killed still leaves what it finished; and the targets, each with the figure it
reached and by how much it missed.

Ratios are speed ratios: a baseline's time / slimformer's time (above 1: slimformer is
faster), the best baseline being the fastest one that ran the row.
"""

import json
import traceback
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.gpu_check import attention, norms
from bench.gpu_check.model import INFER_COLUMNS, TRAIN_COLUMNS

TARGET_BERT = ("slimformer qkv+mlp", "HF SDPA")
TARGET_UNPAD = ("slimformer unpad=True, 50% padding", "HF SDPA, 50% padding")
TARGET_COMPILED = ("torch.compile(slimformer none)", "torch.compile(slimformer qkv+mlp)")


@dataclass
class Target:
    name: str
    measured: float | None
    needed: float
    at_least: bool  # measured >= needed (else <=)
    unit: str = "x"
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.needed if self.at_least else self.measured <= self.needed

    def verdict(self) -> str:
        if self.met is None:
            return "not measured" + (f" ({self.note})" if self.note else "")
        if self.met:
            return "met"
        if self.at_least:
            return f"missed ({self.measured / self.needed:.0%} of the target)"
        return f"missed ({self.measured / self.needed - 1:.0%} over the target)"

    def to_json(self) -> dict:
        return {**self.__dict__, "met": self.met, "verdict": self.verdict()}


# ---- looking rows up ------------------------------------------------------------------------


def _p50(row: dict | None, provider: str) -> float | None:
    if row is None:
        return None
    result = row["results"].get(provider, {})
    return result.get("p50_us")


def best_baseline(row: dict) -> tuple[str | None, float | None]:
    """(name, p50 µs) of the fastest baseline that ran ``row``."""
    times = [(row["results"][b]["p50_us"], b) for b in row["baselines"] if "p50_us" in row["results"].get(b, {})]
    if not times:
        return None, None
    time_us, name = min(times)
    return name, time_us


def ours(row: dict) -> list[str]:
    return [name for name in row["results"] if name.startswith("slimformer")]


def speed_vs_best(row: dict, provider: str) -> float | None:
    _, best = best_baseline(row)
    mine = _p50(row, provider)
    return None if best is None or mine is None else best / mine


def find_row(rows: list[dict], family: str, mode: str, **params) -> dict | None:
    for row in rows:
        if (
            row["family"] == family
            and row["mode"] == mode
            and all(row["params"].get(k) == v for k, v in params.items())
        ):
            return row
    return None


# ---- targets ---------------------------------------------------------------------------------


def targets(state: dict) -> list[Target]:
    """The issue's targets, from what the run measured (None where it did not get there)."""
    rows = state.get("speed", {}).get("rows", [])
    dry = state["meta"]["dry_run"]
    b, h, s, d = (attention.DRY_SHAPES if dry else attention.FULL_SHAPES)[0]
    shape = dict(batch=b, heads=h, seq=s, head_dim=d, causal=False)
    found = []

    def attn(variant, mode):
        return find_row(rows, "attention", mode, variant=variant, **shape)

    label = f"attention ({b}, {h}, {s}, {d})"
    for mode, needed in (("fwd", 1.0), ("bwd", 0.9)):
        row = attn("dense", mode)
        found.append(
            Target(f"{label} {mode} vs SDPA's best backend", row and speed_vs_best(row, "slimformer"), needed, True)
        )
    for mode in ("fwd", "bwd"):
        dense, dropout = _p50(attn("dense", mode), "slimformer"), _p50(attn("dropout", mode), "slimformer")
        own = dense / dropout if dense and dropout else None
        found.append(Target(f"{label} {mode}, dropout 0.1 vs its own no-dropout speed", own, 0.8, True))
        row = attn("dropout", mode)
        found.append(
            Target(
                f"{label} {mode}, dropout 0.1 vs SDPA's best with dropout",
                row and speed_vs_best(row, "slimformer"),
                1.3,
                True,
            )
        )
    copy_gbps = state.get("ceilings", {}).get("copy_gbps")
    hidden_sizes = (norms.DRY if dry else norms.FULL)["hidden"][:2]
    for op in norms.OPS:
        for hidden in hidden_sizes:
            for mode in ("fwd", "bwd"):
                row = find_row(rows, "norm", mode, op=op, hidden=hidden)
                time_us = _p50(row, "slimformer")
                share = row["work"] / (time_us * 1e-6) / 1e9 / copy_gbps if time_us and copy_gbps else None
                found.append(
                    Target(f"{op} x {hidden} {mode}: share of the copy bandwidth", share, 0.85, True, unit="of copy")
                )
    train = state.get("model", {}).get("train", {})
    ours_col, base_col = (train.get(name, {}) for name in TARGET_BERT)
    found.append(
        Target(
            "BERT-base MLM step, qkv+mlp: peak vs HF SDPA's",
            _ratio(ours_col, base_col, "peak_bytes"),
            0.35,
            False,
            note="peaks are read on CUDA only",
        )
    )
    found.append(
        Target(
            "BERT-base MLM step, qkv+mlp: tokens/s vs HF SDPA's", _ratio(ours_col, base_col, "tokens_per_s"), 0.9, True
        )
    )
    none_col = train.get("slimformer none", {})
    found.append(
        Target(
            "BERT-base MLM step, none: tokens/s vs HF SDPA's", _ratio(none_col, base_col, "tokens_per_s"), 1.05, True
        )
    )
    found.append(
        Target("BERT-base MLM step, none: peak vs HF SDPA's", _ratio(none_col, base_col, "peak_bytes"), 0.5, False)
    )
    found.append(
        Target(
            "BERT-base MLM step, none: host syncs per step",
            none_col.get("syncs_per_step"),
            1,
            False,
            unit="syncs",
            note="counted on CUDA only",
        )
    )
    compiled = [train.get(name, {}) for name in TARGET_COMPILED]
    best = max(compiled, key=lambda column: column.get("tokens_per_s") or 0.0)
    compiled_base = train.get("torch.compile(HF SDPA)", {})
    found.append(
        Target(
            "torch.compile of the patched model (best policy): tokens/s vs torch.compile(HF SDPA)'s",
            _ratio(best, compiled_base, "tokens_per_s"),
            1.0,
            True,
        )
    )
    found.append(
        Target(
            "torch.compile of the patched model (that policy): peak vs HF SDPA's",
            _ratio(best, base_col, "peak_bytes"),
            0.45,
            False,
        )
    )
    unpad, padded = (train.get(name, {}) for name in TARGET_UNPAD)
    found.append(
        Target(
            "BERT-base MLM step, unpad=True at 50% padding: tokens/s vs HF SDPA's",
            _ratio(unpad, padded, "tokens_per_s"),
            1.6,
            True,
        )
    )
    return found


def _ratio(mine: dict, base: dict, key: str) -> float | None:
    return mine[key] / base[key] if mine.get(key) and base.get(key) else None


# ---- markdown ---------------------------------------------------------------------------------


def _us(value: float) -> str:
    return f"{value / 1e3:.2f} ms" if value >= 10_000 else f"{value:.1f} µs"


def _metric(row: dict, time_us: float) -> float:
    scale = 1e12 if row["unit"] == "TFLOP/s" else 1e9
    return row["work"] / (time_us * 1e-6) / scale


class _Notes:
    """Errors as numbered notes under a table, so cells stay short."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"{i + 1}. {text}" for i, text in enumerate(self.texts)]


def _family_table(rows: list[dict], copy_gbps: float | None) -> list[str]:
    providers: list[str] = []
    for row in rows:
        for name in row["results"]:
            if name not in providers and name != "all":
                providers.append(name)
    order = list(providers)
    providers.sort(key=lambda name: (not name.startswith("slimformer"), order.index(name)))
    mine = [p for p in providers if p.startswith("slimformer")]
    unit = rows[0]["unit"]
    head = ["case", "mode", *(f"{p}" for p in providers), *(f"{p} ×" for p in mine), "best baseline",
            f"{mine[0]} host µs" if mine else "host"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = _Notes()
    for row in rows:
        cells = [row["label"], row["mode"]]
        for provider in providers:
            result = row["results"].get(provider, row["results"].get("all"))
            if result is None:
                cells.append("–")
            elif "p50_us" in result:
                metric = _metric(row, result["p50_us"])
                share = f" ({metric / copy_gbps:.0%})" if unit == "GB/s" and copy_gbps else ""
                cells.append(f"{_us(result['p50_us'])} · {metric:.3g}{share}")
            else:
                cells.append("✗ " + notes.ref(result["error"]))
        for provider in mine:
            ratio = speed_vs_best(row, provider)
            cells.append("–" if ratio is None else f"**{ratio:.2f}**")
        best, _ = best_baseline(row)
        cells.append(best or "–")
        host = row["results"].get(mine[0], {}).get("host_us") if mine else None
        cells.append("–" if host is None else f"{host:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return [
        f"Cells: median time · {unit}"
        + (" (share of the copy bandwidth)" if unit == "GB/s" else "")
        + "; × = best baseline's time / the slimformer provider's (above 1: slimformer faster)",
        "",
        *lines,
        "",
        *notes.lines(),
    ]


def _header(state: dict) -> list[str]:
    env, ceil, meta = state.get("environment", {}), state.get("ceilings", {}), state["meta"]
    title = f"# GPU check: {env.get('device', '?')}, {env.get('date', '?')}"
    lines = [title, ""]
    if meta["dry_run"]:
        lines += [
            "**Dry run**: every phase on the CPU at tiny sizes (the PyTorch path); no figure here is a GPU "
            "measurement.",
            "",
        ]
    keys = ("device", "compute_capability", "multiprocessors", "memory_gib", "driver", "cuda", "torch", "triton",
            "transformers", "numpy", "python", "revision", "host")  # fmt: skip
    lines += ["| | |", "|---|---|", *(f"| {k} | {env[k]} |" for k in keys if k in env)]
    lines.append(f"| command | `{meta['command']}` |")
    if ceil:
        lines += [
            f"| copy bandwidth (read + write) | {ceil['copy_gbps']:.0f} GB/s ({ceil['copy_bytes'] >> 20} MiB copy) |",
            f"| matmul | {ceil['matmul_tflops']:.0f} TFLOP/s ({ceil['matmul_shape']}) |",
        ]
    phases = state.get("phases", {})
    if phases:
        lines += [
            "",
            "Phases: "
            + ", ".join(
                f"{name} {p['status']} in {p['seconds']:.0f} s"
                + (f" (cap {p['cap_s']:.0f} s)" if p.get("cap_s") else "")
                for name, p in phases.items()
            ),
        ]
    return lines


def _targets_md(found: list[Target]) -> list[str]:
    lines = ["## Targets", "", "| target | measured | needed | |", "|---|---|---|---|"]
    formats = {"of copy": "{:.0%}", "syncs": "{:.0f}"}
    for t in found:
        measured = "–" if t.measured is None else formats.get(t.unit, "{:.2f}×").format(t.measured)
        needed = f"{'≥' if t.at_least else '≤'} " + formats.get(t.unit, "{}×").format(t.needed)
        lines.append(f"| {t.name} | {measured} | {needed} | {t.verdict()} |")
    return lines


def _correctness_md(result: dict) -> list[str]:
    summary = result.get("summary", {})
    lines = ["## Correctness: `pytest -m gpu`", ""]
    if not summary:
        return lines + [f"No JUnit XML came back (exit code {result.get('returncode')}); see the tests log."]
    lines.append(
        ", ".join(f"{v} {k}" for k, v in summary.items())
        + (" — **interrupted at the time cap**" if result.get("interrupted") else "")
    )
    for failure in result.get("failures", []):
        lines += [
            "",
            f"- `{failure['test']}` ({failure['kind']}): {failure['message']}",
            "",
            "```",
            *failure["traceback"],
            "```",
        ]
    return lines


def _times(r: dict, key: str, digits: int) -> str:
    """ "median (min–max)" of ``r[key]``."""
    t = r[key]
    return f"{t['median']:.{digits}f} ({t['min']:.{digits}f}–{t['max']:.{digits}f})"


def _ratio_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _column_rows(results: dict, names, needed: str, cells) -> list[str]:
    """One table row per column in ``names`` that ran; a row saying why where ``needed`` is missing."""
    lines = []
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        lines.append(
            f"| {name} | "
            + (" | ".join(cells(name, r)) if needed in r else f"{r.get('error') or r.get('skipped')} |")
            + " |"
        )
    return lines


def _model_md(model: dict) -> list[str]:
    train, infer = model.get("train", {}), model.get("infer", {})

    def train_cells(name, r):
        ref = train.get("HF SDPA, 50% padding" if "padding" in name else "HF SDPA", {})
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "–"
        return [
            f"{r['tokens_per_s']:,.0f}",
            _times(r, "step_ms", 1),
            peak,
            _ratio_text(_ratio(r, ref, "tokens_per_s")),
            _ratio_text(_ratio(r, ref, "peak_bytes")),
            f"{r['first_step_s']:.1f}",
            "–" if r.get("syncs_per_step") is None else str(r["syncs_per_step"]),
        ]

    def infer_cells(name, r):
        base = infer.get(INFER_COLUMNS[0], {})
        speed = base["latency_ms"]["median"] / r["latency_ms"]["median"] if "latency_ms" in base else None
        cosine = f"{r['cosine_vs_fp16']:.5f}" if "cosine_vs_fp16" in r else "–"
        return [_times(r, "latency_ms", 2), f"{r['sequences_per_s']:,.0f}", _ratio_text(speed), cosine]

    lines = ["## Whole model"]
    if train:
        lines += [
            "",
            "BertForMaskedLM training step (AdamW, bf16 autocast); speed and peak vs HF SDPA on the same "
            "batch (the padded columns vs HF SDPA, 50% padding); the slimformer columns gather the masked-LM "
            "rows at a fixed bound (``max_labelled_tokens``); host syncs of one more step "
            "(``torch.cuda.set_sync_debug_mode``).",
            "",
            "| column | tokens/s | step ms (min–max) | peak GiB | speed vs HF SDPA | peak vs HF SDPA | first step s "
            "| host syncs/step |",
            "|---|---|---|---|---|---|---|---|",
            *_column_rows(train, TRAIN_COLUMNS, "tokens_per_s", train_cells),
        ]
    if infer:
        lines += [
            "",
            "BertModel inference (no grad), latency of a synchronised forward:",
            "",
            "| column | latency ms (min–max) | sequences/s | speed vs fp16 | output cosine vs fp16 |",
            "|---|---|---|---|---|",
            *_column_rows(infer, INFER_COLUMNS, "latency_ms", infer_cells),
        ]
    plan = model.get("plan", {}).get("sf.plan")
    if plan:
        lines += ["", "sf.plan: the predicted step peak against the measured one (same step, same batch):", ""]
        if "rows" not in plan:
            lines.append(f"not run: {plan.get('error') or plan.get('skipped')}")
        else:
            lines += [
                f"Profile measured in {plan['profile_s']} s.",
                "",
                "Measured: the allocator's peak over the step above its start plus the storages of what persists "
                "(what the prediction counts); max_memory_allocated: the allocator's own peak over the step, "
                "everything on the device included.",
                "",
                "| plan | policies | predicted GiB | measured GiB | error | max_memory_allocated GiB | error |",
                "|---|---|---|---|---|---|---|",
            ]
            for label, r in plan["rows"].items():
                measured = "–" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.3f}"
                error = "–" if r["error"] is None else f"{100 * r['error']:+.2f}%"
                allocator = r.get("max_memory_allocated")
                allocator_error = r.get("error_vs_max_memory_allocated")
                lines.append(
                    f"| {label} | {r['policies']} | {r['predicted_bytes'] / 2**30:.3f} | {measured} | {error} | "
                    f"{'–' if allocator is None else f'{allocator / 2**30:.3f}'} | "
                    f"{'–' if allocator_error is None else f'{100 * allocator_error:+.2f}%'} |"
                )
    return lines


def _first_calls_md(rows: list[dict], shown: int = 5) -> list[str]:
    """The slowest first calls: a compile the precompile workers did not take off the clock."""
    calls = sorted(
        (
            (r["results"][p]["first_call_s"], f"{r['label']} {r['mode']} {p}")
            for r in rows
            for p in r["results"]
            if "first_call_s" in r["results"][p]
        ),
        reverse=True,
    )
    if not calls:
        return []
    total = sum(seconds for seconds, _ in calls)
    slowest = "; ".join(f"{name}: {seconds:.1f} s" for seconds, name in calls[:shown])
    return [
        f"First calls (a compile, or loading one from the on-disk cache): {total:.0f} s in all; slowest: {slowest}."
    ]


def markdown(state: dict) -> str:
    lines = _header(state)
    found = targets(state)
    lines += ["", *_targets_md(found)]
    if "correctness" in state:
        lines += ["", *_correctness_md(state["correctness"])]
    speed = state.get("speed", {})
    rows = speed.get("rows", [])
    if rows:
        lines += [
            "",
            "## Speed",
            "",
            "Device time (L2 flushed, the host's overhead kept off the clock; host µs: "
            "the host's time per call, queued without a sync), median of the rounds.",
        ]
        for family, title in (
            ("attention", "Attention"),
            ("norm", "Norms"),
            ("mlp", "MLP"),
            ("gemm", "Inference GEMMs"),
            ("epilogue", "Linear + GELU epilogue"),
        ):
            family_rows = [r for r in rows if r["family"] == family]
            if family_rows:
                lines += [
                    "",
                    f"### {title}",
                    "",
                    *_family_table(family_rows, state.get("ceilings", {}).get("copy_gbps")),
                ]
    if speed.get("not_run"):
        lines += ["", "Not run (the phase's time was used up): " + ", ".join(speed["not_run"])]
    if rows:
        lines += ["", *_first_calls_md(rows)]
    if "precompile" in state:
        pre = state["precompile"]
        compiled = [r for r in pre.get("results", []) if "seconds" in r]
        failed = [r for r in pre.get("results", []) if "error" in r]
        lines += [
            "",
            f"Precompiled before the speed phase by {pre.get('workers', 0)} workers: {len(compiled)} "
            f"launches, {sum(r['seconds'] for r in compiled):.0f} s of their time"
            + (f"; {len(failed)} failed (see the JSON)" if failed else "")
            + ".",
        ]
        entries = pre.get("triton_cache_entries")
        if entries and "after_speed" in entries:
            lines.append(
                f"Triton's on-disk cache: {entries['before']} kernels before the workers, "
                f"{entries['workers_stopped']} when they stopped, {entries['after_speed']} after the speed "
                "phase (what the speed phase compiled itself)."
            )
    if state.get("model"):
        lines += ["", *_model_md(state["model"])]
    if state.get("errors"):
        lines += ["", "## Errors that stopped a phase", "", *(f"- {e}" for e in state["errors"])]
    return "\n".join(lines) + "\n"


def write(state: dict, paths: dict[str, Path]) -> None:
    """Rewrite the JSON, then the Markdown, each through a temporary file (a kill mid-write
    leaves the previous complete version). A report that cannot be rendered still leaves
    the JSON, and a Markdown file saying why."""
    try:
        state["targets"] = [t.to_json() for t in targets(state)]
    except Exception:
        state["targets"] = [{"error": traceback.format_exc().splitlines()[-1]}]
    _replace(paths["json"], json.dumps(state, indent=1, default=str))
    try:
        text = markdown(state)
    except Exception:
        text = "# GPU check\n\nThe report could not be rendered (the JSON beside it has every number):\n\n```\n"
        text += traceback.format_exc() + "```\n"
    _replace(paths["md"], text)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def summary_table(state: dict) -> Table:
    """The short table printed last: the targets, and the tests' counts in the title."""
    counts = state.get("correctness", {}).get("summary", {})
    title = "GPU check" + (
        f": tests {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors"
        if counts
        else ""
    )
    table = Table(title=title)
    for column in ("target", "measured", "needed", "verdict"):
        table.add_column(column)
    for t in targets(state):
        measured = "–" if t.measured is None else (f"{t.measured:.0%}" if t.unit == "of copy" else f"{t.measured:.2f}x")
        table.add_row(t.name, measured, f"{'>=' if t.at_least else '<='} {t.needed}", t.verdict())
    return table


def print_summary(state: dict) -> None:
    Console(width=140).print(summary_table(state))
