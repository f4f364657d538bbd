"""`bench agent`: an agent loop's turns through the Responses API vs chat completions.

A seeded trace (`agent_trace.py`): a ~1,500-token system prompt with tool schemas, 12 turns
that each append a ~150-token tool result and ask for 16 tokens, 4 conversations at once.
Three arms, each on a fresh `kvstack serve` app in this process (uvicorn in a thread):

- `responses`: `/v1/responses` with `previous_response_id` (the server holds the
  conversation, so each turn is its stored tokens plus the new ones: an exact prefix hit);
- `chat_cached`: `/v1/chat/completions` resending the whole history, prefix cache on (the hit
  ends where re-tokenizing the model's own text differs from what it generated);
- `chat_uncached`: the same with the prefix cache off (every turn computes everything).

Reported per turn: TTFT (median over the conversations; plotted against the turn), prompt
tokens computed (input minus cached, mean); per arm the total time. Then `idle`: 8
conversations through Responses on an engine with a disk tier, 2 turns each (turn 2 is an
in-memory hit), left idle past their pin TTL while other prompts evict every block, then
resumed: turn 3 restores their KV from the disk tier. Its TTFT is compared with turn 2's.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvstack.bench.agent_trace import (
    Conversation,
    Trace,
    Turn,
    chat_turn,
    make_trace,
    pressure,
    responses_turn,
)
from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.bench.format import fmt_x, median, ratio
from kvstack.bench.plots import log_scale_y, new_figure, save_figure
from kvstack.engine.llm import LLM
from kvstack.errors import InvalidRequestError
from kvstack.server.app import create_app
from kvstack.server.state import ServerConfig
from kvstack.server.threaded import ServerThread
from kvstack.units import format_ms

ARMS = {"responses": "Responses, previous_response_id",
        "chat_cached": "chat, whole history, prefix cache",
        "chat_uncached": "chat, whole history, no prefix cache"}
SEED = 35
IDLE_PIN_TTL_S = 1.0  # the idle conversations' pins lapse this long after their last turn

TurnFn = Callable[[httpx.AsyncClient, str, Trace, Conversation, int], Awaitable[Turn]]


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"system_tokens": 160, "turns": 3, "result_tokens": 32, "conversations": 2,
                "output_tokens": 4, "idle_conversations": 2}
    return {"system_tokens": 1500, "turns": 12, "result_tokens": 150, "conversations": 4,
            "output_tokens": 16, "idle_conversations": 8}


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    if subject.tokenizer is None or getattr(subject.tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(f"bench agent needs a model with a chat template; "
                                  f"{options.model} has none")
    size = sizes(options.quick)
    trace = make_trace(subject, size["system_tokens"], max(size["conversations"],
                       size["idle_conversations"]), size["turns"], size["result_tokens"], SEED)
    longest = len(subject.encode(trace.system)) + 64 + size["turns"] * (
        size["result_tokens"] + size["output_tokens"] + 24)
    subject.require_context(longest, "the agent benchmark")
    arms: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        arms[arm] = _run_arm(subject, options, trace, size, arm, longest)
        _progress(options, f"agent {arm}: {arms[arm]['total_s']:.1f} s; TTFT per turn (ms) "
                  f"{[round(t * 1000) for t in arms[arm]['ttft_s']]}; computed per turn "
                  f"{arms[arm]['computed_tokens']}")
    idle = _run_idle(subject, options, trace, size)
    targets = _targets(arms, idle)
    plot = _plot(options, arms)
    return CaseResult(
        case="agent", summary=_summary(arms, idle, targets),
        config={"model": options.model, "quick": options.quick, **size, "seed": SEED,
                "system_prompt_tokens": len(subject.encode(trace.system)),
                "arms": ARMS, "idle_pin_ttl_s": IDLE_PIN_TTL_S, "greedy": True,
                "weights": subject.weight_format},
        results={"arms": arms, "idle": idle, "targets": targets},
        plots=[plot],
        table=[TableRow(f"agent turn {size['turns']} TTFT, Responses vs chat without "
                        "prefix cache", format_ms(arms["responses"]["ttft_s"][-1]),
                        format_ms(arms["chat_uncached"]["ttft_s"][-1]),
                        fmt_x(targets["turn_last_vs_uncached"]))],
    )


def _serve(subject: Subject, longest: int, num_conversations: int, config: ServerConfig,
           **llm_kwargs: Any) -> tuple[LLM, Any]:
    kv_bytes = subject.kv_shape().bytes_for(longest + 32, num_conversations + 1)
    llm = subject.llm(kv_cache_memory=llm_kwargs.pop("kv_cache_memory", kv_bytes),
                      **llm_kwargs)
    return llm, ServerThread(create_app(llm, config=config))


def _run_arm(subject: Subject, options: BenchOptions, trace: Trace, size: dict[str, int],
             arm: str, longest: int) -> dict[str, Any]:
    llm, thread = _serve(subject, longest, size["conversations"], ServerConfig(),
                         enable_prefix_caching=arm != "chat_uncached")
    turn_fn: TurnFn = responses_turn if arm == "responses" else chat_turn
    talks = [Conversation(i) for i in range(size["conversations"])]
    with thread as url:
        start = time.perf_counter()
        asyncio.run(_drive(url, options.model, trace, talks, turn_fn, size))
        total = time.perf_counter() - start
    llm.close()
    per_turn = list(zip(*(t.turns for t in talks), strict=True))
    return {
        "label": ARMS[arm], "total_s": total,
        "ttft_s": [median([t.ttft_s for t in turns]) for turns in per_turn],
        "computed_tokens": [sum(t.computed_tokens for t in turns) / len(turns)
                            for turns in per_turn],
        "input_tokens": [sum(t.input_tokens for t in turns) / len(turns) for turns in per_turn],
        "turns": [[vars(t) for t in talk.turns] for talk in talks],
    }


async def _drive(url: str, model: str, trace: Trace, talks: list[Conversation],
                 turn_fn: TurnFn, size: dict[str, int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        # One short request first: the engine's first step pays one-time costs.
        await client.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                   "max_tokens": 1})

        async def one(talk: Conversation) -> None:
            for _ in range(size["turns"]):
                await turn_fn(client, model, trace, talk, size["output_tokens"])

        await asyncio.gather(*(one(t) for t in talks))


def _run_idle(subject: Subject, options: BenchOptions, trace: Trace,
              size: dict[str, int]) -> dict[str, Any]:
    """Turn 2 of each idle conversation (an in-memory hit) vs turn 3 after eviction (from
    disk), one conversation at a time so that neither waits on another."""
    num = size["idle_conversations"]
    one_talk = len(subject.encode(trace.system)) + 3 * (size["result_tokens"] + 40) + 64
    pool_tokens = 2 * one_talk
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-agent-") as disk:
        llm, thread = _serve(subject, one_talk, 1,
                             ServerConfig(responses_pin_ttl_s=IDLE_PIN_TTL_S),
                             kv_cache_memory=subject.kv_shape().bytes_for(pool_tokens, 1),
                             kv_disk_dir=disk)
        with thread as url:
            talks = [Conversation(i) for i in range(num)]
            asyncio.run(_idle_turns(url, subject, options.model, trace, talks, size,
                                    pool_tokens))
            disk_stats = llm.tier_stats().get("disk")
        llm.close()
    hits = [t.turns[1] for t in talks]
    resumed = [t.turns[2] for t in talks]
    return {
        "conversations": num, "pool_tokens": pool_tokens,
        "in_memory_ttft_s": median([t.ttft_s for t in hits]),
        "resumed_ttft_s": median([t.ttft_s for t in resumed]),
        "in_memory_computed_tokens": sum(t.computed_tokens for t in hits) / num,
        "resumed_computed_tokens": sum(t.computed_tokens for t in resumed) / num,
        "resumed_cached_tokens": sum(t.cached_tokens for t in resumed) / num,
        "disk": None if disk_stats is None else {
            "hits": disk_stats.hits, "misses": disk_stats.misses, "stores": disk_stats.stores,
            "bytes_loaded": disk_stats.bytes_loaded, "load_seconds": disk_stats.load_seconds},
        "turns": [[vars(t) for t in talk.turns] for talk in talks],
    }


async def _idle_turns(url: str, subject: Subject, model: str, trace: Trace,
                      talks: list[Conversation], size: dict[str, int],
                      pool_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        await client.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                   "max_tokens": 1})
        for talk in talks:
            for _ in range(2):
                await responses_turn(client, model, trace, talk, size["output_tokens"])
        await asyncio.sleep(IDLE_PIN_TTL_S * 1.5)  # idle: every pin lapses
        await pressure(client, model, subject.checkpoint.config.vocab_size, 2 * pool_tokens,
                       min(512, pool_tokens // 2), SEED)
        for talk in talks:
            await responses_turn(client, model, trace, talk, size["output_tokens"])


def _targets(arms: dict[str, dict[str, Any]], idle: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as measured: turn 12 <= 1.3x turn 2 (Responses); >= 5x lower TTFT
    at turn 12 than without the prefix cache; resumed from disk <= 2x an in-memory hit."""
    ours = arms["responses"]["ttft_s"]
    growth = ratio(ours[-1], ours[1]) if len(ours) > 1 else None
    vs_uncached = ratio(arms["chat_uncached"]["ttft_s"][-1], ours[-1])
    vs_cached = ratio(arms["chat_cached"]["ttft_s"][-1], ours[-1])
    resumed = ratio(idle["resumed_ttft_s"], idle["in_memory_ttft_s"])
    return {
        "turn_last_vs_turn_2": growth, "turn_last_vs_turn_2_met": _le(growth, 1.3),
        "turn_last_vs_uncached": vs_uncached,
        "turn_last_vs_uncached_met": vs_uncached is not None and vs_uncached >= 5,
        "turn_last_vs_chat_cached": vs_cached,
        "resumed_vs_in_memory": resumed, "resumed_vs_in_memory_met": _le(resumed, 2.0),
    }


def _le(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def _summary(arms: dict[str, dict[str, Any]], idle: dict[str, Any],
             targets: dict[str, Any]) -> str:
    ours, cached, off = (arms[a]["ttft_s"] for a in ARMS)
    n = len(ours)
    return (f"agent: turn {n} TTFT {format_ms(ours[-1])} Responses (turn 2 "
            f"{format_ms(ours[1] if n > 1 else None)}, x{_x(targets['turn_last_vs_turn_2'])}) "
            f"vs {format_ms(cached[-1])} chat+cache, {format_ms(off[-1])} no cache "
            f"({fmt_x(targets['turn_last_vs_uncached'])} lower); computed at turn {n}: "
            f"{arms['responses']['computed_tokens'][-1]:.0f} vs "
            f"{arms['chat_cached']['computed_tokens'][-1]:.0f} vs "
            f"{arms['chat_uncached']['computed_tokens'][-1]:.0f} tokens; total "
            f"{arms['responses']['total_s']:.1f}/{arms['chat_cached']['total_s']:.1f}/"
            f"{arms['chat_uncached']['total_s']:.1f} s; resumed from disk "
            f"{format_ms(idle['resumed_ttft_s'])} vs in-memory hit "
            f"{format_ms(idle['in_memory_ttft_s'])} (x{_x(targets['resumed_vs_in_memory'])})")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _plot(options: BenchOptions, arms: dict[str, dict[str, Any]]) -> str:
    fig, ax = new_figure("Agent loop: time to first token per turn", "turn",
                         "TTFT (ms, median over conversations)")
    for data in arms.values():
        turns = range(1, len(data["ttft_s"]) + 1)
        ax.plot(turns, [t * 1000 for t in data["ttft_s"]], marker="o", label=data["label"])
    log_scale_y(ax)
    ax.legend()
    return save_figure(fig, options, "agent_ttft.png")


def _progress(options: BenchOptions, line: str) -> None:
    if options.show_progress:
        import sys

        print(line, file=sys.stderr, flush=True)
