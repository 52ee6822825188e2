"""Every command line of bench/, examples/, tools/ and ``python -m slimformer.memory``: ``--help``
describes it and runs nothing, an unknown argument is a usage error, and a run that
writes results writes them into the git-ignored local folder by default and never
replaces a file that exists without ``--overwrite``. Each command's ``main(argv)`` runs
in this process; the commands behind the arguments are replaced where a test reaches
past the argument checks."""

import importlib
from pathlib import Path

import pytest
import torch

from bench import int8_inference, int8_profile, report
from bench.harness import device_name
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
CPU_SLUG = report.device_slug(device_name(torch.device("cpu")), "cpu")  # the INT8 benchmarks' files


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
    machine = report.report_machine_info()
    return report.device_slug(machine["bench_device"], machine["bench_device_type"])


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
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err
