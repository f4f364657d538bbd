"""`kvstack generate`: complete one prompt, streaming the text, then a summary on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvstack.cli.args import (
    add_model_args,
    add_sampling_args,
    load_llm,
    read_prompt,
    sampling_params,
    stream_text,
)
from kvstack.units import format_ms

if TYPE_CHECKING:
    from kvstack.engine.llm import PromptType


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate",
        help="complete one prompt and stream the text",
        description="Complete one prompt, streaming the text to stdout; a summary of tokens "
        "and timings goes to stderr.",
    )
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the prompt, or - to read it from stdin")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    add_sampling_args(parser, max_tokens=128)
    add_model_args(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # Bad flags fail here, before seconds are spent loading the model.
    params = sampling_params(args)
    text = read_prompt(args.prompt)
    llm = load_llm(args)
    prompt: PromptType = text
    if args.chat:
        prompt = {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": text}])}
    out = stream_text(llm, prompt, params)
    completion = out.outputs[0]
    num_prompt = len(out.prompt_token_ids)
    rate = out.metrics.decode_rate(len(completion.token_ids))
    print(
        f"[{num_prompt} prompt tokens, {out.num_cached_tokens} cached, "
        f"{len(completion.token_ids)} new tokens, TTFT {format_ms(out.metrics.ttft)}, "
        f"decode {'n/a' if rate is None else f'{rate:.1f} tok/s'}, "
        f"finish {completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0
