"""A BERT training step on the CPU: peak memory and CPU time, HF vs slimformer.

What a user without a GPU gets: every slimformer op runs its PyTorch reference. One
training step is forward, backward and an AdamW step of a HF ``BertModel`` (BERT-base
dims, random weights, dropout 0.1, fp32, training mode), as

* ``HF eager`` and ``HF SDPA`` (attention implementations), ``HF checkpointing``
  (eager with ``gradient_checkpointing_enable``: ``torch.utils.checkpoint`` per layer,
  non-reentrant), the peers a CPU user would otherwise pick;
* ``slimformer (POLICY)``: a ``slimformer.patch``ed copy under each recompute policy.

Two measurements, each model after one warm-up step (so AdamW's state exists):

* peak (4 layers, batch 4, seq 512): ``slimformer.memory.peak_memory`` over the step
  (live tensor bytes on CPU) above what was allocated before it, what was allocated at
  the end of the forward (the activations kept) and the peak until the end of backward;
  the table says which sets the step's peak (AdamW's update, the same for every column,
  often does);
* time (2 layers, batch 2, seq 256): process CPU time of a step, one intra-op thread,
  the models interleaved round after round (A B C ..., A B C ...) so that the shared
  machine's load hits them alike; median with min–max.

Targets (issue 12): peak at every policy <= HF eager's, at ``qkv+mlp`` <= 50% of it, at
``full`` <= HF checkpointing's; CPU time at ``none`` <= 1.3x HF eager, ``qkv+mlp`` <= 1.6x.

    python -m bench.cpu_step [--rounds 5] [--skip-peak] [--skip-time] [--columns ...] [--profile POLICY]
"""

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from slimformer._cli_args import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--skip-peak", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--columns", nargs="+", metavar="COLUMN", help="only these columns (HF eager is always in)")
    parser.add_argument("--profile", metavar="COLUMN", help="print torch.profiler's table for a policy or 'HF eager'")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from torch import nn

from slimformer.memory import peak_memory
from slimformer.memory.cli import bert_config, bert_inputs, build_bert
from slimformer.patch import patch
from slimformer.recompute import POLICIES, recompute

PEAK_SHAPE = (4, 4, 512)  # layers, batch, seq
TIME_SHAPE = (2, 2, 256)
BASELINES = ("HF eager", "HF SDPA", "HF checkpointing")
PEAK_TARGETS = {"qkv+mlp": 0.5}  # fraction of HF eager's peak; every policy <= 1.0
TIME_TARGETS = {"none": 1 / 1.3, "qkv+mlp": 1 / 1.6}  # least speed vs HF eager (its CPU time / the column's)
MiB = 2**20


@dataclass
class Trainee:
    """A model, its AdamW and the inputs of its step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: dict

    def forward_loss(self) -> torch.Tensor:
        return self.model(**self.inputs).last_hidden_state.float().square().mean()

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_loss().backward()
        self.optimizer.step()


def _variants(layers: int, batch: int, seq: int) -> dict[str, Callable[[], Trainee]]:
    """Column name -> function building its Trainee (each builds a fresh model)."""
    config = bert_config("bert-base")
    config.num_hidden_layers = layers
    inputs = bert_inputs(config, batch, seq, torch.device("cpu"))

    def hf(implementation: str, checkpointing: bool = False) -> Callable[[], Trainee]:
        def build() -> Trainee:
            torch.manual_seed(0)
            model = build_bert(config, max_seq=seq, dtype=torch.float32, device=torch.device("cpu"))
            model.set_attn_implementation(implementation)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return Trainee(model, torch.optim.AdamW(model.parameters()), inputs)

        return build

    def slim(policy: str) -> Callable[[], Trainee]:
        def build() -> Trainee:
            torch.manual_seed(0)
            model = build_bert(config, max_seq=seq, dtype=torch.float32, device=torch.device("cpu"))
            model = recompute(patch(copy.deepcopy(model), recompute=policy), policy)
            return Trainee(model, torch.optim.AdamW(model.parameters()), inputs)

        return build

    variants = {"HF eager": hf("eager"), "HF SDPA": hf("sdpa"), "HF checkpointing": hf("eager", True)}
    variants.update({f"slimformer ({policy})": slim(policy) for policy in POLICIES})
    return variants


def _selected(variants: dict, columns) -> dict:
    unknown = set(columns or ()) - set(variants)
    if unknown:
        raise ValueError(f"unknown columns {sorted(unknown)}; choose from {list(variants)}")
    return {name: build for name, build in variants.items() if not columns or name in columns}


def measure_peaks(columns=None, log=print) -> dict[str, tuple[int, int, int]]:
    """Column -> (bytes allocated at the end of the forward, peak of forward+backward, peak
    of the whole step with AdamW's update), above the step's start."""
    results = {}
    for name, build in _selected(_variants(*PEAK_SHAPE), columns).items():
        trainee = build()
        trainee.step()  # warm-up: AdamW state
        trainee.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        with peak_memory("cpu") as peak:
            loss = trainee.forward_loss()
            peak.mark("forward")
            loss.backward()
            del loss
            peak.mark("backward")
            trainee.optimizer.step()
        forward, backward = peak.marks
        after_forward, backward_peak = forward.live, max(forward.top, backward.top)
        results[name] = (after_forward, backward_peak, peak.bytes)
        log(
            f"peak {name}: forward {after_forward / MiB:,.0f} MiB, fwd+bwd {backward_peak / MiB:,.0f} MiB, "
            f"step {peak.bytes / MiB:,.0f} MiB"
        )
        del trainee
        gc.collect()
    return results


def measure_times(rounds: int, columns=None, log=print) -> dict[str, list[float]]:
    """Column -> process CPU seconds of each round's step (interleaved, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainees = {name: build() for name, build in _selected(_variants(*TIME_SHAPE), columns).items()}
        for trainee in trainees.values():
            trainee.step()  # warm-up
        times = {name: [] for name in trainees}
        for round_ in range(rounds):
            for name, trainee in trainees.items():
                gc.collect()
                start = time.process_time()
                trainee.step()
                times[name].append(time.process_time() - start)
            log(f"time round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
        return times
    finally:
        torch.set_num_threads(threads)


def peak_lines(peaks: dict[str, tuple[int, int, int]]) -> list[str]:
    eager = peaks["HF eager"][2]
    checkpointing = peaks.get("HF checkpointing", (0, 0, eager))[2]
    layers, batch, seq = PEAK_SHAPE
    lines = [
        f"Peak of a training step (fwd + bwd + AdamW), BERT-base dims, {layers} layers, batch {batch}, "
        f"seq {seq}, fp32, dropout 0.1; live tensor bytes above the step's start:",
        "",
        "| | allocated at end of forward | fwd+bwd peak | step peak | step peak set by | vs HF eager | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (forward, backward, peak) in peaks.items():
        target = ""
        if name.startswith("slimformer"):
            policy = name.removeprefix("slimformer (").removesuffix(")")
            bound, label = eager * PEAK_TARGETS.get(policy, 1.0), f"<= {PEAK_TARGETS.get(policy, 1.0):.2f}x eager"
            if policy == "full":
                bound, label = min(bound, checkpointing), "<= HF checkpointing"
            target = f"{label}: {'met' if peak <= bound else 'MISSED'}"
        setter = "AdamW update" if peak > backward else "fwd+bwd"
        lines.append(
            f"| {name} | {forward / MiB:,.0f} MiB | {backward / MiB:,.0f} MiB | {peak / MiB:,.0f} MiB | {setter} "
            f"| {peak / eager:.2f}x | {target} |"
        )
    if any(peak > backward for _, backward, peak in peaks.values()):
        lines += [
            "",
            "Set by AdamW update: the step's peak comes after the backward, from the gradients and the update's "
            "temporaries, not from the activations, so no recompute policy lowers it.",
        ]
    return lines


def time_lines(times: dict[str, list[float]]) -> list[str]:
    eager = statistics.median(times["HF eager"])
    layers, batch, seq = TIME_SHAPE
    lines = [
        f"CPU time of a training step, {layers} layers, batch {batch}, seq {seq}, one thread, "
        f"{len(times['HF eager'])} interleaved rounds (process CPU time, median and min–max):",
        "",
        "| | CPU s | speed vs HF eager | target |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        policy = name.removeprefix("slimformer (").removesuffix(")")
        target = ""
        if name.startswith("slimformer") and policy in TIME_TARGETS:
            least = TIME_TARGETS[policy]
            target = f">= {least:.2f}x: {'met' if eager / median >= least else 'MISSED'}"
        lines.append(
            f"| {name} | {median:.2f} ({min(values):.2f}–{max(values):.2f}) | {eager / median:.2f}x | {target} |"
        )
    return lines


def profile(policy: str, rows: int = 25) -> str:
    """torch.profiler's table of one step (time shape, one thread), by self CPU time."""
    torch.set_num_threads(1)
    name = f"slimformer ({policy})" if policy in POLICIES else policy
    trainee = _variants(*TIME_SHAPE)[name]()
    trainee.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainee.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.profile:
        print(profile(args.profile))
        return 0
    columns = None if not args.columns else ["HF eager", *args.columns]
    lines = []
    if not args.skip_peak:
        lines += peak_lines(measure_peaks(columns)) + [""]
    if not args.skip_time:
        lines += time_lines(measure_times(args.rounds, columns))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
