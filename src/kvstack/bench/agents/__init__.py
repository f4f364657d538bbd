"""`bench agents`: the coding-agent CLIs (Claude Code, Codex, Qwen Code) run headless against
`kvstack serve`, each request recorded by a loopback proxy."""

from kvstack.bench.agents.case import run

__all__ = ["run"]
