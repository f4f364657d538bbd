"""`kvstack serve`: the OpenAI- and Anthropic-compatible HTTP server.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish, shuts the
engine down and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvstack.cli.args import add_model_args, byte_size, load_llm, positive_float, positive_int
from kvstack.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvstack.semantic.cache import SemanticCacheConfig

API_KEYS_ENV = "KVSTACK_API_KEYS"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI and Anthropic HTTP APIs",
        description="Serve /v1/completions, /v1/chat/completions (OpenAI), /v1/messages "
        "(Anthropic, with cache_control prompt caching), /v1/models, /health and /metrics.",
    )
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"accept this key; each key is a tenant with its own prefix cache "
                       f"(repeatable; also ${API_KEYS_ENV}, comma-separated; none: open API)")
    group.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="model name clients must send (default: --model)")
    group.add_argument("--max-waiting", type=positive_int, default=None, metavar="N",
                       help="answer 429 while N requests already wait for admission")
    group.add_argument("--max-body-bytes", type=byte_size, default="4MiB", metavar="SIZE",
                       help="answer 413 to larger request bodies")
    group.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N",
                       help="most requests computed together")
    group.add_argument("--max-parallel-samples", type=positive_int, default=16, metavar="N",
                       help="largest n (best_of) a request may ask for; its samples share the "
                       "prompt's KV blocks (a larger n gets a 400)")
    group.add_argument("--max-pinned-fraction", type=float, default=0.5, metavar="F",
                       help="share of the KV pool cache_control pins may hold")
    group.add_argument("--cache-ttl-scale", type=positive_float, default=1.0, metavar="X",
                       help="multiply cache_control TTLs (5m, 1h) by X, e.g. for tests")
    group.add_argument("--drain-timeout", type=positive_float, default=None, metavar="S",
                       help="on SIGTERM, cancel requests still running after S seconds "
                       "(default: wait for all)")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))
    semantic = parser.add_argument_group(
        "semantic cache", "answer repeated questions (by meaning) without running the model; "
        "greedy requests only unless a request sends \"semantic_cache\": true")
    semantic.add_argument("--semantic-cache", action="store_true",
                          help="turn the semantic cache on (needs the 'semantic' extra)")
    semantic.add_argument("--semantic-cache-mode", choices=("verify", "trust"), default=None,
                          help="verify (default): a hit's stored answer is a draft the model "
                          "checks in one step, so answers are always the model's own; trust: "
                          "a hit is served as stored (APPROXIMATE: a near-miss that passes "
                          "serves a wrong answer, but no model run at all)")
    semantic.add_argument("--semantic-threshold", type=positive_float, default=None,
                          metavar="X", help="cosine similarity a hit needs, in (0, 1] "
                          "(default: the mode's, as `kvstack eval semantic` and `kvstack bench "
                          "verify` recommend)")
    semantic.add_argument("--semantic-dir", default=None, metavar="DIR",
                          help="where entries persist across restarts (default: "
                          "$KVSTACK_CACHE_DIR/semantic, else ~/.cache/kvstack/semantic)")
    semantic.add_argument("--semantic-ttl", type=positive_float, default=None, metavar="S",
                          help="seconds an entry may be served (default: 86400)")
    semantic.add_argument("--semantic-max-entries", type=positive_int, default=None,
                          metavar="N", help="entries kept; the least recently used go first "
                          "(default: 10000)")
    add_model_args(parser)
    parser.set_defaults(run=run)
    return parser


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return keys


def semantic_config(args: argparse.Namespace) -> SemanticCacheConfig | None:
    from kvstack.paths import cache_root
    from kvstack.semantic.cache import SemanticCacheConfig

    given = {"--semantic-cache-mode": args.semantic_cache_mode,
             "--semantic-threshold": args.semantic_threshold, "--semantic-dir": args.semantic_dir,
             "--semantic-ttl": args.semantic_ttl,
             "--semantic-max-entries": args.semantic_max_entries}
    if not args.semantic_cache:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise InvalidRequestError(f"{stray[0]} needs --semantic-cache")
        return None
    fields: dict[str, Any] = {
        "mode": args.semantic_cache_mode or "verify",
        "directory": Path(args.semantic_dir) if args.semantic_dir else cache_root() / "semantic",
        "threshold": args.semantic_threshold, "ttl_s": args.semantic_ttl,
        "max_entries": args.semantic_max_entries,
    }
    return SemanticCacheConfig(**{k: v for k, v in fields.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvstack.server.app import ServerConfig, create_app
    from kvstack.server.auth import KeyRing

    keys = KeyRing(api_keys(args))  # bad flags fail before the model loads
    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        cache_ttl_scale=args.cache_ttl_scale,
        semantic=semantic_config(args),
    )
    # uvicorn re-raises the signal it drained on; a SIGTERM handled to the end is a clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    llm = load_llm(args, max_num_seqs=args.max_num_seqs,
                   max_pinned_fraction=args.max_pinned_fraction,
                   max_parallel_samples=args.max_parallel_samples)
    app = create_app(llm, keys, config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    ))
    server.run()
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
