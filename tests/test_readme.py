"""The README's Python blocks run as written, each on its own (a fresh namespace), and
the README and docs point at nothing outside the repository.

On a CPU the blocks run the PyTorch path, as they do for a user without a GPU
(TRITON_INTERPRET is a test-suite setting, not something a reader sets).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block in ``path``."""
    text = path.read_text()
    return [
        (text.count("\n", 0, match.start()) + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) == "python"
    ]


def test_readme_has_blocks_to_run():
    # the quick starts: patch a model and see its memory, quantize a BERT and compare
    assert len(python_blocks(README)) >= 2
    assert sum(len(python_blocks(doc)) for doc in DOCS) >= 10


@pytest.mark.parametrize(
    "path, line, code",
    [
        pytest.param(path, line, code, id=f"{path.name}:{line}")
        for path in (README, *DOCS)
        for line, code in python_blocks(path)
    ],
)
def test_block_runs_as_written(path, line, code, monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace = {"__name__": f"block_{path.stem}_{line}"}
    exec(compile(code, f"{path.name}:{line}", "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_pointer_outside_the_repository(path):
    text = path.read_text()
    for outside in ("DESIGN.md", "../shared", "/work/", "STYLE.md"):  # links: tests/test_docs_links.py
        assert outside not in text, f"{path.name} points at {outside}"


def test_code_points_at_nothing_outside_the_repository():
    for source in [*ROOT.glob("slimformer/**/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("bench/*.py")]:
        text = source.read_text()
        assert "DESIGN.md" not in text and "../shared" not in text, source


def test_docs_exist():
    names = {doc.name for doc in DOCS}
    assert {"architecture.md", "memory-model.md", "api.md"} <= names
