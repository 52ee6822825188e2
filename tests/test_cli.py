"""Every command line of bench/, examples/, tools/ and ``python -m slimformer.memory``: ``--help``
describes it and runs nothing, an unknown argument is a usage error, and a run that
writes results writes them into the git-ignored local folder by default and never
replaces a file that exists without ``--overwrite``. Each command's ``main(argv)`` runs
in this process; the commands behind the arguments are replaced where a test reaches
past the argument checks."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import int8_inference, int8_profile, report
from bench.harness import device_name, device_slug, report_machine_info
from examples import train_bert_mlm
from tools import results
from tools.compile_report import report as compile_report

ROOT = Path(__file__).resolve().parent.parent
MAIN_GUARD = 'if __name__ == "__main__":'
# The script modules of bench/, examples/ and tools/ (a new one is checked as soon as it
# exists), and python -m slimformer.memory, whose __main__ calls slimformer.memory.cli.main.
CLIS = (
    [
        f"{folder}.{path.stem}"
        for folder in ("bench", "examples")
        for path in sorted((ROOT / folder).glob("*.py"))
        if MAIN_GUARD in path.read_text()
    ]
    + [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / "tools").rglob("*.py"))
        if MAIN_GUARD in path.read_text()
    ]
    + ["slimformer.memory.cli", "slimformer.plan.cli"]
)
KNOWN = {
    "bench.report", "bench.int8_inference", "bench.int8_profile", "bench.unpad", "bench.cpu_step",
    "bench.mlm_memory", "bench.compile_memory", "tools.compile_report.__main__", "tools.compile_report.tutorial",
    "examples.finetune_classifier", "examples.layer_memory", "examples.quantize_bert", "examples.train_bert_mlm",
    "slimformer.memory.cli", "slimformer.plan.cli", "bench.plan",
}  # fmt: skip
REQUIRED_ARGUMENTS = {
    "tools.compile_report.tutorial": ["06-fused-attention.py"],
    "slimformer.plan.cli": ["--budget", "1GiB"],
    "bench.disentangled_tiles": ["--out", "unused"],
}
CPU_SLUG = device_slug(device_name(torch.device("cpu")), "cpu")  # the INT8 benchmarks' files


class _Ran(Exception):
    """Raised by a stand-in for the work a command does after its argument checks."""


def _ran(*args, **kwargs):
    raise _Ran


def _command_name(module: str) -> str:
    """What the usage line must name: ``bench.report``, ``train_bert_mlm.py``, ``slimformer.memory``,
    ``tools.compile_report``."""
    if module.startswith("examples."):
        return module.removeprefix("examples.") + ".py"
    if module.endswith(".__main__"):
        return module.removesuffix(".__main__")
    return module.removesuffix(".cli") if module.startswith("slimformer.") else module


def _exit_code(main, argv) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def test_every_known_cli_is_checked():
    assert KNOWN <= set(CLIS), sorted(KNOWN - set(CLIS))


@pytest.mark.parametrize("module", CLIS)
def test_help_describes_the_command(module, capsys):
    assert _exit_code(importlib.import_module(module).main, ["--help"]) == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert usage.startswith("usage: ") and _command_name(module) in usage, usage
    description = rest.split("\n\n")[0]
    assert not description.startswith(("options:", "positional arguments:")), out
    assert len(description.split()) >= 6, description  # a sentence saying what it does


@pytest.mark.parametrize("module", CLIS)
def test_unknown_argument_is_a_usage_error(module, capsys):
    argv = [*REQUIRED_ARGUMENTS.get(module, []), "--no-such-option"]
    assert _exit_code(importlib.import_module(module).main, argv) == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_bench_report_help_is_its_own_and_starts_no_run(monkeypatch, capsys):
    monkeypatch.setattr(report, "run_benchmarks", _ran)
    assert _exit_code(report.main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m bench.report") and "--overwrite" in out and "-k EXPR" in out


def test_results_go_to_a_git_ignored_local_folder():
    assert results.LOCAL_RESULTS == ROOT / "bench" / "results" / "local"
    assert "bench/results/local/" in (ROOT / ".gitignore").read_text().splitlines()
    assert report._parser().parse_args([]).out == results.LOCAL_RESULTS


def _bench_slug() -> str:
    """The name bench.report gives its files on this machine (after its benchmark device)."""
    machine = report_machine_info()
    return device_slug(machine["bench_device"], machine["bench_device_type"])


# (module, its arguments, a file it would write, the work it does after the checks)
WRITERS = [
    (report, ["-k", "no_such_benchmark"], "{bench}-partial-no-such-benchmark-norm.png", "run_benchmarks"),
    (int8_inference, [], f"{CPU_SLUG}-int8.png", "int8_inference_section"),
    (int8_profile, [], f"{CPU_SLUG}-int8-profile.md", "int8_profile_section"),
    (compile_report, ["--arch", "sm80", "-k", "layer-norm N768 bf16"], "compile-sm80.md", "collect"),
]


@pytest.mark.parametrize("module, argv, name, work", WRITERS, ids=[m.__name__ for m, *_ in WRITERS])
def test_a_run_never_replaces_results_without_overwrite(module, argv, name, work, tmp_path, monkeypatch, capsys):
    name = name.format(bench=_bench_slug())
    monkeypatch.setattr(results, "LOCAL_RESULTS", tmp_path)  # the default --out
    monkeypatch.setattr(module, work, _ran)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compile report refuses to run interpreted
    existing = tmp_path / name
    existing.write_text("a reference result")

    assert _exit_code(module.main, argv) == 2
    err = capsys.readouterr().err
    assert name in err and "--overwrite" in err
    assert existing.read_text() == "a reference result"
    with pytest.raises(_Ran):
        module.main([*argv, "--overwrite"])


def test_a_run_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(int8_inference, "int8_inference_section", lambda device, plot, log: ["## INT8 inference"])
    assert int8_inference.main(["--out", str(tmp_path / "new")]) == 0
    written = tmp_path / "new" / f"{CPU_SLUG}-int8.md"
    assert written.read_text().endswith("## INT8 inference\n")
    assert f"wrote {written}" in capsys.readouterr().out


def test_compile_report_lists_its_cases(capsys):
    assert compile_report.main(["--list"]) == 0
    listed = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "norm layer-norm N768 bf16 (4096 rows)" in listed and "attention attn d128 bf16 s512 fused-qkv" in listed
    assert compile_report.main(["--list", "-k", "D128 causal attn"]) == 0
    chosen = capsys.readouterr().out.splitlines()
    assert chosen and len(chosen) < len(listed)
    assert all("attn" in line and "d128" in line and "causal" in line for line in chosen)
    assert _exit_code(compile_report.main, ["--list", "-k", "layer_norm fwd"]) == 2
    assert "--list alone shows every case's name" in capsys.readouterr().err


def test_train_bert_mlm_threads(monkeypatch, capsys):
    threads = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(train_bert_mlm, "train", lambda **kwargs: seen.append(torch.get_num_threads()) or _ran())
    try:
        with pytest.raises(_Ran):
            train_bert_mlm.main(["--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert seen == [1]
    assert _exit_code(train_bert_mlm.main, ["--threads", "0"]) == 2
    assert "argument --threads: expected an integer >= 1, got '0'" in capsys.readouterr().err


# (module, arguments, what the one-line error says): a bad value of each checked argument of each
# command is a usage error before any work, naming the argument, what it expects and what it got.
BAD_VALUES = [
    ("slimformer.plan.cli", ["--budget", "1GiB", "--model", "bert-huge"], "--model must be one of"),
    ("slimformer.plan.cli", ["--budget", "lots"], "argument --budget: budget must look like"),
    ("slimformer.plan.cli", ["--budget", "1GiB", "--seq", "0"], "argument --seq: expected an integer >= 1, got '0'"),
    ("slimformer.plan.cli", ["--budget", "1GiB", "--batch", "-2"], "argument --batch: expected an integer >= 1"),
    ("slimformer.plan.cli", ["--budget", "1GiB", "--layers", "x"], "argument --layers: expected an integer >= 1"),
    ("slimformer.plan.cli", ["--budget", "1GiB", "--device", "tpu"], "argument --device: device must be"),
    ("slimformer.plan.cli", ["--budget", "1GiB", "--plot", "{file}/p.png"], "argument --plot: expected a writable"),
    ("slimformer.memory.cli", ["--model", "bert-huge"], "--model must be one of"),
    ("slimformer.memory.cli", ["--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
    ("slimformer.memory.cli", ["--seq", "-1"], "argument --seq: expected an integer >= 1"),
    ("slimformer.memory.cli", ["--plot", "a.png", "--max-seq", "64"], "argument --max-seq: expected an integer >= 128"),
    ("slimformer.memory.cli", ["--plot", "{file}/p.png"], "argument --plot: expected a writable file path"),
    ("bench.report", ["--out", "{file}/out"], "argument --out: expected a writable folder"),
    ("bench.int8_inference", ["--out", "{file}"], "argument --out: expected a writable folder"),
    ("bench.compile_memory", ["--layers", "0"], "argument --layers: expected an integer >= 1, got '0'"),
    ("bench.cpu_step", ["--rounds", "0"], "argument --rounds: expected an integer >= 1"),
    ("bench.deberta", ["--rounds", "-3"], "argument --rounds: expected an integer >= 1"),
    ("bench.disentangled_tiles", ["--out", "{file}", "--budget", "1"], "argument --out: expected a writable folder"),
    ("bench.disentangled_tiles", ["--out", "unused", "--budget", "0"], "argument --budget: expected a number > 0"),
    ("bench.families", ["--rounds", "0"], "argument --rounds: expected an integer >= 1"),
    ("bench.host_overhead", ["--calls", "0"], "argument --calls: expected an integer >= 1"),
    ("bench.host_overhead", ["--emulate", "sm70"], "argument --emulate: invalid choice: 'sm70'"),
    ("bench.host_overhead", ["--emulate", "sm90", "--large"], "--emulate times the host side"),
    ("bench.mlm_memory", ["--masked", "1.5"], "argument --masked: expected a number > 0 and <= 1, got '1.5'"),
    ("bench.plan", ["--budgets", "0"], "argument --budgets: expected an integer >= 1"),
    ("bench.quantized_load", ["--hidden", "0"], "argument --hidden: expected an integer >= 1"),
    ("bench.unpad", ["--layers", "0"], "argument --layers: expected an integer >= 1"),
    ("bench.gpu_check.cli", ["--budget", "-1"], "argument --budget: expected a number > 0, got '-1'"),
    ("bench.gpu_check.cli", ["--precompile-workers", "-1"], "argument --precompile-workers: expected an integer >= 0"),
    ("tools.compile_report.report", ["--jobs", "0"], "argument -j/--jobs: expected an integer >= 1, got '0'"),
    ("examples.train_bert_mlm", ["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    ("examples.train_bert_mlm", ["--dropout", "1"], "argument --dropout: expected a number >= 0 and < 1, got '1'"),
    ("examples.train_bert_mlm", ["--hidden", "100", "--heads", "3"], "--hidden: expected a multiple of --heads (3)"),
    ("examples.trainer_mlm", ["--lr", "0"], "argument --lr: expected a number > 0, got '0'"),
    ("examples.trainer_mlm", ["--losses", "{file}/l.json"], "argument --losses: expected a writable file path"),
    ("examples.finetune_classifier", ["--epochs", "-1"], "argument --epochs: expected an integer >= 1, got '-1'"),
    ("examples.finetune_classifier", ["{file}/none"], "argument model_dir: expected an existing folder"),
    ("examples.layer_memory", ["--seq", "0"], "argument --seq: expected an integer >= 1"),
    ("examples.quantize_bert", ["--smooth-alpha", "2"], "argument --smooth-alpha: expected a number >= 0 and <= 1"),
    ("examples.sentence_embeddings", ["--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
    ("examples.sentence_embeddings", ["--batch-size", "1"], "argument --batch-size: expected an integer >= 2"),
]


@pytest.mark.parametrize("module, argv, message", BAD_VALUES, ids=[f"{m} {' '.join(a)}" for m, a, _ in BAD_VALUES])
def test_a_bad_value_is_a_one_line_usage_error(module, argv, message, tmp_path, capsys):
    a_file = tmp_path / "a-file"  # a path under a file can be written by no one, root included
    a_file.write_text("")
    argv = [arg.replace("{file}", str(a_file)) for arg in argv]
    assert _exit_code(importlib.import_module(module).main, argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_bench_report_checks_its_folder_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "run_benchmarks", _ran)
    (tmp_path / "a-file").write_text("")
    assert _exit_code(report.main, ["--out", str(tmp_path / "a-file" / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_bench_report_is_quick_unless_full(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(report, "run_benchmarks", lambda path, args: ran.append(args) or _ran())
    for argv in ([], ["--full"], ["-k", "rms_norm"]):
        with pytest.raises(_Ran):
            report.main([*argv, "--out", str(tmp_path)])
    assert ran == [["-k", report.QUICK_BENCHMARKS["cpu"]], [], ["-k", "rms_norm"]]
    quick = report.selection([], quick=True)
    assert quick.quick and not quick.partial and quick.stem("cpu-x") == "cpu-x-quick"
    assert quick.selects("norm_memory") and quick.selects("bert_memory eager") and not quick.selects("mlm_memory")
    assert not report.selection(["-k", "rms_norm"], quick=True).quick and not report.selection([]).quick


def test_the_quick_run_times_one_op_of_each_family():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "bench", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-k", report.QUICK_BENCHMARKS["cpu"]],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
    ).stdout.splitlines()  # fmt: skip
    chosen = [line for line in listed if "::" in line]
    by_family = {}
    for node in chosen:
        family = node.split("::")[0].removeprefix("bench/test_").removesuffix("_bench.py")
        by_family.setdefault(family, set()).add(node.split("[")[1].rsplit("-", 1)[0].removesuffix("-sdpa"))
    assert set(by_family) == set(report.FAMILIES), listed
    assert all(len(configurations) == 1 for configurations in by_family.values()), by_family


def test_plan_knows_the_optimizers_of_the_planner():
    from slimformer.plan import OPTIMIZERS, cli

    assert cli.OPTIMIZERS == OPTIMIZERS


# Every command, as a shell runs it (``python -m NAME`` or ``python examples/NAME.py``): --help and a
# usage error are answered before torch and the other heavy libraries are imported (in well under a
# second): the parser is built from the standard library and light modules only, and parsed before the
# heavy imports (a module's ``if __name__ == "__main__":`` above them, or a package's lazy imports).
COMMANDS = [
    *[f"bench.{name}" for name in ("compile_memory", "cpu_step", "deberta", "disentangled_tiles", "families")],
    *[f"bench.{name}" for name in ("host_overhead", "int8_inference", "int8_profile", "mlm_memory", "plan")],
    *[f"bench.{name}" for name in ("quantized_load", "report", "unpad", "gpu_check")],
    *[f"examples/{name}.py" for name in ("finetune_classifier", "layer_memory", "quantize_bert")],
    *[f"examples/{name}.py" for name in ("sentence_embeddings", "train_bert_mlm", "trainer_mlm")],
    "tools.compile_report", "tools.compile_report.tutorial", "slimformer.plan", "slimformer.memory",
]  # fmt: skip
HEAVY = ("torch", "transformers", "triton", "numpy", "matplotlib")
_LIGHT_CHECK = f"""
import runpy, sys
command, *argv = sys.argv[1:]
sys.argv = [command, *argv]
try:
    if command.endswith(".py"):
        runpy.run_path(command, run_name="__main__")
    else:
        runpy.run_module(command, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    print("exit code", exit.code, file=sys.stderr)
print("imported", [name for name in {HEAVY!r} if name in sys.modules], file=sys.stderr)
"""


def _shell_command(path: Path) -> str:
    """How a shell runs the command line in ``path``: ``python -m bench.plan``, ``examples/layer_memory.py``,
    ``python -m tools.compile_report`` (a package's ``__main__.py``)."""
    relative = path.relative_to(ROOT)
    if relative.parts[0] == "examples":
        return relative.as_posix()
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def test_every_command_is_checked_for_a_light_help():
    found = {
        _shell_command(path)
        for folder in ("bench", "examples", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name == "__main__.py" or MAIN_GUARD in path.read_text()
    }
    assert found <= set(COMMANDS), sorted(found - set(COMMANDS))
    parsers = {  # the files that build a parser belong to a listed command (its module or its package)
        path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for folder in ("bench", "examples", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "argparse.ArgumentParser(" in path.read_text()
    }
    dotted = [command.removesuffix(".py").replace("/", ".") for command in COMMANDS]
    assert all(any(f"{m}.".startswith(f"{c}.") for c in dotted) for m in parsers), sorted(parsers)


def _run_light(command: str, argv: list[str]) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-c", _LIGHT_CHECK, command, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    *err, code, imported = result.stderr.splitlines()
    return int(code.removeprefix("exit code ")), "\n".join(err), imported


@pytest.mark.parametrize("command", COMMANDS)
def test_help_and_a_usage_error_import_nothing_heavy(command):
    code, err, imported = _run_light(command, ["--help"])
    assert code == 0 and imported == "imported []", (err, imported)
    required = {"tools.compile_report.tutorial": ["06-fused-attention.py"], "slimformer.plan": ["--budget", "1GiB"]}
    required["bench.disentangled_tiles"] = ["--out", "unused"]
    code, err, imported = _run_light(command, [*required.get(command, []), "--no-such-option"])
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and imported == "imported []", (err, imported)
    assert len(errors) == 1 and "unrecognized arguments: --no-such-option" in errors[0], err


def test_families_names_are_its_families():
    from bench import families

    assert families.FAMILY_NAMES == tuple(families.FAMILIES)


def test_import_slimformer_is_light_and_exposes_every_public_name():
    check = (
        "import sys, slimformer as sf; assert 'torch' not in sys.modules; "
        "missing = [n for n in sf.__all__ if getattr(sf, n, None) is None]; assert not missing, missing; "
        "assert callable(sf.plan) and callable(sf.patch) and callable(sf.quantize) and callable(sf.recompute); "
        "from slimformer import LayerNorm, SlimformerInt8Config, memory; from slimformer.plan import profile; "
        "assert callable(profile) and set(sf.__all__) <= set(dir(sf)); print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_a_package_function_named_like_its_module_stays_the_function_once_the_module_is_imported():
    # importing slimformer.memory.report (the module) binds the package attribute to it unless
    # the package keeps it: sf.memory.report must stay the report function
    check = (
        "import sys, slimformer as sf, slimformer.memory.report, slimformer.plan.profile, slimformer.patch, "
        "slimformer.plan.planner, slimformer.quantize, slimformer.recompute\n"
        "plan_package = sys.modules['slimformer.plan']\n"
        "names = [sf.memory.report, plan_package.profile, sf.plan, sf.patch, sf.quantize, sf.recompute]\n"
        "from slimformer.memory import report\n"
        "assert all(callable(f) and not isinstance(f, type(sf)) for f in [*names, report]), names\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stderr
