"""The package as a user installs it: sdist -> wheel with ``python -m build``, installed
into a throwaway venv that sees the torch already installed, imported from there.

Nothing is downloaded: the build runs without isolation (setuptools is a test
dependency's dependency) and pip installs with ``--no-index``, so the install succeeds
only if every requirement is met by what is already there -- a requirement that would
pull another torch (a CUDA wheel on a CPU machine) fails the test instead.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import slimformer

ROOT = Path(__file__).resolve().parents[1]
# What a clean checkout hands the build backend (the sdist is built from these).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "slimformer")

SMOKE = """
import importlib.metadata, pathlib, sys, torch
import slimformer as sf
assert pathlib.Path(sf.__file__).is_relative_to(sys.prefix), sf.__file__
assert not pathlib.Path(torch.__file__).is_relative_to(sys.prefix), "torch was installed again"
assert sf.__version__ == importlib.metadata.version("slimformer"), sf.__version__
x = torch.randn(3, 8)
y = sf.layer_norm(x, (8,))
assert torch.allclose(y, torch.nn.functional.layer_norm(x, (8,)), atol=1e-5)
print(sf.__version__, importlib.metadata.metadata("slimformer")["License-Expression"])
"""


def _run(args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _clean_env():
    # PYTHONPATH would let the smoke check import the source tree instead of the wheel.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_FIND_LINKS")}
    return env | {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.mark.timeout(180)
def test_wheel_installs_beside_existing_torch_and_imports(tmp_path):
    pytest.importorskip("build", reason="pip install -e '.[test]' brings build")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    env = _clean_env()
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", source], tmp_path, env)

    wheels = list((tmp_path / "dist").glob("slimformer-*.whl"))
    assert [w.name for w in wheels] == [f"slimformer-{slimformer.__version__}-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"slimformer-{slimformer.__version__}.dist-info/METADATA").decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "examples/")) for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    requirements = re.findall(r"^Requires-Dist: (\S+)(?!.*extra ==)", metadata, flags=re.M)
    assert "torch>=2.4" in requirements

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    # The throwaway venv sees this environment's packages (torch among them) through a
    # .pth file, the way a venv made with --system-site-packages sees the system's.
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    Path(purelib.strip(), "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", wheels[0]], tmp_path, env)

    out = _run([python, "-c", SMOKE], tmp_path, env | {"TRITON_INTERPRET": "0"})
    assert out.split() == [slimformer.__version__, "Apache-2.0"]


def test_version_is_the_package_metadata():
    import importlib.metadata

    try:
        installed = importlib.metadata.version("slimformer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("slimformer is not installed (only on PYTHONPATH)")
    assert slimformer.__version__ == installed
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", slimformer.__version__)


def test_license_file_matches_pyproject():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License\n                           Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    assert f"## {slimformer.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_make_install_step_says_what_it_does(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    out = _run(["make", "-n", "-B", f"VENV={tmp_path / 'venv'}", str(tmp_path / "venv" / ".installed")], ROOT)
    lines = out.splitlines()
    installs = [i for i, line in enumerate(lines) if " -m pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 3
    for i in installs:  # each download is announced on the line before it
        assert lines[i - 1].startswith('echo "[') or lines[i - 2].startswith('echo "['), lines[i]
