"""`kvstack demo` (what `make run` runs): answer a question, then time the same prompt with
and without the KV cache and check the KV bytes the request held against the estimate."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstack.cli.args import (
    add_model_args,
    load_llm,
    positive_int,
    stream_text,
)
from kvstack.kv.sizing import KVShape
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_bytes, format_ms

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM

QUESTION = "What is the capital of France? Answer in one sentence."


@dataclass(frozen=True)
class _Run:
    label: str
    output: RequestOutput
    peak_blocks: int  # most KV blocks in use while the request ran


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="answer a question, then time decoding with and without the KV cache",
        description="Answer a question on the model (greedy, streamed), then generate "
        "--max-tokens tokens from the same prompt with the KV cache and without it, and "
        "compare TTFT, decode speed and KV bytes.",
    )
    parser.add_argument("--question", default=QUESTION, metavar="TEXT",
                        help="asked through the chat template, answered greedily")
    parser.add_argument("--max-tokens", type=positive_int, default=100, metavar="N",
                        help="tokens generated in each timed run")
    add_model_args(parser, cache_switches=False)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    llm = load_llm(args)
    print(f"kvstack demo: {args.model}, {args.dtype}, KV blocks of {args.block_size} tokens\n")
    prompt = {"prompt_token_ids": llm.apply_chat_template([{"role": "user",
                                                             "content": args.question}])}
    print(f"Q: {args.question}")
    print("A: ", end="", flush=True)
    stream_text(llm, prompt, SamplingParams(temperature=0.0, max_tokens=64))

    timed = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    num_prompt = len(prompt["prompt_token_ids"])
    print(f"\nTiming {args.max_tokens} new tokens after the same {num_prompt}-token prompt "
          "(greedy, ignore_eos) ...")
    # The answer above left the prompt's blocks in the prefix cache; drop them so that both
    # runs prefill the whole prompt and the comparison is the KV cache alone.
    llm.reset_prefix_cache()
    cached = _timed_run("KV cache", llm, prompt, timed)
    shape = llm.info.kv_shape
    assert shape is not None  # the demo's engine always has a KV cache
    del llm  # one model in memory at a time

    baseline = load_llm(args, use_kv_cache=False)
    # Warm up so that neither run pays torch's first-call costs inside its timings.
    baseline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    uncached = _timed_run("no KV cache", baseline, prompt, timed)

    print()
    _print_table([cached, uncached], shape, args.block_size)
    same = cached.output.outputs[0].token_ids == uncached.output.outputs[0].token_ids
    print(f"\nsame {args.max_tokens} tokens with and without the cache: {'yes' if same else 'NO'}")
    _print_kv_bytes(cached, shape, args.block_size)
    print(f"\ndemo took {time.perf_counter() - started:.1f} s")
    return 0


def _timed_run(label: str, llm: LLM, prompt: dict[str, list[int]],
               params: SamplingParams) -> _Run:
    # Blocks are freed as the request finishes, so the peak is read while it runs.
    peak = 0
    outputs = []
    for out in llm.stream(prompt, params):
        outputs.append(out)
        peak = max(peak, llm.stats().num_blocks_used)
    return _Run(label, outputs[-1], peak)


def _print_table(runs: list[_Run], shape: KVShape, block_size: int) -> None:
    baseline = runs[-1].output.metrics.total_time
    header = ("", "TTFT", "decode", "total", "speed-up", "KV held")
    rows = [header]
    for r in runs:
        m, n = r.output.metrics, len(r.output.outputs[0].token_ids)
        rate, total = m.decode_rate(n), m.total_time
        speedup = baseline / total if baseline and total else None
        rows.append((
            r.label,
            format_ms(m.ttft),
            "n/a" if rate is None else f"{rate:.1f} tok/s",
            "n/a" if total is None else f"{total:.2f} s",
            "n/a" if speedup is None else f"{speedup:.1f}x",
            format_bytes(r.peak_blocks * block_size * shape.bytes_per_token),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                         strict=True)]
        print("  ".join(cells))


def _print_kv_bytes(run: _Run, shape: KVShape, block_size: int) -> None:
    out = run.output
    # The last sampled token is never fed back, so its K/V is never written.
    num_stored = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    num_blocks = -(-num_stored // block_size)
    estimate = shape.bytes_for(num_blocks * block_size)
    held = run.peak_blocks * block_size * shape.bytes_per_token
    verdict = "matching estimate" if held == estimate else "DIFFERS from the estimate"
    print(
        f"KV held by the request: {run.peak_blocks} blocks x {block_size} tokens x "
        f"{format_bytes(shape.bytes_per_token)}/token = {format_bytes(held)}\n"
        f"KVShape estimate:       {num_stored} tokens -> {num_blocks} whole blocks = "
        f"{format_bytes(estimate)} ({verdict})"
    )
