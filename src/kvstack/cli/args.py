"""The `kvstack` command line: flags and helpers shared by the subcommands.

Each subcommand module exposes `add_parser(subparsers)` and `run(args) -> int`; the dispatcher
in `kvstack.cli.main` turns every `KvstackError` into one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from kvstack.argtypes import (
    DEFAULT_MODEL,
    byte_size,
    name_list,
    non_negative_int,
    positive_float,
    positive_int,
    speculative_config,
)
from kvstack.config import KV_CACHE_DTYPES
from kvstack.errors import InvalidRequestError
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM, PromptType

__all__ = ["DEFAULT_MODEL", "add_model_args", "add_sampling_args", "add_tier_args",
           "byte_size", "llm_kwargs", "load_llm", "name_list", "non_negative_int", "positive_float",
           "positive_int", "read_prompt", "sampling_params", "stream_text", "tier_kwargs"]



# -- the model and the KV cache --------------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser, cache_switches: bool = True) -> None:
    """The flags `load_llm` reads; without `cache_switches` both caches stay on."""
    group = parser.add_argument_group("model and KV cache")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="smollm2-135m (embedded), gemma3-270m, a .gguf file or an HF folder")
    group.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="weights and activations dtype")
    group.add_argument("--quantization", default=None, choices=("int8", "gguf"),
                       help="weight-only quantization of the linear layers: int8 (per-channel) "
                       "or gguf (a GGUF file's own quantized blocks, run as they are)")
    group.add_argument("--kernels", default="auto", choices=("auto", "torch"),
                       help="auto: C kernels for decode where the CPU allows; torch: PyTorch "
                       "ops only (the reference path)")
    group.add_argument("--kv-cache-memory", type=byte_size, default="1GiB", metavar="SIZE",
                       help="bytes of K/V storage to preallocate, e.g. 512MiB or 2GiB")
    group.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                       help="tokens per KV block (a power of two)")
    group.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch CPU threads (default: torch's choice)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="element type of the stored K/V: auto (the model's), a float type, "
                       "int8, fp8 (e4m3) or int4 (KIVI-style, newest block exact)")
    group.add_argument("--kv-window", type=positive_int, default=None, metavar="N",
                       help="APPROXIMATE sliding-window mode (StreamingLLM): attend to the sink "
                       "tokens and the N - sinks most recent ones, free older blocks; a "
                       "conversation may run past the model's context in constant memory")
    group.add_argument("--kv-sink-tokens", type=non_negative_int, default=4, metavar="N",
                       help="with --kv-window: first tokens every token keeps attending to")
    group.add_argument("--chunk-cache-memory", type=byte_size, default="512MiB", metavar="SIZE",
                       help="bytes of chunk entries kept in memory for blending (APPROXIMATE "
                       "reuse of documents in any order; requests opt in with blend)")
    group.add_argument("--speculative-config", type=speculative_config, default=None,
                       metavar="JSON",
                       help="draft tokens for every greedy request, verified (outputs "
                       "unchanged): '{\"method\": \"suffix\"}' drafts from suffix trees over "
                       "each request's text and its tenant's earlier outputs; vLLM's "
                       "suffix_decoding_* keys tune them")
    group.add_argument("--state-snapshot-every", type=non_negative_int, default=0, metavar="N",
                       help="hybrid models (linear-attention layers): keep a recurrent-state "
                       "snapshot every N blocks besides prompt, sequence and shared-prefix "
                       "ends (0: as many blocks as one snapshot's bytes of K/V)")
    add_tier_args(parser)
    if not cache_switches:
        parser.set_defaults(no_kv_cache=False, no_prefix_caching=False)
        return
    group.add_argument("--no-kv-cache", action="store_true",
                       help="recompute every token's K/V at every step (the slow baseline)")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse KV blocks across requests")


def add_tier_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the KV tiers below the memory pool (disk directory, Redis server)."""
    group = parser.add_argument_group("KV tiers (shared across restarts and processes)")
    group.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                       help="write KV blocks through to this directory and reuse them from it")
    group.add_argument("--kv-disk-size", type=byte_size, default="10GiB", metavar="SIZE",
                       help="most bytes of block files in --kv-disk-dir (oldest evicted first)")
    group.add_argument("--kv-redis-url", default=None, metavar="URL",
                       help="share KV blocks through this Redis server, e.g. redis://host:6379/0")
    group.add_argument("--kv-redis-ttl", type=positive_int, default=86400, metavar="SECONDS",
                       help="how long a block stays in Redis after it was last stored or loaded")


def tier_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of the tier flags."""
    return {
        "kv_disk_dir": args.kv_disk_dir,
        "kv_disk_size": args.kv_disk_size,
        "kv_redis_url": args.kv_redis_url,
        "kv_redis_ttl_s": args.kv_redis_ttl,
    }


def load_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """An `LLM` built from the model flags; `overrides` replace individual keyword arguments."""
    from kvstack.engine.llm import LLM

    return LLM(**llm_kwargs(args, **overrides))


def llm_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The `LLM` keyword arguments of the model flags (what `load_llm` builds, or what every
    cluster replica builds)."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size,
        "use_kv_cache": not args.no_kv_cache,
        "enable_prefix_caching": not args.no_prefix_caching,
        "num_threads": args.threads,
        "quantization": args.quantization,
        "kernels": args.kernels,
        "speculative_config": getattr(args, "speculative_config", None),
    }
    # A baseline built with its caches off (e.g. the demo's) has no tiers (or KV options) either.
    if overrides.get("use_kv_cache") is not False:
        kwargs |= {"kv_cache_dtype": args.kv_cache_dtype, "kv_window": args.kv_window,
                   "kv_sink_tokens": args.kv_sink_tokens,
                   "chunk_cache_memory": getattr(args, "chunk_cache_memory", 512 * 1024**2),
                   "state_snapshot_every": getattr(args, "state_snapshot_every", 0)}
        if overrides.get("enable_prefix_caching") is not False:
            kwargs |= tier_kwargs(args)
    return kwargs | overrides


# -- sampling --------------------------------------------------------------------------------


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """Sampling flags; value ranges are checked by `SamplingParams`, before any model loads."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                       help="most tokens to generate")
    group.add_argument("--temperature", type=float, default=0.0, metavar="T",
                       help="0 decodes greedily")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="sample from the smallest set of tokens with this much probability")
    group.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="sample from the K most likely tokens; 0 or -1 turns it off")
    group.add_argument("--min-p", type=float, default=0.0, metavar="P",
                       help="drop tokens less likely than P x the top token's probability")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                       help="divide the logits of tokens already seen by R (1 = off)")
    group.add_argument("--seed", type=int, default=None, metavar="N",
                       help="seed of a sampled request, for repeatable draws")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when this text appears (repeatable)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


# -- input, streaming and timing -------------------------------------------------------------


def read_prompt(text: str) -> str:
    """`-` reads the prompt from stdin (one trailing newline dropped)."""
    if text == "-":
        text = sys.stdin.read()
        text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise InvalidRequestError("the prompt is empty; give --prompt TEXT or pipe text with -")
    return text


def stream_text(
    llm: LLM,
    prompt: PromptType,
    params: SamplingParams,
    out: TextIO | None = None,
) -> RequestOutput:
    """Print the output's text as it grows (then a newline); return the final output."""
    out = out or sys.stdout
    printed = ""
    final: RequestOutput | None = None
    for final in llm.stream(prompt, params):
        text = final.outputs[0].text
        # The engine only ever extends the text it has shown (a possible stop string is held
        # back until it is ruled out), so the new part is a plain suffix.
        if len(text) > len(printed):
            out.write(text[len(printed):])
            out.flush()
            printed = text
    out.write("\n")
    out.flush()
    if final is None:
        raise AssertionError("the engine finished a request without any output")
    return final
