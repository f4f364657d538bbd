"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or
a nav entry to nothing fails), its references are generated from the code, and the README and
the pages keep to what a reader on any checkout can follow."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# Links may leave the repository only for public project pages and a local server.
PUBLIC_HOSTS = ("github.com/ggml-org/llama.cpp", "127.0.0.1", "localhost")
LINK = re.compile(r"\]\((https?://[^)\s]+)\)|<(https?://[^>\s]+)>")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_cli_reference_has_every_command_from_the_parser(site: Path) -> None:
    page = (site / "reference" / "cli" / "index.html").read_text()
    subparsers = next(a for a in build_parser()._actions
                      if isinstance(a, argparse._SubParsersAction))
    names = list(subparsers.choices)
    assert len(names) == len(COMMANDS) and "serve" in names
    for name in names:
        assert f'id="kvstack-{name}"' in page, name
    # Sub-subcommands too (`kvstack bench report`), with their flags as argparse prints them.
    assert 'id="kvstack-bench-report"' in page and "--section NAME" in page


def test_the_http_reference_has_every_route_of_the_schema(site: Path) -> None:
    from kvstack.server.app import openapi_schema

    page = (site / "reference" / "http" / "index.html").read_text()
    paths = openapi_schema()["paths"]
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/metrics"} <= set(paths)
    for path in paths:
        assert f"<code>{path}</code>" in page, path
    # The bodies the handlers parse themselves are in it, field by field.
    assert "requestBody" in paths["/v1/chat/completions"]["post"]
    assert "<code>prompt_lookup</code>" in page and "<code>previous_response_id</code>" in page
    assert (site / "reference" / "openapi.json").is_file()


def test_the_readme_is_short_and_links_only_into_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make docs" in readme and "make run" in readme and "make test" in readme
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if "://" in target:
            continue
        assert (ROOT / target.split("#")[0]).exists(), target


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_links_leave_the_repository_only_for_public_pages(page: Path) -> None:
    text = page.read_text()
    for match in LINK.finditer(text):
        url = match.group(1) or match.group(2)
        assert any(host in url for host in PUBLIC_HOSTS), url
