"""Every Python and shell example in README.md and docs/ runs, with mktestdocs: a page's Python
blocks in order as one program (in an interpreter of its own), each shell block in `bash -e -u`
(a failing command fails the test). Each runs in a fresh folder with the virtualenv's `kvstack`
first on the PATH.

An example that talks to a server on port 8000 without starting one gets the module's server
(`kvstack serve --model smollm2-135m --port 8000`, started once, after the examples that start
their own server on that port have run). Examples marked not executed are listed, with their
reason, in not_executed.py, and are held to a tenth of all examples."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mktestdocs
import pytest
from not_executed import NOT_EXECUTED

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SERVER = "127.0.0.1:8000"
MARKS = {"python": "{.python .notest}", "bash": "{.bash .notest}"}
pytestmark = pytest.mark.slow


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path, lang: str) -> list[str]:
    return mktestdocs.grab_code_blocks(page.read_text(), lang=lang)


def starts_a_server(code: str) -> bool:
    return "kvstack serve" in code and "&" in code


def needs_the_server(code: str) -> bool:
    return SERVER in code and not starts_a_server(code)


def cases(with_server: bool) -> Iterator[object]:
    """A page's Python blocks as one case (they run in order, in one namespace), each shell
    block as one."""
    for page in PAGES:
        python = "\n".join(blocks(page, "python"))
        if python and needs_the_server(python) == with_server:
            yield pytest.param(page, "python", None, id=f"{page_name(page)}:python")
        for n, code in enumerate(blocks(page, "bash")):
            if needs_the_server(code) == with_server:
                yield pytest.param(page, "bash", code, id=f"{page_name(page)}:bash{n}")


def run_bash(code: str) -> None:
    """As mktestdocs runs a shell block (`bash -e -u -c`), in a session of its own that is
    killed afterwards, so a server an example left behind (it failed before its `kill`) never
    holds the port."""
    done = subprocess.Popen(["bash", "-e", "-u", "-c", code], start_new_session=True)
    try:
        assert done.wait(timeout=500) == 0, code
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(done.pid, signal.SIGKILL)


@pytest.fixture()
def in_fresh_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://{SERVER}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    assert not healthy(), f"something already serves on {SERVER}"
    folder = tmp_path_factory.mktemp("server")
    kvstack = Path(sys.executable).parent / "kvstack"
    proc = subprocess.Popen([str(kvstack), "serve", "--model", "smollm2-135m", "--port", "8000"],
                            cwd=folder, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not healthy():
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def run_python(code: str) -> None:
    """A page's Python blocks, joined by mktestdocs, run in a fresh interpreter: a loaded
    model is freed when its page is done, whatever the example left behind."""
    done = subprocess.run([sys.executable, "-c", code], timeout=500)
    assert done.returncode == 0, code


mktestdocs.register_executor("python", run_python)


def run(page: Path, lang: str, code: str | None) -> None:
    if code is None:
        mktestdocs.check_md_file(fpath=page, memory=True, lang=lang)
    else:
        run_bash(code)


@pytest.mark.parametrize(("page", "lang", "code"), list(cases(with_server=False)))
@pytest.mark.usefixtures("in_fresh_folder")
def test_example_runs(page: Path, lang: str, code: str | None) -> None:
    run(page, lang, code)


@pytest.mark.parametrize(("page", "lang", "code"), list(cases(with_server=True)))
@pytest.mark.usefixtures("in_fresh_folder", "server")
def test_example_runs_against_the_server(page: Path, lang: str, code: str | None) -> None:
    run(page, lang, code)


def test_examples_not_run_are_listed_few_and_said_so_on_their_page() -> None:
    marked: list[tuple[str, str]] = []
    total = 0
    for page in PAGES:
        total += sum(len(blocks(page, lang)) for lang in ("python", "bash"))
        for mark in MARKS.values():
            for code in blocks(page, mark):
                keys = [key for key in NOT_EXECUTED
                        if key[0] == page_name(page) and key[1] in code]
                assert len(keys) == 1, f"{page_name(page)}: a block marked {mark} is not " \
                    f"listed in not_executed.py once:\n{code}"
                marked.append(keys[0])
        said = page.read_text().count("Not executed by the tests")
        mine = sum(1 for key in marked if key[0] == page_name(page))
        assert said >= mine, f"{page_name(page)} does not say which examples are not run"
    assert sorted(marked) == sorted(NOT_EXECUTED), "entries whose block is gone"
    assert total >= 30 and len(marked) <= (total + len(marked)) // 10
