"""Every relative markdown link in the README and docs/ points at a file (or folder) that
git tracks: a link to a git-ignored output (``bench/results/local/``, a stored JSON) works
on the machine that wrote it and nowhere else."""

import re
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


@cache
def tracked() -> frozenset[str]:
    """Tracked files and the folders that hold them, relative to the repository root."""
    result = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    files = result.stdout.splitlines()
    return frozenset(files) | {str(parent) for name in files for parent in PurePosixPath(name).parents}


def relative_links(page: Path) -> list[str]:
    targets = (match.group(1).split("#")[0] for match in LINK.finditer(page.read_text()))
    return [t for t in targets if t and not t.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_tracked_files(page):
    missing = []
    for target in relative_links(page):
        resolved = (page.parent / target).resolve()
        inside = resolved.is_relative_to(ROOT)
        if not inside or str(resolved.relative_to(ROOT)) not in tracked():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files git does not track: {missing}"


def test_the_check_sees_links():
    assert len(relative_links(ROOT / "README.md")) >= 10
