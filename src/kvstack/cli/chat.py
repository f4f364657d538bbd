"""`kvstack chat`: a multi-turn conversation on stdin, reusing earlier turns' KV blocks.

Every turn sends the whole conversation through the chat template. Its head is the previous
turn's prompt, so with prefix caching the full blocks of it are found cached and only the
tail (the last reply and the new message) is prefilled; the stderr line after each reply
shows how many prompt tokens came from the cache.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvstack.cli.args import (
    add_model_args,
    add_sampling_args,
    load_llm,
    sampling_params,
    stream_text,
)
from kvstack.units import format_ms

if TYPE_CHECKING:
    from kvstack.engine.chat import Message

_EXIT_COMMANDS = ("/exit", "/quit")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat",
        help="chat with the model (interactive, or one message per line of piped stdin)",
        description="Chat on stdin: one user message per line; EOF or /exit ends. Replies go "
        "to stdout, per-turn token counts and timings to stderr.",
    )
    parser.add_argument("--system", metavar="TEXT", help="a system message opening the chat")
    add_sampling_args(parser, max_tokens=256)
    add_model_args(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args)
    messages: list[Message] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    turn = 0
    while (line := _read_message(interactive)) is not None:
        if not line:
            continue
        if line in _EXIT_COMMANDS:
            break
        turn += 1
        messages.append({"role": "user", "content": line})
        prompt_ids = llm.apply_chat_template(messages)
        out = stream_text(llm, {"prompt_token_ids": prompt_ids}, params)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        num_prompt, num_cached = len(prompt_ids), out.num_cached_tokens
        print(
            f"[turn {turn}: {num_prompt} prompt tokens, {num_cached} cached, "
            f"{num_prompt - num_cached} new, {len(out.outputs[0].token_ids)} generated, "
            f"TTFT {format_ms(out.metrics.ttft)}]",
            file=sys.stderr,
        )
    return 0


def _read_message(interactive: bool) -> str | None:
    """The next user message (stripped), or None at end of input."""
    try:
        line = input("> " if interactive else "")
    except EOFError:
        return None
    return line.strip()
