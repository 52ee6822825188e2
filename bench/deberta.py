"""DeBERTa-v3-base training on the CPU: HF eager against ``slimformer.patch`` (fused disentangled attention).

The model: ``DebertaV2ForSequenceClassification`` with DeBERTa-v3-base's config built here
(hidden 768, 12 heads, FFN 3072, vocab 128100, 256 position buckets, c2p + p2c, shared
attention keys), random weights, fp32, dropout 0.1, two labels, seq 512, no padding. HF
runs its own (eager) attention; ``slimformer.patch`` fuses every ``DebertaV2Layer``, whose
disentangled attention runs on the CPU as a blockwise PyTorch reference that never builds
a (seq, seq) tensor. One process, one intra-op thread throughout. Four parts:

1. **One layer**, training mode: bytes saved for backward per token per hidden unit
   (``slimformer.memory.measure_activation_memory``, the larger of its two counts; the
   layer's inputs, its parameters and the encoder's relative-position embeddings
   excluded), HF eager against the patched layer at every recompute policy. Measured at
   two batch sizes: the bytes per token at each, and their difference per token (what
   each further token costs; the rest is per layer and batch-independent: the position
   projections). Target (the issue): ``none`` <= 0.15x HF eager.
2. **Whole model**, 12 layers, batch 8, measured directly: the peak of a training step
   (forward, backward, ``torch.optim.AdamW`` update) counted by the CPU allocator's own
   events (``torch.profiler`` with ``profile_memory``, as ``bench.plan`` and
   ``bench.compile_memory`` read it; it also sees the temporaries inside slimformer's
   custom ops) above the step's start, plus the storages of the parameters, buffers,
   AdamW state and batch. AdamW's state is made first by an update on zero gradients (no
   forward: a 12-layer step at batch 8 costs about a CPU minute), so the measured step is a
   steady one. The largest batch in 16 GiB: for HF eager a linear fit, peak = a + b ·
   batch through its measured steps at batch 4 and 8 (the activations dominate both); for
   slimformer ``sf.plan``'s prediction (``slimformer.plan.profile`` of the 12-layer
   patched model at 1, 2 and 4 rows under every policy, predicted stage by stage: a line
   through two batches would miss where the peak moves from the update to the backward),
   whose prediction at batch 8 is shown beside the measurement (both read from the
   allocator).
3. **Time**: forward + backward of the classification loss of the whole model at 2
   layers, batch 4 (the AdamW update, the same for both, left out), of one encoder layer
   alone at batch 4, and of one layer without attention dropout (a diagnostic: what the
   attention dropout's CPU keep mask costs); process CPU time, the variants interleaved
   round after round (A B C ..., A B C ...) after a warm-up, median (min–max). Timed
   twice: first, in the fresh process, and last, after the memory parts (the ratio has
   come out differently in the two states). Ratio slimformer / HF: lower is faster;
   target <= 1.0x.
4. **Agreement**: the 12-layer model in eval mode on 2 rows, the second padded to 3/4 of
   seq: largest |difference| of the logits and of the last hidden states at the real
   tokens, patched vs HF.

    python -m bench.deberta [--quick] [--rounds 7] [--out DIR] [--overwrite]

Writes ``cpu-deberta.md`` (``cpu-deberta-quick.md`` with ``--quick``: tiny dims, seconds)
into ``--out`` (default bench/results/local/, git-ignored) and replaces no file unless
``--overwrite``. The full run takes about 15 minutes on a 2-core CPU (about 11 GiB at its peak: HF's
12-layer step at batch 8).
"""

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from slimformer._cli_args import positive_int
from tools.results import add_output_arguments, refuse_to_replace, shown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.deberta", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny dims, a smoke run of every part (seconds)")
    parser.add_argument(
        "--rounds", type=positive_int, default=None, help="interleaved timing rounds (default 7; quick 2)"
    )
    add_output_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from torch import nn

import slimformer as sf
from bench.compile_memory import _allocations, _running_peak
from bench.harness import device_name, git_revision
from slimformer.integrations.hf.deberta import FusedDebertaV2LayerMixin
from slimformer.memory import measure_activation_memory
from slimformer.plan import profile, synthetic_batch
from slimformer.plan.planner import choose, largest_batch
from slimformer.recompute import POLICIES

MiB, GiB = 2**20, 2**30
DEBERTA_V3_BASE = dict(
    vocab_size=128100,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    max_position_embeddings=512,
    relative_attention=True,
    position_buckets=256,
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    pos_att_type=["p2c", "c2p"],
    position_biased_input=False,
    type_vocab_size=0,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    layer_norm_eps=1e-7,
    max_relative_positions=-1,
)
TINY = {  # --quick only
    **DEBERTA_V3_BASE,
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 128,
    "position_buckets": 32,
}
KEPT_TARGET = 0.15  # one layer at none, vs HF eager
TIME_TARGET = 1.0  # slimformer none / HF eager, CPU time of a step
HF = "HF eager"
PEAK_COLUMNS = (HF, "slimformer none", "slimformer qkv+mlp")


@dataclasses.dataclass(frozen=True)
class Settings:
    config: dict
    seq: int
    layer_batches: tuple[int, int]  # part 1: one layer's kept bytes at these batches
    layers: int  # the whole model's (parts 2 and 4)
    peak_batch: int  # part 2's batch
    hf_fit_batches: tuple[int, int]  # part 2: HF's linear fit through its steps at these batches
    budget: int  # part 2: the largest batch that fits this
    time_layers: int  # part 3
    time_batch: int


FULL = Settings(DEBERTA_V3_BASE, 512, (2, 8), 12, 8, (4, 8), 16 * GiB, 2, 4)
QUICK = Settings(TINY, 128, (1, 2), 3, 4, (2, 4), 64 * MiB, 1, 2)


def _policy(column: str) -> str | None:
    return None if column == HF else column.removeprefix("slimformer ")


def build(settings: Settings, layers: int, policy: str | None, cls: str = "DebertaV2ForSequenceClassification"):
    """A model with ``layers`` layers, the same random weights for every column (seed 0), in
    training mode: HF's (``policy`` None) or patched with every layer at ``policy``."""
    import transformers

    config = transformers.DebertaV2Config(**{**settings.config, "num_hidden_layers": layers}, num_labels=2)
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).train()
    if policy is None:
        return model
    sf.recompute(sf.patch(model), policy)
    unfused = [type(m).__name__ for m in _encoder(model).layer if not isinstance(m, FusedDebertaV2LayerMixin)]
    if unfused:
        raise RuntimeError(f"slimformer.patch left {len(unfused)} DeBERTa layers unfused: {unfused[:3]}")
    return model


def _encoder(model: nn.Module) -> nn.Module:
    return getattr(model, "deberta", model).encoder


def _layer_call(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, tuple, dict]:
    """The first encoder layer of ``model`` and its arguments for hidden states ``x``, as the
    encoder makes them (patched: a padding mask and relative positions, not (seq, seq) tensors)."""
    encoder = _encoder(model)
    mask = encoder.get_attention_mask(torch.ones(x.shape[:2], dtype=torch.long))
    return encoder.layer[0], (x, mask), {"relative_pos": encoder.get_rel_pos(x)}


# ----------------------------------------------------------------------------- 1. one layer


def layer_kept(settings: Settings, log) -> dict[str, dict[int, int]]:
    """Column -> {batch: bytes one layer's training forward keeps for backward}."""
    models = {
        HF: build(settings, 1, None, "DebertaV2Model"),
        "slimformer": build(settings, 1, "none", "DebertaV2Model"),
    }
    kept: dict[str, dict[int, int]] = {}
    generator = torch.Generator().manual_seed(0)
    for batch in settings.layer_batches:
        x = torch.randn(batch, settings.seq, settings.config["hidden_size"], generator=generator, requires_grad=True)
        for column in (HF, *(f"slimformer {p}" for p in POLICIES)):
            model = models[HF if column == HF else "slimformer"]
            layer, args, kwargs = _layer_call(model, x)
            if column != HF:
                layer.recompute = _policy(column)
            rel_embeddings = _encoder(model).get_rel_embedding()  # as the encoder hands it: with its graph
            torch.manual_seed(0)
            memory = measure_activation_memory(layer, *args, **kwargs, rel_embeddings=rel_embeddings)
            kept.setdefault(column, {})[batch] = max(memory.saved_bytes, memory.alive_bytes)
            log(f"  one layer, batch {batch}, {column}: {kept[column][batch] / MiB:,.1f} MiB kept")
            del memory, rel_embeddings
            gc.collect()
    return kept


def layer_lines(settings: Settings, kept: dict[str, dict[int, int]]) -> list[str]:
    b0, b1 = settings.layer_batches
    seq, hidden = settings.seq, settings.config["hidden_size"]

    def per_token(column: str, batch: int) -> float:
        return kept[column][batch] / (batch * seq * hidden)

    def slope(column: str) -> float:  # bytes of each further token, per hidden unit
        return (kept[column][b1] - kept[column][b0]) / ((b1 - b0) * seq * hidden)

    def constant(column: str) -> float:  # what the layer keeps whatever the batch
        return kept[column][b0] - slope(column) * b0 * seq * hidden

    lines = [
        f"One `DebertaV2Layer`, seq {seq}, training mode (dropout 0.1): bytes saved for backward / (tokens × "
        f"hidden), at batch {b0} and {b1}; *per further token*: the difference of the two per added token; "
        f"*per layer*: the rest, the same at any batch (the position projections of the 2 × "
        f"{settings.config['position_buckets']} relative embeddings and their dropout). Ratios to HF eager.",
        "",
        f"| | batch {b0} B/token/hidden | vs HF | batch {b1} B/token/hidden | vs HF | per further token "
        "| vs HF | per layer MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for column in kept:
        lines.append(
            f"| {column} | {per_token(column, b0):.2f} | {per_token(column, b0) / per_token(HF, b0):.3f}x | "
            f"{per_token(column, b1):.2f} | {per_token(column, b1) / per_token(HF, b1):.3f}x | "
            f"{slope(column):.2f} | {slope(column) / slope(HF):.3f}x | {constant(column) / MiB:.2f} |"
        )
    ratios = {
        f"batch {b0}": per_token("slimformer none", b0) / per_token(HF, b0),
        f"batch {b1}": per_token("slimformer none", b1) / per_token(HF, b1),
        "per further token": slope("slimformer none") / slope(HF),
    }
    lines += [
        "",
        f"- target, `none` <= {KEPT_TARGET}x HF eager: "
        + "; ".join(f"{name} {r:.3f}x **{_verdict(r <= KEPT_TARGET)}**" for name, r in ratios.items()),
    ]
    return lines


# ----------------------------------------------------------------------------- 2. whole model, step peak


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """A training step's memory, bytes: what persists (parameters, buffers, AdamW state, batch)
    and the most the CPU allocator held above the step's start during forward + backward and
    during the update (the gradients included)."""

    persistent: int
    backward: int
    update: int

    @property
    def total(self) -> int:
        return self.persistent + max(self.backward, self.update)

    @property
    def phase(self) -> str:
        return "forward + backward" if self.backward >= self.update else "AdamW update"


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def step_peak(settings: Settings, batch: int, policy: str | None) -> StepPeak:
    """One steady training step of a fresh whole model (see the module docstring), its peak read
    from the CPU allocator's events."""
    model = build(settings, settings.layers, policy)
    inputs = synthetic_batch(model, batch, settings.seq)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # makes the state
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    with _allocations() as forward_backward:
        loss = model(**inputs).loss
        loss.backward()
        del loss
    with _allocations() as update:
        optimizer.step()
    after_backward, backward = _running_peak(0, forward_backward)
    _, peak_update = _running_peak(after_backward, update)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    persistent = _storage_bytes([*model.parameters(), *model.buffers(), *state, *inputs.values()])
    return StepPeak(persistent, backward, peak_update)


def _largest(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest batch in [1, limit] for which ``fits`` holds (it holds below it), 0 if none."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def step_peaks(settings: Settings, log) -> dict[str, dict[int, StepPeak]]:
    """Column -> {batch: its measured step}: every column at the peak batch, HF also at the other
    batch of its fit."""
    batches = {column: (settings.peak_batch,) for column in PEAK_COLUMNS}
    batches[HF] = settings.hf_fit_batches
    out: dict[str, dict[int, StepPeak]] = {}
    for column, column_batches in batches.items():
        for batch in column_batches:
            started = time.perf_counter()
            step = out.setdefault(column, {})[batch] = step_peak(settings, batch, _policy(column))
            gc.collect()
            log(
                f"  step peak, {column}, {settings.layers} layers, batch {batch}: {step.total / MiB:,.0f} MiB, in "
                f"the {step.phase} ({time.perf_counter() - started:.0f} s)"
            )
    return out


@dataclasses.dataclass(frozen=True)
class Planned:
    """``sf.plan``'s prediction for the patched whole model at one uniform policy."""

    peak: int  # at the peak batch
    moment: str
    largest: int  # the largest batch whose step fits the budget


def planner(settings: Settings, log) -> tuple[dict[str, Planned], int, str, float]:
    """(policy -> Planned for none and qkv+mlp, the largest batch of any plan, its policies, the
    profile's seconds), from one ``slimformer.plan.profile`` of the whole patched model."""
    model = build(settings, settings.layers, "none")
    started = time.perf_counter()
    profile_, flops = profile(
        model, synthetic_batch(model, 2, settings.seq), optimizer="adamw", progress=lambda m: log(f"  profile: {m}")
    )
    seconds = time.perf_counter() - started
    out = {}
    for policy in ("none", "qkv+mlp"):
        policies = (policy,) * settings.layers
        prediction = profile_.predict(policies, settings.peak_batch)
        largest = _largest(lambda batch: profile_.predict(policies, batch).peak_bytes <= settings.budget)
        out[policy] = Planned(prediction.peak_bytes, prediction.moment, largest)
    best = largest_batch(profile_, flops, settings.budget)
    chosen = choose(profile_, flops, settings.budget, best)
    names = list(chosen.policies.values())
    mix = ", ".join(f"{p} ×{names.count(p)}" for p in dict.fromkeys(names))
    return out, best, mix, seconds


def _hf_fit(settings: Settings, steps: dict[int, StepPeak]) -> tuple[float, float]:
    """(a, b) of HF's peak = a + b · batch through its two measured steps."""
    (b0, b1) = settings.hf_fit_batches
    slope = (steps[b1].total - steps[b0].total) / (b1 - b0)
    return steps[b0].total - slope * b0, slope


def peak_lines(
    settings: Settings, peaks: dict[str, dict[int, StepPeak]], planned: tuple[dict[str, Planned], int, str, float]
) -> list[str]:
    n, batch, budget = settings.layers, settings.peak_batch, settings.budget
    by_policy, best, mix, profile_seconds = planned
    hf = peaks[HF][batch].total
    a, b = _hf_fit(settings, peaks[HF])
    hf_largest = _largest(lambda rows: a + b * rows <= budget)
    b0, b1 = settings.hf_fit_batches
    lines = [
        f"`DebertaV2ForSequenceClassification`, {n} layers, batch {batch} × {settings.seq}, one training step "
        "(forward, backward, AdamW), **measured**: the most the CPU allocator held during the step (torch.profiler "
        "memory events) above its start, plus the storages of the parameters, buffers, AdamW state and batch "
        "(*persistent*). *Largest batch in "
        f"{_size(budget)}*: HF eager from a **linear fit** peak = a + b · batch through its measured steps at batch "
        f"{b0} and {b1} (a = {a / MiB:,.0f} MiB, b = {b / MiB:,.0f} MiB per row; `sf.plan` cannot profile HF's "
        "own layers, it patches them); slimformer from `sf.plan` (`slimformer.plan.profile` of the patched model, "
        f"measured at 1, 2 and 4 rows under every policy in {profile_seconds:.0f} s, then predicted per stage; its "
        "bytes are counted by a dispatch mode, which does not see the temporaries inside the custom ops' CPU "
        "reference), with its prediction at this batch beside the measurement.",
        "",
        f"| | step peak MiB | vs HF | peak in | of it persistent MiB | `sf.plan` predicted MiB (peak at) | "
        f"predicted / measured | largest batch in {_size(budget)} | how |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for column, steps in peaks.items():
        step = steps[batch]
        policy = _policy(column)
        if policy is None:
            planned_cells = "| |"
            largest = f"{hf_largest} | linear fit (batch {b0}: {steps[b0].total / MiB:,.0f} MiB measured)"
        else:
            plan_ = by_policy[policy]
            planned_cells = f"{plan_.peak / MiB:,.0f} ({plan_.moment}) | {plan_.peak / step.total - 1:+.1%} |"
            largest = f"{plan_.largest} | `sf.plan`, {policy} on every layer"
        lines.append(
            f"| {column} | **{step.total / MiB:,.0f}** | {step.total / hf:.3f}x | {step.phase} | "
            f"{step.persistent / MiB:,.0f} | {planned_cells} {largest} |"
        )
    lines.append(f"| `sf.plan`'s least-memory plan ({mix}) | | | | | | | {best} | `sf.plan` |")
    return lines


# ----------------------------------------------------------------------------- 3. time


NO_ATTENTION_DROPOUT = "one layer, attention dropout 0"


def step_times(settings: Settings, rounds: int, log) -> dict[str, list[float]]:
    """Variant -> process CPU seconds of its forward + backward per round, interleaved."""
    models = {
        HF: build(settings, settings.time_layers, None),
        "slimformer none": build(settings, settings.time_layers, "none"),
    }
    undropped = dataclasses.replace(settings, config={**settings.config, "attention_probs_dropout_prob": 0.0})
    layer_models = {name: build(undropped, 1, _policy(name), "DebertaV2Model") for name in models}
    inputs = synthetic_batch(models[HF], settings.time_batch, settings.seq)
    generator = torch.Generator().manual_seed(0)
    shape = (settings.time_batch, settings.seq, settings.config["hidden_size"])
    x = torch.randn(shape, generator=generator, requires_grad=True)
    grad = torch.randn(shape, generator=generator)

    def whole(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()

        return step

    def one_layer(model: nn.Module) -> Callable[[], None]:
        layer, args, kwargs = _layer_call(model, x)
        encoder = _encoder(model)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            x.grad = None
            layer(*args, **kwargs, rel_embeddings=encoder.get_rel_embedding())[0].backward(grad)

        return step

    steps = {f"{name}, whole model": whole(model) for name, model in models.items()}
    steps |= {f"{name}, one layer": one_layer(model) for name, model in models.items()}
    steps |= {f"{name}, {NO_ATTENTION_DROPOUT}": one_layer(model) for name, model in layer_models.items()}
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds):
        for name, step in steps.items():
            gc.collect()
            started = time.process_time()
            step()
            times[name].append(time.process_time() - started)
        log(f"  time round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    return times


def _seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


TIMINGS = ("first", "last")  # when the timing runs: before every other part, and after them


def time_lines(settings: Settings, runs: dict[str, dict[str, list[float]]], rounds: int) -> list[str]:
    """The time table of both timing runs (``TIMINGS`` -> variant -> CPU seconds per round)."""
    variants = len(runs[TIMINGS[0]])
    lines = [
        f"Forward + backward (the AdamW update, the same for both, left out), batch {settings.time_batch} × "
        f"{settings.seq}: the whole classification model at {settings.time_layers} layers (its loss), its first "
        "encoder layer alone (a fixed random output gradient), and a layer alone without attention dropout (the "
        "hidden dropouts kept), which isolates what slimformer's attention dropout costs on the CPU: its keep mask "
        "is drawn from the GPU kernels' Philox streams (`slimformer.kernels.philox`: a C loop where a C compiler "
        "is found, else PyTorch ops), once in forward and again in backward. Process CPU seconds, one intra-op "
        f"thread, {rounds} rounds, the {variants} variants interleaved, median (min–max). Timed twice in the "
        "same process: *first*, before any other part, and *last*, after the memory parts (the whole model's "
        "training steps, HF's the largest allocation of the run, and the planner's profile).",
        "",
        "| | when | HF eager s | slimformer none s | slimformer / HF | target |",
        "|---|---|---|---|---|---|",
    ]
    for what in ("whole model", "one layer", NO_ATTENTION_DROPOUT):
        for when, times in runs.items():
            hf, ours = times[f"{HF}, {what}"], times[f"slimformer none, {what}"]
            ratio = statistics.median(ours) / statistics.median(hf)
            if what == NO_ATTENTION_DROPOUT:
                target = "(diagnostic)"
            else:
                target = f"<= {TIME_TARGET:.1f}x: **{_verdict(ratio <= TIME_TARGET)}**"
            lines.append(f"| {what} | {when} | {_seconds(hf)} | {_seconds(ours)} | {ratio:.2f}x | {target} |")
    return lines


# ----------------------------------------------------------------------------- 4. agreement


def agreement(settings: Settings) -> dict[str, float]:
    """Largest |patched − HF| of the logits and of the last hidden states at the real tokens, eval
    mode, 2 rows, the second padded; and the largest |logit| for scale."""
    outputs = []
    for policy in (None, "none"):
        model = build(settings, settings.layers, policy).eval()
        inputs = synthetic_batch(model, 2, settings.seq)
        inputs["attention_mask"][1, 3 * settings.seq // 4 :] = 0
        del inputs["labels"]
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
        outputs.append((out.logits, out.hidden_states[-1][inputs["attention_mask"].bool()]))
        del model
        gc.collect()
    (hf_logits, hf_states), (logits, states) = outputs
    return {
        "logits": (logits - hf_logits).abs().max().item(),
        "scale": hf_logits.abs().max().item(),
        "states": (states - hf_states).abs().max().item(),
    }


def agreement_lines(settings: Settings, diff: dict[str, float]) -> list[str]:
    return [
        f"- {settings.layers}-layer model, eval, 2 rows × {settings.seq} (the second padded from "
        f"{3 * settings.seq // 4}): max |Δ logits| patched vs HF **{diff['logits']:.2e}** (largest |logit| "
        f"{diff['scale']:.3f}); max |Δ last hidden state| at the real tokens {diff['states']:.2e}"
    ]


# ----------------------------------------------------------------------------- report


def _size(size: int) -> str:
    return f"{size / GiB:g} GiB" if size >= GiB else f"{size / MiB:g} MiB"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _header(quick: bool, command: str, started: datetime.datetime, revision: str, seconds: float) -> list[str]:
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [
        f"# DeBERTa-v3-base training on the CPU: HF eager vs slimformer (`{command}`)",
        "",
        f"- CPU: {device_name(torch.device('cpu'))}, {os.cpu_count()} cores, ATen CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; 1 intra-op thread throughout; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- slimformer revision at the start: {revision}; run {started:%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min, "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (a shared machine: CPU times are "
        "process CPU time, which other load inflates less than wall time)",
        "- the model: "
        + ("tiny dims (--quick)" if quick else "DeBERTa-v3-base's config")
        + ", random weights, fp32, dropout 0.1, no padding in training; slimformer: `slimformer.patch` (every "
        "`DebertaV2Layer` fused; the disentangled attention on its blockwise PyTorch reference on the CPU) then "
        "`slimformer.recompute(model, policy)`. Method: the module docstring of `bench/deberta.py`. Sizes: "
        "the fewest that give stable numbers on this machine (one layer at batch 2 and 8; the whole model "
        "measured once per column; timing at 2 layers).",
    ]


def report(settings: Settings, rounds: int, log) -> list[str]:
    """The report's sections, measuring everything (the timing first and again last)."""
    titles = {
        "kept": "1. One layer: kept bytes per token per hidden unit",
        "peak": f"2. Whole model: step peak at {settings.layers} layers, batch {settings.peak_batch}, and the "
        "largest batch",
        "time": "3. CPU time of a training step",
        "agreement": "4. Agreement (sanity)",
    }
    bodies: dict[str, list[str]] = {}
    minutes: dict[str, float] = dict.fromkeys(titles, 0.0)
    timings: dict[str, dict[str, list[float]]] = {}
    for part in ("time", "kept", "peak", "time", "agreement"):
        log(f"== {titles[part]}" + (f" ({TIMINGS[len(timings)]})" if part == "time" else ""))
        started = time.perf_counter()
        if part == "kept":
            bodies[part] = layer_lines(settings, layer_kept(settings, log))
        elif part == "peak":
            peaks = step_peaks(settings, log)
            log("  sf.plan profile of the whole patched model ...")
            bodies[part] = peak_lines(settings, peaks, planner(settings, log))
        elif part == "time":
            timings[TIMINGS[len(timings)]] = step_times(settings, rounds, log)
            bodies[part] = time_lines(settings, timings, rounds) if len(timings) == len(TIMINGS) else []
        else:
            bodies[part] = agreement_lines(settings, agreement(settings))
        gc.collect()
        print("\n".join(bodies[part]), flush=True)
        minutes[part] += (time.perf_counter() - started) / 60
    sections = []
    for part, title in titles.items():
        sections += ["", f"## {title}", "", f"({minutes[part]:.1f} min)", "", *bodies[part]]
    return sections


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 7)
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    path: Path = args.out / ("cpu-deberta-quick.md" if args.quick else "cpu-deberta.md")
    refuse_to_replace(parser, [path], args.overwrite)
    settings = QUICK if args.quick else FULL
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    revision = git_revision()  # the code this run imports

    def log(message: str) -> None:
        elapsed = time.perf_counter() - clock
        print(f"[{int(elapsed // 60):3d}:{int(elapsed % 60):02d}] {message}", flush=True)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        body = report(settings, rounds, log)
    finally:
        torch.set_num_threads(threads)
    command = "python -m bench.deberta" + (" --quick" if args.quick else "")
    command += f" --rounds {args.rounds}" if args.rounds is not None else ""
    text = _header(args.quick, command, started, revision, time.perf_counter() - clock) + body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text) + "\n")
    log(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
