"""Compile every kernel launch slimformer makes for realistic shapes, for sm_90 and sm_80,
and report what the compiled code costs: ``python -m tools.compile_report`` (``make
compile-report``).

    python -m tools.compile_report                     # both targets, every case
    python -m tools.compile_report --list              # the cases' names (and families)
    python -m tools.compile_report -k "attn d128"      # cases whose name contains every word
    python -m tools.compile_report --arch sm90 --tag before-9d633e7
    python -m tools.compile_report --json out.json     # raw records too
    python -m tools.compile_report --out bench/results --overwrite   # replace the committed reports

No GPU is needed: launches are captured on CPU tensors with the GPU's code paths
(``capture``), specialised exactly as the JIT would, compiled by Triton and ptxas
and read back with cuobjdump (``sass``). See ``figures`` for the
estimates' model. Writes ``compile-<sm>[-<tag>].md`` and ``.png`` into
``bench/results/local/`` (git-ignored) unless ``--out DIR`` names another folder, and
replaces no file that exists unless ``--overwrite`` is given; the committed reports are in
``bench/results/``.
"""

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from slimformer._cli_args import output_file, positive_int
from tools.results import RESULTS, ROOT

# tools.compile_report.tutorial's measurement of Triton's tutorial, which the report quotes (git-ignored).
TUTORIAL_REFERENCE = RESULTS / "tutorial-attention-reference.json"
FAMILIES = ("attention", "norm", "dropout", "activation", "loss", "gemm")


@dataclass
class Record:
    """One captured launch of one case on one device, with its compiled facts."""

    case: object  # cases.Case
    launch: object  # capture.Launch
    stats: object = None  # sass.KernelStats, or None when compilation failed
    error: str = ""


@dataclass
class Collection:
    device: object
    records: list = field(default_factory=list)
    capture_errors: list = field(default_factory=list)  # (case name, error text)
    torch_bytes: dict = field(default_factory=dict)  # case name -> {phase: bytes of slimformer's torch ops}


def _analyse_worker(launch_json: dict, use_cache: bool, sass: bool):
    from tools.compile_report.capture import Launch
    from tools.compile_report.sass import analyse

    try:
        return "ok", analyse(Launch(**launch_json), use_cache=use_cache, sass=sass).to_json()
    except Exception as error:  # a compile error is a result to report, not a crash
        return "error", f"{type(error).__name__}: {str(error)[-3000:]}"


def collect(
    cases, devices, jobs: int = 1, use_cache: bool = True, progress: bool = True, sass: bool = True
) -> list[Collection]:
    """Capture every case on every device, then compile each distinct launch once; without
    ``sass``, read only what ``limit_violations`` needs (``sass.analyse``)."""
    from rich.progress import Progress

    from tools.compile_report.capture import capture
    from tools.compile_report.sass import KernelStats

    collections = [Collection(device) for device in devices]
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("capturing launches", total=len(cases) * len(devices))
        for collection in collections:
            for case in cases:
                try:
                    captured = capture(collection.device, case.run, case.name)
                except Exception as error:
                    collection.capture_errors.append((case.name, f"{type(error).__name__}: {error}"))
                    continue
                collection.records += [Record(case, launch) for launch in captured.launches]
                collection.torch_bytes[case.name] = captured.torch_bytes
                bar.advance(task)
        unique = {}
        for collection in collections:
            for record in collection.records:
                unique.setdefault(record.launch.key(), record.launch)
        task = bar.add_task(f"compiling {len(unique)} distinct kernels", total=len(unique))
        results = {}
        if jobs == 1:
            for key, launch in unique.items():
                results[key] = _analyse_worker(launch.to_json(), use_cache, sass)
                bar.advance(task)
        else:
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
                futures = {
                    pool.submit(_analyse_worker, launch.to_json(), use_cache, sass): key
                    for key, launch in unique.items()
                }
                for future in concurrent.futures.as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.advance(task)
    for collection in collections:
        for record in collection.records:
            status, value = results[record.launch.key()]
            if status == "ok":
                record.stats = KernelStats.from_json(value)
            else:
                record.error = value
    return collections


def limit_violations(collection: Collection, fp32_spills_ok: bool = True) -> list[str]:
    """Compile errors, shared memory over the device's limit, and spills in a 16-bit kernel
    within the supported sizes (hidden <= 8192, head dim <= 256)."""
    problems = [f"{name}: capture failed: {error}" for name, error in collection.capture_errors]
    for record in collection.records:
        label = f"{record.case.name} / {record.launch.kernel} {record.launch.note}".strip()
        if record.error:
            problems.append(f"{label}: compile error: {record.error.splitlines()[0]}")
            continue
        stats = record.stats
        if stats.shared_bytes > collection.device.max_shared_bytes:
            problems.append(f"{label}: {stats.shared_bytes} B shared memory > {collection.device.max_shared_bytes} B")
        if stats.spill_bytes and spills_forbidden(record.case):
            problems.append(f"{label}: {stats.spill_stores} B spill stores, {stats.spill_loads} B spill loads")
    return problems


def spills_forbidden(case) -> bool:
    params = case.params
    if params.get("dtype") not in ("fp16", "bf16"):
        return False
    if case.family == "attention":
        return params["head_dim"] <= 256
    if case.family == "norm":
        return params["n_cols"] <= 8192
    return True


# ----------------------------------------------------------------------------- rendering


def _kb(n: int) -> str:
    return f"{n / 1024:.1f}"


def loads_text(loads: dict) -> str:
    """``{"LDG.128": 4, "TMA": 2}`` -> ``LDG.128×4, TMA×2`` (most frequent first), ``–`` for none."""
    return ", ".join(f"{kind}×{n}" for kind, n in sorted(loads.items(), key=lambda kv: -kv[1])) or "–"


def _blocks(launch) -> str:
    constexprs = launch.named_constexprs()
    names = [k for k in constexprs if k.startswith("BLOCK") and isinstance(constexprs[k], int)]
    return "×".join(str(constexprs[k]) for k in names) or "–"


def _spills(stats) -> str:
    return f"{stats.spill_stores}/{stats.spill_loads}" if stats.spill_bytes else "0"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _kernel_columns(record) -> list:
    s = record.stats
    return [
        s.registers,
        _spills(s),
        _kb(s.shared_bytes),
        f"{s.num_warps}/{s.num_stages}",
        _blocks(record.launch),
        s.mma_kind,
    ]


def _error_row(record, width: int) -> list:
    return [record.case.name, record.launch.kernel, "**compile error**"] + [""] * (width - 3)


def attention_section(collection: Collection) -> list[str]:
    from tools.compile_report import figures as fig
    from tools.compile_report.cases import DTYPES

    device = collection.device
    records = [r for r in collection.records if r.case.family == "attention"]
    if not records:
        return []
    header = ["case", "kernel", "regs", "spills st/ld B", "smem KB", "warps/stages", "blocks", "MMA",
              "hot-loop loads", "hot-loop SASS", "warp-instr / 128² tile"]  # fmt: skip
    rows = []
    for r in records:
        if r.error:
            rows.append(_error_row(r, len(header)))
            continue
        s = r.stats
        tile = fig.tile_instructions(r.launch, s)
        rows.append(
            [r.case.name, _attention_kernel_label(r.launch)]
            + _kernel_columns(r)
            + [
                loads_text(s.hot_loop_loads),
                s.hot_loop.instructions if s.hot_loop else "–",
                f"{tile:.0f}" if tile else "–",
            ]
        )
    lines = ["## Attention kernels", ""] + _table(header, rows) + [""]

    lines += [
        "### Attention: estimates per pass (from compiled code; not timings)",
        "",
        "Shapes as named (batch 2). FLOPs ×min: MMA FLOPs the hot loops issue over the pass / the "
        "pass's useful FLOPs (fwd 2 GEMMs, bwd 5, causal counts allowed pairs only). Bytes ×min: "
        "bytes of every tensor each kernel is handed (read or written once) / the pass's minimum "
        "(fwd: q, k, v, o, lse; bwd: q, k, v, o, dO, lse, dq, dk, dv). TFLOP/s est.: useful FLOPs / "
        f"max(issue, tensor, memory time) on {device.name} ({device.dense_16bit_tflops:g} TFLOP/s, "
        f"{device.hbm_tbytes_per_s:g} TB/s, {fig.issue_rate(device) / 1e9:.0f} G warp-instr/s): an upper bound.",
        "",
    ]
    header = ["case", "pass", "warp-instr / 128² tile", "FLOPs ×min", "bytes ×min", "issue µs", "tensor µs",
              "memory µs", "TFLOP/s est.", "bound"]  # fmt: skip
    rows = []
    by_case = defaultdict(list)
    for r in records:
        by_case[r.case.name].append(r)
    for name, case_records in by_case.items():
        params = case_records[0].case.params
        element = DTYPES[params["dtype"]].itemsize
        for phase in ("fwd", "bwd"):
            phase_records = [r for r in case_records if r.launch.phase == phase]
            if not phase_records or any(r.error for r in phase_records):
                continue
            estimate = fig.Estimate(0.0, 0.0, 0.0, fig.attention_useful_flops(params, phase))
            mma = bytes_ = tile = 0.0
            for r in phase_records:
                estimate = estimate + fig.attention_estimate(r.launch, r.stats, params, device)
                mma += fig.attention_mma_flops(r.launch, r.stats, params)
                bytes_ += fig.kernel_bytes(r.launch)
                tile += fig.tile_instructions(r.launch, r.stats) or 0.0
            rows.append(
                [
                    name,
                    phase,
                    f"{tile:.0f}",
                    f"{mma / estimate.useful_flops:.2f}" if mma else "– (no MMA)",
                    f"{bytes_ / fig.attention_min_bytes(params, phase, element):.2f}",
                    f"{estimate.issue_s * 1e6:.1f}",
                    f"{estimate.tensor_s * 1e6:.1f}",
                    f"{estimate.memory_s * 1e6:.1f}",
                    f"{estimate.tflops:.0f}",
                    estimate.bound,
                ]
            )
    lines += _table(header, rows) + [""]
    lines += dropout_section(records)
    return lines


def _attention_kernel_label(launch) -> str:
    """The kernel's name without the family's affixes; "bwd_dkdv+dq" where the dK/dV kernel
    also adds dQ with atomics (``deterministic=False``)."""
    label = launch.kernel.removeprefix("_attention_").removesuffix("_kernel")
    return label + "+dq" if launch.named_constexprs().get("DQ_ATOMIC") else label


def dropout_section(records) -> list[str]:
    """Warp-instructions per 128² tile with dropout / without, kernel by kernel, for cases that
    differ only in dropout: per tile, not per loop iteration, since the two may run different blocks."""
    from tools.compile_report import figures as fig

    def key(r):
        return tuple(sorted((k, str(v)) for k, v in r.case.params.items() if k != "dropout")), r.launch.kernel

    plain = {}
    for r in records:
        if r.stats and r.stats.hot_loop and not r.case.params.get("dropout"):
            plain[key(r)] = r
    rows = []
    for r in records:
        base = plain.get(key(r))
        if not (base and r.stats and r.stats.hot_loop and r.case.params.get("dropout")):
            continue
        without, with_ = fig.tile_instructions(base.launch, base.stats), fig.tile_instructions(r.launch, r.stats)
        if without and with_:
            rows.append(
                [
                    r.case.name,
                    r.launch.kernel,
                    _blocks(base.launch),
                    f"{without:.0f}",
                    _blocks(r.launch),
                    f"{with_:.0f}",
                    f"{with_ / without:.2f}×",
                ]
            )
    if not rows:
        return []
    header = ["case", "kernel", "blocks without dropout", "warp-instr / 128² tile without", "blocks with dropout",
              "with dropout", "ratio"]  # fmt: skip
    return (
        [
            "### Dropout's cost in the hot loop",
            "",
            "Warp-instructions per 128² tile (hot-loop SASS × warps × "
            "tiles), so that launches with different blocks compare.",
            "",
        ]
        + _table(header, rows)
        + [""]
    )


def elementwise_section(collection: Collection) -> list[str]:
    from tools.compile_report import figures as fig

    device = collection.device
    records = [r for r in collection.records if r.case.family in ("norm", "dropout", "activation", "loss")]
    records += [r for r in collection.records if r.case.family == "gemm" and not _is_gemm(r)]
    if not records:
        return []
    header = ["case", "kernel", "pass", "regs", "spills st/ld B", "smem KB", "warps/stages", "blocks", "MMA",
              "loads", "SASS", "thread-instr / elem", "bytes / elem", "issue / memory", "bound"]  # fmt: skip
    rows = []
    for r in records:
        if r.error:
            rows.append(_error_row(r, len(header)))
            continue
        s, elements = r.stats, _elements(r)
        estimate = fig.elementwise_estimate(r.launch, s, elements, device)
        per_element = 32 * fig.elementwise_warp_instructions(r.launch, s, elements) / elements
        ratio = estimate.issue_s / estimate.memory_s if estimate.memory_s else float("inf")
        rows.append(
            [r.case.name, r.launch.kernel.strip("_").removesuffix("_kernel"), r.launch.phase]
            + _kernel_columns(r)
            + [
                loads_text(s.loads),
                s.sass_instructions,
                f"{per_element:.1f}",
                f"{fig.kernel_bytes(r.launch) / elements:.1f}",
                f"{ratio:.2f}×",
                "issue" if ratio > 1 else "memory",
            ]
        )
    lines = [
        "## Norms, dropout, activations (elementwise)",
        "",
        "thread-instr / elem: the kernel's dynamic SASS (straight-line code once per program, loops once "
        "per BLOCK-sized chunk) × 32 threads × warps / elements. issue / memory: that issue time "
        f"({fig.issue_rate(device) / 1e9:.0f} G warp-instr/s) over the time to move the kernel's tensors once "
        f"at {device.hbm_tbytes_per_s:g} TB/s; above 1× the kernel is issue-bound (an estimate).",
        "",
    ]
    return lines + _table(header, rows) + [""]


def norm_bytes_section(collection: Collection) -> list[str]:
    """A norm's backward as a whole: its kernel plus the PyTorch ops slimformer runs around it
    (memsets, the wide kernel's partial-row sum and casts), against the minimum it must move."""
    from tools.compile_report import figures as fig

    rows = []
    for name, phases in collection.torch_bytes.items():
        records = [r for r in collection.records if r.case.name == name and r.launch.phase == "bwd"]
        if not records or records[0].case.family != "norm":
            continue
        params = records[0].case.params
        kernels = sum(fig.kernel_bytes(r.launch) for r in records)
        minimum = fig.norm_backward_min_bytes(params)
        total = kernels + phases["bwd"]
        rows.append(
            [
                name,
                f"{kernels / 1e6:.1f}",
                f"{phases['bwd'] / 1e6:.1f}",
                f"{minimum / 1e6:.1f}",
                f"{total / minimum:.2f}×",
            ]
        )
    if not rows:
        return []
    header = ["case", "kernel MB", "PyTorch ops MB", "minimum MB", "total / minimum"]
    return (
        [
            "### Norm backward: bytes moved vs the minimum",
            "",
            "kernel: every tensor the backward kernel is handed, once; PyTorch ops: what slimformer's own "
            "torch calls in the backward read and write (the zero-filled arrival counters of the in-kernel dW/dB sum; "
            "after the wide kernel, the sum of its partial rows and casts); "
            "minimum: dy (+ the returned h's gradient), the saved activation, dx (+ a separate dresidual with "
            "dropout), w, b, dw, db and the row statistics.",
            "",
        ]
        + _table(header, rows)
        + [""]
    )


def _elements(record) -> int:
    """Elements one launch covers: a vocabulary chunk of the linear + cross-entropy is
    rows × that chunk's width (its own launch), not the whole vocabulary."""
    params = record.case.params
    chunk = record.launch.arg_values.get("chunk_padded")
    if record.case.family == "loss" and chunk:
        return params["rows"] * chunk
    return params.get("elements") or params["rows"] * params["in_features"]


def _is_gemm(record) -> bool:
    return record.stats is not None and record.stats.mma_kind in ("wgmma", "mma.sync")


def gemm_section(collection: Collection) -> list[str]:
    from tools.compile_report import figures as fig

    device = collection.device
    records = [r for r in collection.records if r.case.family == "gemm" and (_is_gemm(r) or r.error)]
    if not records:
        return []
    header = ["case", "kernel", "autotune", "regs", "spills st/ld B", "smem KB", "warps/stages", "blocks", "MMA",
              "hot-loop loads", "hot-loop SASS", "MMA FLOPs / iter", "issue / tensor cycles"]  # fmt: skip
    rows = []
    for r in records:
        if r.error:
            rows.append(_error_row(r, len(header)))
            continue
        s = r.stats
        per_sm_clock = fig.tensor_peak(s, device) / (device.multiprocessors * device.clock_ghz * 1e9)
        issue_cycles = s.hot_loop.instructions * s.num_warps / 4 if s.hot_loop else 0
        tensor_cycles = s.hot_loop_mma_flops / per_sm_clock
        rows.append(
            [r.case.name, r.launch.kernel.strip("_").removesuffix("_kernel"), r.launch.note.removeprefix("autotune ")]
            + _kernel_columns(r)
            + [
                loads_text(s.hot_loop_loads),
                s.hot_loop.instructions if s.hot_loop else "–",
                s.hot_loop_mma_flops,
                f"{issue_cycles / tensor_cycles:.2f}" if tensor_cycles else "–",
            ]
        )
    lines = [
        "## GEMMs (every autotune config that survives pruning for the shape)",
        "",
        "issue / tensor cycles: per hot-loop iteration, the cycles one SM needs to issue the loop "
        "(SASS × warps / 4 schedulers) over the cycles its tensor cores need for the loop's MMAs at "
        "the dense peak; above 1 the loop cannot keep the tensor cores busy (an estimate, one program per SM).",
        "",
    ]
    return lines + _table(header, rows) + [""]


def tutorial_section(device) -> list[str]:
    """The tutorial's best forward config per head dim (fewest warp-instructions per tile)
    and its backward kernel, from ``tutorial``'s stored measurement."""
    if not TUTORIAL_REFERENCE.exists():
        return []
    reference = json.loads(TUTORIAL_REFERENCE.read_text())
    rows = [r for r in reference["rows"] if r["arch"] == device.arch and (r["best"] or r["kernel"] == "_attn_bwd")]
    if not rows:
        return []
    header = ["kernel", "head dim", "blocks, warps/stages", "regs", "spills B", "smem KB", "MMA", "hot-loop loads",
              "innermost loops' SASS", "warp-instr / 128² tile"]  # fmt: skip
    table = [
        [
            r["kernel"] + (" (best of its configs)" if r["best"] else ""),
            r["head_dim"],
            r["config"],
            r["registers"],
            r["spills"],
            r["smem_kb"],
            r["mma"],
            r["loads"],
            ", ".join(map(str, r["loops"])),
            r["tile"] or "–",
        ]
        for r in rows
    ]
    return (
        [
            "## Reference: the Triton tutorial's fused attention, compiled the same way",
            "",
            reference["source"],
            "",
        ]
        + _table(header, table)
        + [""]
    )


def header_lines(device, tag: str, selection: str) -> list[str]:
    import torch
    import triton

    from tools.compile_report.sass import ptxas_version

    return [
        f"# Compiled-code report: {device.sm} ({device.name})" + (f", {tag}" if tag else ""),
        "",
        f"- generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by "
        f"`python -m tools.compile_report{selection}` at git revision {git_revision()}",
        f"- torch {torch.__version__}, triton {triton.__version__}, ptxas {ptxas_version()}",
        "- every launch the launchers make for each case, captured on CPU tensors with the CUDA code paths and "
        f"specialised as Triton's JIT does (16-byte pointer alignment, ints divisible by 16, ints equal to 1 as "
        f"constexprs, num_warps/num_stages) for {device.multiprocessors} SMs, compiled for {device.sm}; registers and "
        "spills from ptxas -v, shared memory from the kernel's metadata (limit "
        f"{device.max_shared_bytes // 1024} KB), MMA and load kinds and the hot loop (largest innermost "
        "backward-branch range) from cuobjdump -sass",
        "- hot-loop loads: LDG.128/LDG.64 are 16/8-byte vector loads, LDG.32/16/8 scalar loads, cp.async.N "
        "LDGSTS copies to shared memory, TMA UTMALDG; MMA wgmma = HGMMA/IGMMA, mma.sync = HMMA/IMMA, "
        "– = no tensor-core instruction (an fp32 dot runs as FFMAs on CUDA cores)",
        "- figures marked est. are model estimates from the compiled code, never timings",
        "",
    ]


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        kernels = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", "slimformer"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "slimformer"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return f"{rev} (slimformer/ " + ("with uncommitted changes)" if dirty else f"as of {kernels})")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(collection: Collection, tag: str, selection: str, plot_name: str | None) -> str:
    device = collection.device
    lines = header_lines(device, tag, selection)
    problems = limit_violations(collection)
    distinct = {r.launch.key() for r in collection.records}
    lines += [
        f"{len(collection.records)} launches of {len({r.case.name for r in collection.records})} cases, "
        f"{len(distinct)} distinct kernels compiled.",
        "",
        "## Checks (compile errors, shared memory over the limit, spills in 16-bit kernels at hidden ≤ 8192 / "
        "head dim ≤ 256)",
        "",
    ]
    lines += [f"- {p}" for p in problems] or ["- none"]
    lines += [""]
    if plot_name:
        lines += [f"![warp-instructions per tile and elementwise issue/memory]({plot_name})", ""]
    lines += attention_section(collection)
    lines += tutorial_section(device)
    lines += elementwise_section(collection)
    lines += norm_bytes_section(collection)
    lines += gemm_section(collection)
    return "\n".join(lines) + "\n"


def plot(collection: Collection, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.compile_report import figures as fig

    base = defaultdict(dict)
    for r in collection.records:
        p = r.case.params
        if r.case.family != "attention" or not r.stats or p["dtype"] != "bf16" or p["layout"] != "fused-qkv":
            continue
        if p["causal"] or p["dropout"] or p["mask"] or p["key_padding"] or p["seq_q"] != 512:
            continue
        tile = fig.tile_instructions(r.launch, r.stats)
        if tile:
            base[r.launch.kernel][p["head_dim"]] = tile
    elementwise = []
    for r in collection.records:
        p = r.case.params
        if (
            r.case.family in ("norm", "dropout", "activation")
            and r.stats
            and p.get("dtype") == "bf16"
            and (p.get("dropout") or r.case.family == "dropout")
        ):
            e = fig.elementwise_estimate(r.launch, r.stats, _elements(r), collection.device)
            elementwise.append((f"{r.case.name} [{r.launch.phase}]", e.issue_s / e.memory_s))
    if not base and not elementwise:
        return False
    height = max(6.0, 0.16 * len(elementwise))
    fig_, (left, right) = plt.subplots(1, 2, figsize=(15, height), gridspec_kw={"width_ratios": [1, 1.4]})
    for kernel, points in sorted(base.items()):
        dims = sorted(points)
        left.plot(dims, [points[d] for d in dims], marker="o", label=kernel.strip("_").removesuffix("_kernel"))
    if TUTORIAL_REFERENCE.exists():
        ref = [
            r
            for r in json.loads(TUTORIAL_REFERENCE.read_text())["rows"]
            if r["arch"] == collection.device.arch and r.get("best")
        ]
        if ref:
            left.scatter(
                [r["head_dim"] for r in ref],
                [r["tile"] for r in ref],
                marker="*",
                s=150,
                color="black",
                label="Triton tutorial fwd (best config)",
                zorder=5,
            )
    left.set_xlabel("head dim (bf16, seq 512, no mask)")
    left.set_ylabel("hot-loop warp-instructions per 128×128 tile")
    left.set_title(f"attention, {collection.device.sm}")
    if base:
        left.legend(fontsize=8)
    left.grid(alpha=0.3)
    if elementwise:
        right.barh(
            range(len(elementwise)),
            [v for _, v in elementwise],
            color=["tab:red" if v > 1 else "tab:green" for _, v in elementwise],
        )
        right.set_yticks(range(len(elementwise)), [n for n, _ in elementwise], fontsize=6)
        right.axvline(1.0, color="black", lw=0.8)
        right.axvline(0.8, color="gray", lw=0.8, ls="--")
        right.set_xlabel("estimated issue time / HBM time (bf16, with dropout)")
        right.invert_yaxis()
    fig_.tight_layout()
    fig_.savefig(path, dpi=110)
    plt.close(fig_)
    return True


def write_reports(collections, tag: str, selection: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for collection in collections:
        stem = report_stem(collection.device.sm, tag)
        png = out_dir / f"{stem}.png"
        has_plot = plot(collection, png)
        md = out_dir / f"{stem}.md"
        md.write_text(render(collection, tag, selection, png.name if has_plot else None))
        written += [md] + ([png] if has_plot else [])
    return written


def records_json(collections) -> dict:
    """Every record, and the limit violations per device."""
    records = [
        dict(
            case=r.case.name,
            family=r.case.family,
            params=r.case.params,
            launch=r.launch.to_json(),
            stats=r.stats.to_json() if r.stats else None,
            error=r.error,
        )
        for c in collections
        for r in c.records
    ]
    problems = {c.device.sm: limit_violations(c) for c in collections}
    capture_errors = {c.device.sm: c.capture_errors for c in collections}
    return dict(records=records, problems=problems, capture_errors=capture_errors)


def report_stem(sm: str, tag: str) -> str:
    """The name of a report's files without the suffix: ``compile-sm90``, ``compile-sm90-<tag>``."""
    return f"compile-{sm}" + (f"-{tag}" if tag else "")


def select(cases, pattern: str | None, ci_only: bool):
    if ci_only:
        cases = [c for c in cases if c.ci]
    if pattern:
        cases = [c for c in cases if all(word.lower() in c.name.lower() for word in pattern.split())]
    return cases


def main(argv=None) -> int:
    from tools.results import add_output_arguments, refuse_to_replace, shown

    parser = argparse.ArgumentParser(prog="python -m tools.compile_report", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-k",
        dest="pattern",
        metavar="WORDS",
        help="only the cases whose name contains every one of these words, in any order and case "
        '(e.g. -k "attn d128 causal", -k layer-norm); --list shows the names',
    )
    parser.add_argument("--list", action="store_true", help="print the selected cases' families and names, and exit")
    parser.add_argument("--family", choices=FAMILIES, nargs="+")
    parser.add_argument("--arch", nargs="+", default=["sm90", "sm80"], choices=["sm90", "sm80", "sm86"])
    parser.add_argument("--ci", action="store_true", help="only the CI's representative cases")
    parser.add_argument("-j", "--jobs", type=positive_int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--no-cache", action="store_true", help="recompile everything")
    parser.add_argument("--tag", default="", help="suffix of the report's file names, e.g. before-9d633e7")
    add_output_arguments(parser)
    parser.add_argument("--json", type=output_file, help="also write every record as JSON to this file")
    parser.add_argument("--no-report", action="store_true", help="write no markdown / plot")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    from tools.compile_report.cases import all_cases

    cases = select(all_cases(), args.pattern, args.ci)
    if args.family:
        cases = [c for c in cases if c.family in args.family]
    if not cases:
        parser.error("no case matches the selection (-k, --family, --ci); --list alone shows every case's name")
    if args.list:
        width = max(len(c.family) for c in cases)
        print("\n".join(f"{c.family:<{width}}  {c.name}" for c in cases))
        return 0

    from tools.compile_report.capture import DEVICES

    devices = [DEVICES[a] for a in args.arch]
    if not args.no_report:
        paths = [args.out / f"{report_stem(d.sm, args.tag)}{suffix}" for d in devices for suffix in (".md", ".png")]
        refuse_to_replace(parser, paths, args.overwrite)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the report compiles kernels for the GPU")
    collections = collect(cases, devices, args.jobs, not args.no_cache, not args.quiet)
    if args.json:
        args.json.write_text(json.dumps(records_json(collections)))
        print(f"wrote {shown(args.json)}", file=sys.stderr)
    if not args.no_report:
        selection = "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        for path in write_reports(collections, args.tag, selection, args.out):
            print(f"wrote {shown(path)}", file=sys.stderr)
    problems = [p for c in collections for p in limit_violations(c)]
    for problem in problems:
        print(f"[{problem}]", file=sys.stderr)
    return 0
