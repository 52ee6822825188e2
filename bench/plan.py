"""sf.plan on the CPU: its predicted step peaks against measured ones, and what its plans buy.

``slimformer.plan`` predicts the peak of a training step (forward, backward and the
optimizer's update; every byte alive at the worst moment: parameters, buffers,
optimizer state, the batch, gradients, activations, transients) from measurements at 1,
2 and 4 rows, and picks per-layer recompute policies that fit a budget. Five sections:

1. accuracy: predicted vs measured step peak on a grid of HF BERTs (``BertForMaskedLM``
   and ``BertForSequenceClassification``, BERT-base and BERT-large dims, vocab 30522,
   2-12 layers, batch 1-16, seq 128-512, fp32 and bf16 autocast, padded and unpadded,
   every optimizer of ``sf.plan``, every uniform policy and mixed plans from the
   ladder). One ``profile`` per (model, seq, head, dtype, unpad, optimizer) predicts every
   (batch, policies) of its rows; the error of the whole peak and of its dynamic part
   (the peak minus parameters, buffers, optimizer state and the batch). Target: +-3%.
2. monotonic: BERT-base dims, 4 layers, batch 4, seq 512, masked LM, AdamW; budgets
   evenly from the smallest plannable peak to HF eager's measured peak; ``sf.plan`` at
   each (its profile measured once): predicted peaks and measured peaks never rise and
   the extra compute never falls as the budget falls.
3. fits: the same shape at 50%, 35% and 25% of HF eager's peak, read two ways: of the
   whole step (parameters and AdamW state included: no plan goes below them) and of the
   part above what persists (budget = persistent + x% of eager's rest); the plan's
   measured peak is under the budget, and its step is timed against two other policies
   that fit (a budget AdamW cannot meet goes to the optimizer that can).
4. floor: the same shape at ``qkv+mlp`` with each optimizer, vs HF eager (target <= 0.5).
5. side by side: HF SDPA under ``torch.compile`` with the min-cut partitioner's
   ``activation_memory_budget`` 0.5 and 0.1, next to the slimformer plan for the
   compiled step's peak; peaks from the CPU allocator (torch.profiler), which also sees
   inductor's generated code.

How a step is measured: a deep copy of the model, patched and set to the policies
(HF baselines unpatched, ``attn_implementation`` "eager" or "sdpa"), a fresh optimizer
(``torch.optim.AdamW``, ``fused=True``, or ``sf.plan.optimizer_in_backward``), two
steps; the second one inside ``slimformer.memory.peak_memory("cpu")`` (the CPU
allocator's events through torch.profiler, after ``zero_grad(set_to_none=True)`` and
``gc.collect()``); the step's total
is that peak plus the storages of the parameters, buffers, optimizer state and batch.
Times: process CPU time of a step, one intra-op thread, variants interleaved round
after round, median with min-max.

    python -m bench.plan [--quick] [--skip accuracy monotonic fits floor side] [--rounds 3] [--out DIR] [--overwrite]

Writes ``cpu-plan.md`` (``cpu-plan-quick.md`` with ``--quick``) into ``--out`` (default
bench/results/local/, git-ignored) and replaces no file unless ``--overwrite``. The full
run takes about 40 minutes on a 2-core CPU; ``--quick`` (tiny dims) about 2.
"""

import argparse
import copy
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

from slimformer._cli_args import positive_int
from tools.results import add_output_arguments, refuse_to_replace, shown

SECTIONS = ("accuracy", "monotonic", "fits", "floor", "side")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny dims and a few configurations (about 2 minutes)")
    parser.add_argument("--skip", nargs="+", choices=SECTIONS, default=[], metavar="SECTION", help=f"of {SECTIONS}")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timing rounds (fits, side by side)")
    parser.add_argument(
        "--budgets", type=positive_int, default=None, help="budgets of the monotonic section (20; quick 5)"
    )
    add_output_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from torch import nn

from bench.compile_memory import _allocations, _running_peak
from bench.harness import device_name, git_revision
from slimformer.layers.policies import POLICIES
from slimformer.patch import patch
from slimformer.plan import (
    OPTIMIZERS,
    Plan,
    ladder,
    plannable_layers,
    profile,
    synthetic_batch,
)
from slimformer.plan.optimizer import InBackwardOptimizer, make_optimizer
from slimformer.plan.planner import Rung, choose
from slimformer.plan.profile import MemoryProfile, Prediction

VOCAB = 30522  # real BERT's: the masked-LM logits and the embedding's gradient are a large part of a step
DIMS = {  # hidden, heads, FFN, vocab
    "base": (768, 12, 3072, VOCAB),
    "large": (1024, 16, 4096, VOCAB),
    "tiny": (128, 2, 512, 1000),  # --quick only
}
EXAMPLE_ROWS = 2  # rows of the example batch each profile is measured on (at 1, 2 and 4 rows: cycled)
UNPAD_REAL = {"even": (0.75, 0.75), "uneven": (0.9, 0.5)}  # real tokens per row, as a fraction of seq
TARGET_ERROR = 3.0  # percent
FIT_FRACTIONS = (0.5, 0.35, 0.25)
FLOOR_TARGET = 0.5
HF_BUDGETS = (0.5, 0.1)
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one profile is measured for: a model, a sequence length, a dtype, padding, an optimizer."""

    dims: str  # a key of DIMS
    layers: int
    seq: int
    head: str  # "mlm" (BertForMaskedLM) or "cls" (BertForSequenceClassification)
    dtype: str = "fp32"  # "fp32" or "bf16" (torch.autocast)
    unpad: str = ""  # "" (padded, all-ones mask), "even" or "uneven" (unpad=True, padding as UNPAD_REAL)
    optimizer: str = "adamw"

    @property
    def autocast(self) -> torch.dtype | None:
        return torch.bfloat16 if self.dtype == "bf16" else None

    def with_optimizer(self, optimizer: str) -> "Setup":
        return dataclasses.replace(self, optimizer=optimizer)

    def label(self) -> str:
        head = {"mlm": "MaskedLM", "cls": "SeqCls"}[self.head]
        unpad = f", unpad ({self.unpad})" if self.unpad else ""
        return f"{self.dims} {self.layers}L {head}, seq {self.seq}, {self.dtype}{unpad}, {self.optimizer}"


# (setup, ((batch, (policy specs ...)), ...)); a spec is a policy (uniform), "rungs" (every rung
# of the ladder at that batch) or "mixed:K" (up to K rungs that mix policies, spread over the ladder)
Grid = Sequence[tuple[Setup, Sequence[tuple[int, Sequence[str]]]]]
MAIN = Setup("base", 4, 512, "mlm")  # the shape of sections 2-5, at MAIN_BATCH rows
MAIN_BATCH = 4
FULL_GRID: Grid = [
    (MAIN, ((1, ("none", "full")), (4, (*POLICIES, "rungs")), (8, ("none", "full", "rungs")))),
    (MAIN.with_optimizer("adamw-fused"), ((2, ("mlp",)), (4, ("none", "qkv+mlp", "full")))),
    (MAIN.with_optimizer("adamw-in-backward"), ((4, ("qkv", "full", "rungs")), (6, ("mixed:1",)))),
    (Setup("base", 12, 128, "cls"), ((1, ("none",)), (16, ("none", "qkv", "full", "mixed:2")))),
    (Setup("base", 6, 256, "cls", "bf16"), ((2, ("none", "mlp", "full")), (8, ("qkv+mlp", "mixed:1")))),
    (
        Setup("base", 4, 256, "mlm", unpad="uneven"),
        ((2, ("none", "full")), (4, ("qkv+mlp", "mixed:1")), (8, ("none", "qkv"))),
    ),
    (Setup("large", 2, 512, "mlm"), ((1, ("none", "full")), (4, ("none", "qkv+mlp", "mixed:1")))),
    (Setup("large", 2, 256, "cls", "bf16", optimizer="adamw-fused"), ((2, ("none", "full")), (4, ("mlp", "mixed:1")))),
    (Setup("base", 8, 384, "mlm", "bf16", "even", "adamw-in-backward"), ((1, ("none",)), (3, ("qkv+mlp", "mixed:1")))),
    (Setup("base", 2, 128, "cls", unpad="uneven", optimizer="adamw-fused"), ((2, ("none",)), (12, ("qkv", "full")))),
]
QUICK_MAIN = Setup("tiny", 2, 128, "mlm")
QUICK_BATCH = 2
QUICK_GRID: Grid = [
    (QUICK_MAIN, ((2, ("none", "full", "rungs")), (4, ("qkv+mlp",)))),
    (Setup("tiny", 2, 64, "cls", "bf16", "uneven", "adamw-in-backward"), ((4, ("none", "qkv+mlp")),)),
]


@dataclasses.dataclass
class Measured:
    """A measured step: ``total`` = ``dynamic`` (the peak above the step's start) + ``persistent``
    (parameters, buffers, optimizer state, batch); ``allocator``: the total of a further step with
    its peak from the CPU allocator's events instead (0 where not measured)."""

    total: int
    dynamic: int
    persistent: int
    allocator: int = 0


@dataclasses.dataclass
class Profiled:
    profile: MemoryProfile
    flops: list
    seconds: float


class Trainee:
    """A prepared model copy, its optimizer and batch: one training step per ``step()``."""

    def __init__(self, model: nn.Module, batch: dict, optimizer: str, autocast: torch.dtype | None):
        self.model, self.batch, self.autocast = model, batch, autocast
        self.optimizer = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        context = torch.autocast("cpu", self.autocast) if self.autocast is not None else nullcontext()
        with context:
            loss = self.model(**self.batch).loss
        loss.backward()
        del loss
        self.optimizer.step()

    def persistent_bytes(self) -> int:
        """Storages of the parameters, buffers, optimizer state and batch (each storage once)."""
        model = getattr(self.model, "_orig_mod", self.model)
        if isinstance(self.optimizer, InBackwardOptimizer):
            states = [s for o in self.optimizer.optimizers.values() for s in o.state.values()]
        else:
            states = list(self.optimizer.state.values())
        tensors = [*model.parameters(), *model.buffers(), *[v for s in states for v in s.values()]]
        tensors += list(self.batch.values())
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)
        }
        return sum(storages.values())

    def measure(self) -> Measured:
        """Two steps (the first makes the optimizer state), the second inside ``peak_memory``; then a
        third with the allocator's events (``allocator_measure``)."""
        from slimformer.memory import peak_memory

        self.step()
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        with peak_memory("cpu") as peak:
            self.step()
        persistent = self.persistent_bytes()
        allocator = self.allocator_measure().total
        return Measured(peak.bytes + persistent, peak.bytes, persistent, allocator)

    def allocator_measure(self) -> Measured:
        """A step's peak from the CPU allocator's own events (torch.profiler ``profile_memory``),
        after the steps already run; sees what inductor's generated code allocates."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        with _allocations() as deltas:
            self.step()
        _, peak = _running_peak(0, deltas)
        persistent = self.persistent_bytes()
        return Measured(peak + persistent, peak, persistent)


def _with_policies(policies: Sequence[str], unpad: bool) -> Callable[[nn.Module], nn.Module]:
    def prepare(model: nn.Module) -> nn.Module:
        patch(model, unpad=unpad)
        layers = plannable_layers(model)
        if len(layers) != len(policies):
            raise ValueError(f"{len(policies)} policies for {len(layers)} layers")
        for (_, layer), policy in zip(layers, policies):
            layer.recompute = policy
        return model

    return prepare


def _hf(attn_implementation: str) -> Callable[[nn.Module], nn.Module]:
    def prepare(model: nn.Module) -> nn.Module:
        model.set_attn_implementation(attn_implementation)
        return model

    return prepare


def _extra_compute(profile_: MemoryProfile, flops: list, policies: Sequence[str]) -> float:
    """The recompute's extra FLOPs as a fraction of the step's (as ``Plan.extra_compute``)."""
    stages = [i for i, layer in enumerate(profile_.stage_layer) if layer is not None]
    extra = sum(f.extra(policies[profile_.stage_layer[i]]) for i, f in zip(stages, flops))
    return extra / profile_.step_flops


def _dynamic(prediction: Prediction) -> int:
    """The predicted peak less what persists (parameters and buffers, optimizer state, batch)."""
    persistent = ("parameters and buffers", "optimizer state", "batch")
    return prediction.peak_bytes - sum(prediction.breakdown.get(k, 0) for k in persistent)


def _breakdown(prediction: Prediction) -> str:
    """The prediction's parts at its peak, largest first, in MiB."""
    parts = sorted(((size, name) for name, size in prediction.breakdown.items() if size), reverse=True)
    return ", ".join(f"{name} {_mib(size)}" for size, name in parts)


def _policies_text(policies: Sequence[str]) -> str:
    """Run-length policies in layer order: ``full×2, mlp, none``; uniform ones as ``qkv (all)``."""
    if len(set(policies)) == 1:
        return f"{policies[0]} (all)"
    runs: list[list] = []
    for policy in policies:
        if runs and runs[-1][0] == policy:
            runs[-1][1] += 1
        else:
            runs.append([policy, 1])
    return ", ".join(p if n == 1 else f"{p}×{n}" for p, n in runs)


def _mib(size: float) -> str:
    return f"{size / MiB:,.1f}"


def _error(predicted: float, measured: float) -> float:
    return 100.0 * (predicted / measured - 1.0)


class Bench:
    """Models, example batches, profiles and measurements, each made once and shared by the sections."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.models: dict[tuple, nn.Module] = {}
        self.profiles: dict[Setup, Profiled] = {}
        self.measured: dict[tuple, Measured] = {}

    def model(self, setup: Setup) -> nn.Module:
        from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

        key = (setup.dims, setup.layers, setup.head)
        if key not in self.models:
            hidden, heads, ffn, vocab = DIMS[setup.dims]
            config = BertConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                num_attention_heads=heads,
                intermediate_size=ffn,
                num_hidden_layers=setup.layers,
                max_position_embeddings=512,
            )
            torch.manual_seed(0)
            cls = BertForMaskedLM if setup.head == "mlm" else BertForSequenceClassification
            self.models[key] = cls(config).train()
        return self.models[key]

    def drop_models(self, keep: Sequence[Setup] = ()) -> None:
        kept = {(s.dims, s.layers, s.head) for s in keep}
        self.models = {k: m for k, m in self.models.items() if k in kept}
        gc.collect()

    def example(self, setup: Setup) -> dict:
        """EXAMPLE_ROWS rows of random inputs with labels; for unpadded setups, padding as UNPAD_REAL."""
        batch = synthetic_batch(self.model(setup), EXAMPLE_ROWS, setup.seq)
        if setup.unpad:
            for row, fraction in enumerate(UNPAD_REAL[setup.unpad]):
                real = round(fraction * setup.seq)
                batch["attention_mask"][row, real:] = 0
                if setup.head == "mlm":
                    batch["labels"][row, real:] = -100
        return batch

    def batch(self, setup: Setup, rows: int) -> dict:
        """``rows`` rows cycled from the example (as ``sf.plan`` makes its batches)."""
        index = torch.arange(rows) % EXAMPLE_ROWS
        return {k: v[index] for k, v in self.example(setup).items()}

    def profiled(self, setup: Setup) -> Profiled:
        if setup not in self.profiles:
            self.log(f"profile {setup.label()} ...")
            started = time.perf_counter()
            profile_, flops = profile(
                self.model(setup),
                self.example(setup),
                optimizer=setup.optimizer,
                autocast=setup.autocast,
                unpad=bool(setup.unpad),
            )
            self.profiles[setup] = Profiled(profile_, flops, time.perf_counter() - started)
            self.log(f"  profiled in {self.profiles[setup].seconds:.0f} s")
        return self.profiles[setup]

    def rungs(self, setup: Setup, batch: int) -> list[Rung]:
        profiled = self.profiled(setup)
        return ladder(profiled.profile, profiled.flops, batch)

    def predict(self, setup: Setup, batch: int, policies: Sequence[str]) -> Prediction:
        return self.profiled(setup).profile.predict(tuple(policies), batch)

    def plan(self, setup: Setup, batch: int, budget: int) -> Plan:
        """What ``sf.plan`` picks on ``batch`` rows, from the setup's profile (measured once)."""
        profiled = self.profiled(setup)
        return choose(profiled.profile, profiled.flops, budget, batch, unpad=bool(setup.unpad), autocast=setup.autocast)

    def trainee(self, setup: Setup, batch: int, policies: Sequence[str] | None, attn: str = "eager") -> Trainee:
        """A copy of the setup's model: patched at ``policies``, or HF's own with ``attn`` (None)."""
        torch.manual_seed(1)
        prepare = _hf(attn) if policies is None else _with_policies(policies, bool(setup.unpad))
        model = prepare(copy.deepcopy(self.model(setup))).train()
        return Trainee(model, self.batch(setup, batch), setup.optimizer, setup.autocast)

    def measure(self, setup: Setup, batch: int, policies: Sequence[str] | None, attn: str = "eager") -> Measured:
        """The measured step (cached): slimformer at ``policies``, or HF (``policies`` None) with ``attn``."""
        key = (setup, batch, None if policies is None else tuple(policies), attn if policies is None else None)
        if key not in self.measured:
            started = time.perf_counter()
            trainee = self.trainee(setup, batch, policies, attn)
            self.measured[key] = trainee.measure()
            del trainee
            gc.collect()
            what = f"HF {attn}" if policies is None else _policies_text(policies)
            self.log(
                f"  measured {setup.label()}, batch {batch}, {what}: {_mib(self.measured[key].total)} MiB "
                f"({time.perf_counter() - started:.0f} s)"
            )
        return self.measured[key]


def _resolve(bench: Bench, setup: Setup, batch: int, specs: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, policies) for each spec, duplicates dropped: "uniform", "rung i/n" or "mixed (rung i/n)"."""
    n = setup.layers
    out: dict[tuple[str, ...], str] = {}
    rungs = None
    for spec in specs:
        if spec in POLICIES:
            out.setdefault((spec,) * n, "uniform")
            continue
        rungs = rungs or bench.rungs(setup, batch)
        indexed = list(enumerate(rungs))
        if spec == "rungs":
            chosen = indexed
        elif spec.startswith("mixed:"):
            mixed = [(i, r) for i, r in indexed if len(set(r.policies)) > 1]
            k = min(int(spec.split(":")[1]), len(mixed))
            if k == 1:
                chosen = [mixed[len(mixed) // 2]]
            else:  # spread over the mixed rungs, the first and the last included
                chosen = [mixed[round(j * (len(mixed) - 1) / (k - 1))] for j in range(k)]
        else:
            raise ValueError(f"unknown policy spec {spec!r}")
        for i, rung in chosen:
            kind = "mixed" if len(set(rung.policies)) > 1 else "uniform"
            out.setdefault(rung.policies, f"{kind} (rung {i + 1}/{len(rungs)})")
    return [(kind, policies) for policies, kind in out.items()]


@dataclasses.dataclass
class Point:
    setup: Setup
    batch: int
    kind: str
    policies: tuple[str, ...]
    prediction: Prediction
    measured: Measured

    @property
    def error(self) -> float:
        return _error(self.prediction.peak_bytes, self.measured.total)

    @property
    def dynamic_error(self) -> float:
        return _error(_dynamic(self.prediction), self.measured.dynamic)

    @property
    def allocator_error(self) -> float:
        return _error(self.prediction.peak_bytes, self.measured.allocator)


def accuracy(bench: Bench, grid: Grid, main: Setup) -> list[str]:
    points: list[Point] = []
    for setup, batches in grid:
        for batch, specs in batches:
            for kind, policies in _resolve(bench, setup, batch, specs):
                prediction = bench.predict(setup, batch, policies)
                measured = bench.measure(setup, batch, policies)
                points.append(Point(setup, batch, kind, policies, prediction, measured))
                bench.log(
                    f"  -> predicted {_mib(prediction.peak_bytes)} MiB, error {points[-1].error:+.2f}% "
                    f"(dynamic {points[-1].dynamic_error:+.2f}%)"
                )
        bench.drop_models(keep=[main])  # the later sections' model

    def spread(values: list[float]) -> str:
        within = sum(abs(v) <= TARGET_ERROR for v in values)
        return (
            f"max |error| **{max(map(abs, values)):.2f}%**, median {statistics.median(map(abs, values)):.2f}%, "
            f"{within}/{len(values)} within ±{TARGET_ERROR:g}%"
        )

    setups = list(dict.fromkeys(p.setup for p in points))
    mixed = sum(p.kind.startswith("mixed") for p in points)
    lines = [
        f"{len(points)} configurations ({mixed} mixed plans) from {len(setups)} profiles. *Total* is the step's "
        "peak with parameters, buffers, optimizer state and batch; *dynamic* is the peak above them (what the "
        "step allocates: gradients, activations, transients). Errors are predicted / measured - 1. *Allocator*: "
        "a further step's total with its peak replayed from the CPU allocator's events by this bench's own "
        "code (`bench.compile_memory`), a check on `peak_memory`, which reads the same events.",
        "",
        f"- total (target ±{TARGET_ERROR:g}%): {spread([p.error for p in points])}",
        f"- dynamic part: {spread([p.dynamic_error for p in points])}",
        f"- total vs the allocator's count: {spread([p.allocator_error for p in points])}",
        "",
        "| profile (model, seq, dtype, padding, optimizer) | batch | policies (layer order) | predicted MiB "
        "| measured MiB | error | dynamic pred. MiB | dynamic meas. MiB | dynamic error | allocator MiB "
        "| error vs allocator | predicted peak at |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        flag = "" if abs(p.error) <= TARGET_ERROR else " **!**"
        lines.append(
            f"| {p.setup.label()} | {p.batch} | {p.kind}: {_policies_text(p.policies)} | "
            f"{_mib(p.prediction.peak_bytes)} | {_mib(p.measured.total)} | {p.error:+.2f}%{flag} | "
            f"{_mib(_dynamic(p.prediction))} | {_mib(p.measured.dynamic)} | {p.dynamic_error:+.2f}% | "
            f"{_mib(p.measured.allocator)} | {p.allocator_error:+.2f}% | {p.prediction.moment} |"
        )
    lines += ["", "Per profile (each measured once, at 1, 2 and 4 rows under every policy):", ""]
    lines += [
        "| profile | seconds | points | max \\|error\\| | max \\|error\\| vs allocator |",
        "|---|---|---|---|---|",
    ]
    for setup in setups:
        mine = [p for p in points if p.setup == setup]
        lines.append(
            f"| {setup.label()} | {bench.profiled(setup).seconds:.0f} | {len(mine)} | "
            f"{max(abs(p.error) for p in mine):.2f}% | {max(abs(p.allocator_error) for p in mine):.2f}% |"
        )
    return lines


def _monotone(values: Sequence[float], rising: bool) -> bool:
    pairs = list(zip(values, values[1:]))
    return all(b >= a for a, b in pairs) if rising else all(b <= a for a, b in pairs)


def monotonic(bench: Bench, cases: Sequence[tuple[Setup, int]], count: int) -> list[str]:
    """For each (setup, batch): ``count`` budgets from the last rung's predicted peak to HF eager's measured one."""
    summary = [
        "Budgets falling, at each shape: `sf.plan`'s predicted peak never rises, its extra compute never falls, "
        "the measured peak of the applied plan never rises and stays under the budget. HF eager: unpatched, "
        "eager attention, AdamW, measured.",
        "",
        "| shape | rungs | budgets MiB | predicted never rises | extra never falls | measured never rises "
        "| measured under budget |",
        "|---|---|---|---|---|---|---|",
    ]
    tables, summary_notes = [], []
    for setup, batch in cases:
        eager = bench.measure(setup.with_optimizer("adamw"), batch, None, "eager").total
        rungs = bench.rungs(setup, batch)
        low = rungs[-1].prediction.peak_bytes
        budgets = [round(eager - k * (eager - low) / (count - 1)) for k in range(count)]
        rows = []
        for budget in budgets:
            chosen = bench.plan(setup, batch, budget)
            policies = tuple(chosen.policies.values())
            rows.append((budget, chosen, policies, bench.measure(setup, batch, policies)))
        predicted = [c.peak_bytes for _, c, _, _ in rows]
        extra = [c.extra_compute for _, c, _, _ in rows]
        measured = [m.total for *_, m in rows]
        checks = [
            _monotone(predicted, rising=False),
            _monotone(extra, rising=True),
            _monotone(measured, rising=False),
            all(m <= b for b, m in zip(budgets, measured)),
        ]
        summary.append(
            f"| {setup.label()}, batch {batch} | {len(rungs)} | {_mib(eager)} → {_mib(low)} | "
            + " | ".join("yes" if ok else "**NO**" for ok in checks)
            + " |"
        )
        index = {r.policies: i for i, r in enumerate(rungs)}
        every = [bench.measured.get((setup, batch, r.policies, None)) for r in rungs]
        if len(rungs) > 1 and all(every):  # every rung measured (the accuracy section's "rungs")
            falls = _monotone([m.total for m in every], rising=False)
            summary_notes.append(
                f"- {setup.label()}, batch {batch}: every rung of the ladder measured; the measured peak falls "
                f"rung by rung: **{'yes' if falls else 'NO'}** (" + ", ".join(_mib(m.total) for m in every) + " MiB)"
            )
        tables += [
            "",
            f"### {setup.label()}, batch {batch}",
            "",
            f"{count} budgets evenly from HF eager's measured step peak ({_mib(eager)} MiB) to the last rung's "
            f"predicted peak ({_mib(low)} MiB); the ladder has {len(rungs)} rungs.",
            "",
            "| budget MiB | rung | policies (layer order) | predicted MiB | measured MiB | extra compute (est.) |",
            "|---|---|---|---|---|---|",
        ]
        for budget, chosen, policies, m in rows:
            tables.append(
                f"| {_mib(budget)} | {index.get(policies, -1) + 1}/{len(rungs)} | {_policies_text(policies)} | "
                f"{_mib(chosen.peak_bytes)} | {_mib(m.total)} | {100 * chosen.extra_compute:.1f}% |"
            )
    return summary + ([""] + summary_notes if summary_notes else []) + tables


def time_steps(build: dict[str, Callable[[], Trainee]], rounds: int, log) -> dict[str, list[float]]:
    """Process CPU seconds of each variant's step, one intra-op thread, interleaved rounds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainees = {name: make() for name, make in build.items()}
        for trainee in trainees.values():
            trainee.step()  # warm-up: the optimizer state
        return time_steps_prepared(trainees, rounds, log)
    finally:
        torch.set_num_threads(threads)


def _seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def fits(bench: Bench, setup: Setup, batch: int, rounds: int) -> list[str]:
    measured_eager = bench.measure(setup, batch, None, "eager")
    eager = measured_eager.total
    n = setup.layers
    # Two readings of "x% of HF eager's peak": of the whole step (parameters and AdamW state
    # included, which no plan changes: 25% is below them), and of the part above what persists.
    budgets = [(f"{100 * f:.0f}% of the step = {_mib(round(f * eager))} MiB", round(f * eager)) for f in FIT_FRACTIONS]
    for f in FIT_FRACTIONS:
        budget = measured_eager.persistent + round(f * measured_eager.dynamic)
        budgets.append((f"persistent + {100 * f:.0f}% of the rest = {_mib(budget)} MiB", budget))
    cases = []  # (head, budget, notes, [(name, setup, policies, predicted, extra)])
    for head, budget in budgets:
        notes, chosen = [], None
        for optimizer in OPTIMIZERS:
            least = bench.rungs(setup.with_optimizer(optimizer), batch)[-1].prediction
            if least.peak_bytes > budget:
                notes.append(
                    f"{optimizer} does not fit: its smallest plannable peak is {_mib(least.peak_bytes)} MiB, at "
                    f"the {least.moment} ({_breakdown(least)})"
                )
                continue
            chosen = (setup.with_optimizer(optimizer), bench.plan(setup.with_optimizer(optimizer), batch, budget))
            break
        if chosen is None:
            cases.append((head, budget, notes, []))
            continue
        used, chosen_plan = chosen
        profiled = bench.profiled(used)
        policies = tuple(chosen_plan.policies.values())
        variants = [("plan", used, policies, chosen_plan.peak_bytes, chosen_plan.extra_compute)]
        following = [r.policies for r in chosen_plan.rungs]
        after = following[following.index(policies) + 1] if policies in following[:-1] else None
        for name, alternative in (
            ("full (all)", ("full",) * n),
            ("qkv+mlp (all)", ("qkv+mlp",) * n),
            ("next rung", after),
        ):
            if len(variants) == 3 or alternative is None or any(alternative == v[2] for v in variants):
                continue
            predicted = bench.predict(used, batch, alternative).peak_bytes
            if predicted <= budget:
                extra = _extra_compute(profiled.profile, profiled.flops, alternative)
                variants.append((name, used, alternative, predicted, extra))
        cases.append((head, budget, notes, variants))
    builds: dict[str, Callable[[], Trainee]] = {"HF eager": lambda: bench.trainee(setup, batch, None, "eager")}
    for _, _, _, variants in cases:
        for _, used, policies, _, _ in variants:
            key = f"{used.optimizer}: {_policies_text(policies)}"
            builds.setdefault(key, lambda u=used, p=policies: bench.trainee(u, batch, p))
    bench.log(f"timing {len(builds)} variants, {rounds} rounds ...")
    times = time_steps(builds, rounds, bench.log)
    lines = [
        f"{setup.label()}, batch {batch}. HF eager (unpatched, eager attention, AdamW): measured step peak "
        f"**{_mib(eager)} MiB** ({_mib(measured_eager.persistent)} MiB of it parameters, buffers, AdamW state and "
        f"batch), CPU {_seconds(times['HF eager'])} s per step. Per budget: `sf.plan`'s choice "
        "(the first optimizer, in the order adamw, adamw-fused, adamw-in-backward, with which it fits) and up "
        "to two other policies predicted to fit with that optimizer; step CPU time, one thread, "
        f"{rounds} interleaved rounds, median (min–max).",
        "",
        "| budget | optimizer | variant | policies (layer order) | predicted MiB | measured MiB | under budget "
        "| allocator MiB | extra compute (est.) | CPU s per step | vs plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for head, budget, notes, variants in cases:
        if not variants:
            lines.append(f"| {head} | every optimizer | infeasible | | | | | | | | |")
        medians = {}
        for name, used, policies, predicted, extra in variants:
            measured = bench.measure(used, batch, policies)
            values = times[f"{used.optimizer}: {_policies_text(policies)}"]
            medians[name] = statistics.median(values)
            ratio = medians[name] / medians["plan"]
            lines.append(
                f"| {head} | {used.optimizer} | {name} | {_policies_text(policies)} | {_mib(predicted)} | "
                f"{_mib(measured.total)} | {'yes' if measured.total <= budget else '**NO**'} | "
                f"{_mib(measured.allocator)} ({'under' if measured.allocator <= budget else '**over**'}) | "
                f"{100 * extra:.1f}% | "
                f"{_seconds(values)} | {ratio:.2f}x |"
            )
        for note in notes:
            summary.append(f"- {head}: {note}")
        if variants:
            fastest = min(medians, key=medians.get)
            verdict = "the plan is the fastest" if fastest == "plan" else f"**{fastest} is faster than the plan**"
            others = "" if len(variants) > 1 else " (no other policy fits)"
            summary.append(f"- {head}: fits with {variants[0][1].optimizer}; {verdict}{others}")
    return lines + [""] + summary


def floor(bench: Bench, setup: Setup, batch: int) -> list[str]:
    eager = bench.measure(setup, batch, None, "eager").total
    policies = ("qkv+mlp",) * setup.layers
    lines = [
        f"{setup.label().rsplit(',', 1)[0]}, batch {batch}, `qkv+mlp` on every layer; HF eager (AdamW) "
        f"{_mib(eager)} MiB. Target: <= {FLOOR_TARGET} of HF eager with the optimizer knob.",
        "",
        "| optimizer | predicted MiB | measured MiB | error | / HF eager | target |",
        "|---|---|---|---|---|---|",
    ]
    for optimizer in OPTIMIZERS:
        used = setup.with_optimizer(optimizer)
        predicted = bench.predict(used, batch, policies).peak_bytes
        measured = bench.measure(used, batch, policies).total
        ratio = measured / eager
        lines.append(
            f"| {optimizer} | {_mib(predicted)} | {_mib(measured)} | {_error(predicted, measured):+.2f}% | "
            f"{ratio:.3f} | {'met' if ratio <= FLOOR_TARGET else 'missed'} |"
        )
    return lines


def side_by_side(bench: Bench, setup: Setup, batch: int, rounds: int, budgets: Sequence[float]) -> list[str]:
    """HF SDPA compiled with activation_memory_budget, next to the slimformer plan at its peak."""
    import torch._functorch.config
    import torch._inductor.config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # inductor's kernels take the thread count at compile time
    rows = []  # (name, allocator Measured | None, dispatch-mode Measured | None, times | None, compile s | None, note)
    try:
        sdpa = bench.trainee(setup, batch, None, "sdpa")
        sdpa.step()
        sdpa.step()
        rows.append(("HF SDPA, eager mode", sdpa.allocator_measure(), bench.measure(setup, batch, None, "sdpa")))
        for budget in budgets:
            name = f"HF SDPA, torch.compile, activation_memory_budget {budget}"
            bench.log(f"{name} ...")
            torch._dynamo.reset()
            compiled = None
            try:
                compiled = bench.trainee(setup, batch, None, "sdpa")
                compiled.model = torch.compile(compiled.model)
                started = time.perf_counter()
                # no cache: a graph compiled under another budget must not be reused
                with (
                    torch._functorch.config.patch(activation_memory_budget=budget),
                    torch._inductor.config.patch(force_disable_caches=True),
                ):
                    compiled.step()  # compiles forward and backward
                    first = time.perf_counter() - started
                    started = time.perf_counter()
                    compiled.step()
                    compile_s = first - (time.perf_counter() - started)
                peak = compiled.allocator_measure()
            except Exception as error:  # noqa: BLE001 -- a compile failure is a result here
                bench.log(traceback.format_exc())
                rows.append((name, None, None, None, None, f"failed: {type(error).__name__}: {str(error)[:300]}"))
                continue
            try:
                chosen = bench.plan(setup, batch, peak.total)
                policies, note = tuple(chosen.policies.values()), "`sf.plan` with the compiled step's peak as budget"
            except ValueError:
                policies = bench.rungs(setup, batch)[-1].policies
                note = "the compiled step's peak is below every plan: the last rung (nearest)"
            slim = bench.trainee(setup, batch, policies)
            slim.step()
            slim_peak = slim.allocator_measure()
            times = time_steps_prepared({name: compiled, "slimformer": slim, "HF SDPA": sdpa}, rounds, bench.log)
            rows.append((name, peak, None, times[name], compile_s, ""))
            rows.append(
                (
                    f"slimformer plan: {_policies_text(policies)}",
                    slim_peak,
                    bench.measure(setup, batch, policies),
                    times["slimformer"],
                    None,
                    note,
                )
            )
            rows.append(("HF SDPA, eager mode (the same rounds)", None, None, times["HF SDPA"], None, ""))
            del compiled, slim
            gc.collect()
        torch._dynamo.reset()
    finally:
        torch.set_num_threads(threads)
    eager = bench.measure(setup, batch, None, "eager").total
    lines = [
        f"{setup.label()}, batch {batch}. Step peak (fwd + bwd + AdamW) from the CPU allocator's events "
        "(torch.profiler `profile_memory`, which also sees inductor's buffers; the dispatch-mode count of the "
        "other sections beside it where it applies) plus parameters, buffers, optimizer state and batch; ratios "
        f"to HF eager attention's step ({_mib(eager)} MiB, dispatch-mode). CPU s per step: one thread (inductor "
        f"compiled its kernels for one), {rounds} rounds interleaved with the slimformer plan and uncompiled HF "
        "SDPA. Each compiled model: `torch._dynamo.reset()`, `torch.compile(model)` (inductor, default "
        "options), its first two steps inside `torch._functorch.config.patch(activation_memory_budget=...)` "
        "with inductor's caches off; compile s = the first step's wall time less the second's.",
        "",
        "| | step peak MiB (allocator) | / HF eager | dispatch-mode count MiB | CPU s per step | compile s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, peak, counted, times, compile_s, note in [(*row, None, None, "")[:6] for row in rows]:
        lines.append(
            f"| {name} | {_mib(peak.total) if peak else ''} | {f'{peak.total / eager:.3f}' if peak else ''} | "
            f"{_mib(counted.total) if counted else ''} | {_seconds(times) if times else ''} | "
            f"{f'{compile_s:.0f}' if compile_s is not None else ''} | {note} |"
        )
    return lines


def time_steps_prepared(trainees: dict[str, Trainee], rounds: int, log) -> dict[str, list[float]]:
    """As ``time_steps`` for trainees already built and warmed up (the caller sets the threads)."""
    times: dict[str, list[float]] = {name: [] for name in trainees}
    for round_ in range(rounds):
        for name, trainee in trainees.items():
            gc.collect()
            started = time.process_time()
            trainee.step()
            times[name].append(time.process_time() - started)
        log(f"  time round {round_ + 1}/{rounds}: " + ", ".join(f"{t[-1]:.2f}s" for t in times.values()))
    return times


def _header(
    quick: bool, started: datetime.datetime, revision: str, seconds: float, sections: Sequence[str]
) -> list[str]:
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [
        "# sf.plan on the CPU (`python -m bench.plan" + (" --quick" if quick else "") + "`)",
        "",
        f"- CPU: {device_name(torch.device('cpu'))}, {os.cpu_count()} cores; torch {torch.__version__} "
        f"(1 intra-op thread throughout), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- slimformer revision at the start: {revision}; run {started:%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min, "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; sections: {', '.join(sections)}",
        "",
        "How measured: each step runs on a deep copy of the model, patched by `slimformer.patch` and set to the "
        "policies (HF baselines unpatched), with a fresh optimizer (`torch.optim.AdamW`, `fused=True`, or "
        "`slimformer.plan.optimizer_in_backward`), random weights, dropout 0.1, training mode, HF's loss (masked "
        "LM: 15% of the tokens labelled; classification: one label per row). Two steps run; the second inside "
        "`slimformer.memory.peak_memory('cpu')` (the CPU allocator's events, through torch.profiler) after "
        "`zero_grad(set_to_none=True)` and `gc.collect()`. A step's total peak is that peak plus the storages "
        "of the parameters, buffers, optimizer state and batch, the quantity `sf.plan` predicts. Predictions "
        "come from one `slimformer.plan.profile` per model, seq, dtype, padding and optimizer (measured at 1 "
        f"and 2 rows of a {EXAMPLE_ROWS}-row example batch under every policy), used for every batch; batches "
        "cycle the example's rows. Unpadded models (`unpad=True`) get an example whose rows hold "
        + " and ".join(f"{k}: {', '.join(f'{100 * f:.0f}%' for f in v)}" for k, v in UNPAD_REAL.items())
        + " real tokens. Times: process CPU time of a step, one intra-op thread, variants interleaved round after "
        "round, median (min–max).",
    ]


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    markdown: Path = args.out / ("cpu-plan-quick.md" if args.quick else "cpu-plan.md")
    refuse_to_replace(parser, [markdown], args.overwrite)
    sections = [s for s in SECTIONS if s not in args.skip]
    grid, setup, batch = (QUICK_GRID, QUICK_MAIN, QUICK_BATCH) if args.quick else (FULL_GRID, MAIN, MAIN_BATCH)
    # the brief's shape, then the same with the optimizer in backward and at twice the batch: with AdamW at
    # batch 4 the step's peak is at the embedding's backward, the same for every policy (one rung)
    monotonic_cases = [(setup, batch), (setup.with_optimizer("adamw-in-backward"), batch), (setup, 2 * batch)]
    budgets = args.budgets or (5 if args.quick else 20)
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    revision = git_revision()  # the code this run imports

    def log(message: str) -> None:
        elapsed = time.perf_counter() - clock
        print(f"[{int(elapsed // 60):3d}:{int(elapsed % 60):02d}] {message}", flush=True)

    # one intra-op thread throughout: on a small shared machine two threads that wait on each other turn any
    # other load into stalls (a step 10x slower); the bytes do not depend on it
    torch.set_num_threads(1)
    bench = Bench(log)
    titles = {
        "accuracy": "1. Accuracy: predicted vs measured step peak",
        "monotonic": "2. Monotonic: a smaller budget never costs more memory or less compute",
        "fits": "3. Fits: the plan under 50%, 35% and 25% of HF eager's peak, and its speed",
        "floor": "4. Floor: `qkv+mlp` with each optimizer",
        "side": "5. Side by side: HF under torch.compile with an activation memory budget",
    }
    body: list[str] = []
    for section in sections:
        log(f"== {titles[section]}")
        section_started = time.perf_counter()
        if section == "accuracy":
            lines = accuracy(bench, grid, setup)
        elif section == "monotonic":
            lines = monotonic(bench, monotonic_cases, budgets)
        elif section == "fits":
            lines = fits(bench, setup, batch, args.rounds)
        elif section == "floor":
            lines = floor(bench, setup, batch)
        else:
            lines = side_by_side(bench, setup, batch, args.rounds, HF_BUDGETS[:1] if args.quick else HF_BUDGETS)
        minutes = (time.perf_counter() - section_started) / 60
        body += ["", f"## {titles[section]}", "", f"({minutes:.1f} min)", "", *lines]
        print("\n".join(lines), flush=True)
    text = _header(args.quick, started, revision, time.perf_counter() - clock, sections) + body
    args.out.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(text) + "\n")
    log(f"wrote {shown(markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
