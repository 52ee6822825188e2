"""The check's run: the phases in order, each under its cap, the report rewritten as it goes."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench.gpu_check import FULL_CAPS_S, phase_cap, report
from bench.gpu_check.cases import run_case
from bench.gpu_check.correctness import run_gpu_tests
from bench.gpu_check.environment import ceilings, describe, device_slug
from bench.gpu_check.kernels import all_cases
from bench.gpu_check.precompile import Precompiler, keys_in_order, triton_cache_entries
from bench.gpu_check.timing import Clock

REPORT_FILES = {"md": "{slug}.md", "json": "{slug}.json", "junit": "{slug}-tests.xml", "log": "{slug}-tests.log"}


def _raise_recompile_limits() -> None:
    """One function (FlexAttention, a norm wrapper's forward) is compiled for many shapes
    and masks here, more than dynamo's default of 8 per code object."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


def _paths(out: Path, slug: str) -> dict[str, Path]:
    return {key: out / pattern.format(slug=f"gpu-{slug}") for key, pattern in REPORT_FILES.items()}


def run_check(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.budget
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.gpu_check: no CUDA device here; --dry-run runs every phase on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    env = describe(device)
    slug = ("dry-run-" if args.dry_run else "") + device_slug(env)
    paths = _paths(args.out, slug)
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not args.overwrite:
        print(
            f"bench.gpu_check: {', '.join(existing)} exist(s); pass --overwrite to replace them, or another --out",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    _raise_recompile_limits()
    state = {
        "meta": {
            "command": " ".join(["python -m bench.gpu_check", *sys.argv[1:]]),
            "budget_s": args.budget,
            "dry_run": args.dry_run,
            "phases": args.phases,
            "full_caps_s": FULL_CAPS_S,
        },
        "environment": env,
        "phases": {},
    }
    print(f"bench.gpu_check: {env['device']}, writing {paths['md']} and {paths['json'].name}", flush=True)
    clock = Clock(device, **({"max_rounds": 3, "min_rounds": 2} if args.dry_run else {}))
    cases = [
        c
        for c in all_cases(args.dry_run, device, copies=1 if args.dry_run else 2)
        if not args.cases or any(text in c.key for text in args.cases)
    ]

    def phase(name, body):
        if name not in args.phases:
            return
        cap = phase_cap(name, args.phases, deadline)
        began = time.monotonic()
        print(f"[{name}] up to {cap:.0f} s", flush=True)
        state["phases"][name] = {"status": "running", "seconds": 0.0, "cap_s": cap}
        try:
            body(began + cap, cap)
            status = "done"
        except Exception as error:
            state.setdefault("errors", []).append(f"{name}: {type(error).__name__}: {error}")
            status = f"failed ({type(error).__name__}: {str(error)[:200]})"
        state["phases"][name].update(status=status, seconds=time.monotonic() - began)
        report.write(state, paths)

    def environment(phase_deadline, cap):
        state["ceilings"] = ceilings(clock, args.dry_run)

    precompiler = None
    compiling_phases = [p for p in ("speed", "model") if p in args.phases]
    if compiling_phases and "correctness" in args.phases:
        workers = args.precompile_workers if args.precompile_workers is not None else (1 if args.dry_run else 4)
        keys = keys_in_order([c.key for c in cases] if "speed" in args.phases else [], "model" in args.phases)
        cache_before = triton_cache_entries()
        precompiler = Precompiler(keys, workers, args.dry_run) if workers > 0 else None

    def correctness(phase_deadline, cap):
        used = precompiler.workers if precompiler else 0
        workers = args.test_workers if args.test_workers is not None else max(1, (os.cpu_count() or 2) - used)
        state["correctness"] = run_gpu_tests(
            paths["junit"], paths["log"], cap, 1 if args.dry_run else workers, args.tests
        )

    def speed(phase_deadline, cap):
        state["speed"] = {"rows": [], "not_run": []}
        for case in cases:
            if time.monotonic() > phase_deadline - 1.0:
                state["speed"]["not_run"].append(case.key)
                continue
            print(f"  {case.key}", flush=True)
            state["speed"]["rows"].extend(row.to_json() for row in run_case(case, clock, phase_deadline))
            report.write(state, paths)

    def model_phase(phase_deadline, cap):
        from bench.gpu_check import model

        state["model"] = {"train": {}, "infer": {}, "plan": {}}

        def record(kind, name, result):
            print(f"  {kind} {name}", flush=True)
            state["model"][kind][name] = result
            report.write(state, paths)

        model.run(device, args.dry_run, phase_deadline, record)

    phase("environment", environment)
    phase("correctness", correctness)
    if precompiler is not None:
        state["precompile"] = precompiler.stop()
        state["precompile"]["triton_cache_entries"] = {
            "before": cache_before,
            "workers_stopped": triton_cache_entries(),
        }
    phase("speed", speed)
    if precompiler is not None:
        state["precompile"]["triton_cache_entries"]["after_speed"] = triton_cache_entries()
    phase("model", model_phase)
    state["meta"]["seconds"] = time.monotonic() - start
    report.write(state, paths)
    report.print_summary(state)
    print(f"bench.gpu_check: wrote {paths['md']} and {paths['json'].name} in {state['meta']['seconds']:.0f} s")
    return 0
