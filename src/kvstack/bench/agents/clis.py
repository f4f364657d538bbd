"""The agent CLIs as `bench agents` runs them: where `make agent-clis` installs each (npm,
pinned, in the repo's `agent-clis/` folder), and the documented settings that point it at a
server (base URL, key, model), each run in a throwaway home so runs do not share state.

Output caps (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`, `QWEN_CODE_MAX_OUTPUT_TOKENS`) are set only when
asked: the must-hold runs use the base-URL / key / model settings alone.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.errors import KvstackError

DEFAULT_DIR = Path("agent-clis")  # `make agent-clis` installs here (gitignored)
VERSIONS = {"claude": "2.1.332", "codex": "0.171.0", "qwen": "0.24.4"}
PROMPTS = {"claude": "Say hello", "codex": "say hello", "qwen": "Say hello"}


class MissingAgentCliError(KvstackError):
    """An agent CLI is not installed where `bench agents` looks."""


@dataclass(frozen=True)
class CliRun:
    """One headless run: exit code, wall time, the CLI's last stdout line (its JSON result)
    and the tail of stderr."""

    returncode: int
    wall_s: float
    result: dict[str, Any] | None
    stderr: str


def binary(clis_dir: Path, name: str) -> Path:
    path = clis_dir / "node_modules" / ".bin" / name
    if not path.exists():
        raise MissingAgentCliError(f"{name} is not installed in {clis_dir}; run "
                                   "`make agent-clis` (npm) first")
    return path


def command(clis_dir: Path, name: str, prompt: str, resume: bool = False) -> list[str]:
    """The headless command line; `resume` (codex): continue the last session."""
    exe = str(binary(clis_dir, name))
    if name == "claude":
        return [exe, "-p", prompt, "--output-format", "json"]
    if name == "codex":
        head = [exe, "exec", "--skip-git-repo-check", "--json"]
        return [*head, "resume", "--last", prompt] if resume else [*head, prompt]
    return [exe, "-p", prompt, "--output-format", "json"]


def environment(name: str, url: str, model: str, home: Path,
                output_cap: int | None = None) -> dict[str, str]:
    """The CLI's environment: a fresh HOME and its documented base-URL settings."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), "PATH": _path(), "NO_COLOR": "1", "TERM": "dumb"}
    if name == "claude":
        (home / "claude").mkdir(exist_ok=True)
        env |= {"CLAUDE_CONFIG_DIR": str(home / "claude"), "ANTHROPIC_BASE_URL": url,
                "ANTHROPIC_API_KEY": "sk-local", "ANTHROPIC_MODEL": model}
        if output_cap:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(output_cap)
    elif name == "codex":
        codex_home = home / "codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "kvstack"\n\n[model_providers.kvstack]\n'
            f'name = "kvstack"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
            'env_key = "KVSTACK_API_KEY"\n')
        env |= {"CODEX_HOME": str(codex_home), "KVSTACK_API_KEY": "sk-local"}
    else:
        env |= {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "sk-local",
                "OPENAI_MODEL": model}
        if output_cap:
            env["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(output_cap)
    return env


def run_cli(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> CliRun:
    start = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        return CliRun(124, time.monotonic() - start, None, _text(err.stderr)[-2000:])
    return CliRun(done.returncode, time.monotonic() - start, _last_json(done.stdout),
                  done.stderr[-2000:])


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _path() -> str:
    import os

    return os.environ.get("PATH", "")
