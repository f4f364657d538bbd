"""`kvstack serve`: the OpenAI- and Anthropic-compatible HTTP server.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish, shuts the
engine down and exits 0. With `--replicas N` the same server runs as a Ray Serve application:
an ingress in front of N engine replicas (`kvstack.cluster`), on a local Ray instance started
and stopped here, or on a running Ray cluster (`--ray-address`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvstack.argtypes import non_negative_int
from kvstack.cli.args import add_model_args, byte_size, load_llm, positive_float, positive_int
from kvstack.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvstack.semantic.cache import SemanticCacheConfig
    from kvstack.server.auth import KeyRing
    from kvstack.server.state import ServerConfig

API_KEYS_ENV = "KVSTACK_API_KEYS"
ADMIN_KEY_ENV = "KVSTACK_ADMIN_KEY"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI and Anthropic HTTP APIs",
        description="Serve /v1/completions, /v1/chat/completions (OpenAI), /v1/messages "
        "(Anthropic, with cache_control prompt caching), /v1/models, /health, /metrics, and "
        "/ui: a live view of the cache (block pool, prefix tree, charts, a playground).",
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
                       help="share of the KV pool pins may hold (cache_control, stored Responses)")
    group.add_argument("--cache-ttl-scale", type=positive_float, default=1.0, metavar="X",
                       help="multiply cache_control TTLs (5m, 1h) by X, e.g. for tests")
    group.add_argument("--responses-db", default=None, metavar="PATH",
                       help="keep stored Responses (/v1/responses) in this SQLite file, so "
                       "previous_response_id works across restarts (with --kv-disk-dir their "
                       "KV too); default: in memory")
    group.add_argument("--responses-pin-ttl", type=non_negative_int, default=300,
                       metavar="S", help="seconds a stored response's KV blocks stay pinned "
                       "after each turn (within --max-pinned-fraction; 0: not pinned)")
    group.add_argument("--drain-timeout", type=positive_float, default=None, metavar="S",
                       help="on SIGTERM, cancel requests still running after S seconds "
                       "(default: wait for all)")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))
    _add_semantic_args(parser)
    _add_cluster_args(parser)
    _add_ui_args(parser)
    add_model_args(parser)
    parser.set_defaults(run=run)
    return parser


def _add_semantic_args(parser: argparse.ArgumentParser) -> None:
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


ROUTERS = ("cache-aware", "round-robin", "pow2")


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group(
        "replicas (Ray Serve; needs the 'cluster' extra)",
        "run N engine replicas behind one endpoint, routed by the KV blocks each holds "
        "(and, with --kv-redis-url, sharing them through Redis)")
    cluster.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                         help="engine replicas (with --kv-redis-url they share KV through "
                         "Redis); without it: one engine in this process")
    cluster.add_argument("--prefill-replicas", type=non_negative_int, default=None,
                         metavar="P", help="of the N replicas, P only prefill (prompt and "
                         "first token) and hand the KV to the N - P that decode (default 0: "
                         "every replica does both)")
    cluster.add_argument("--max-local-prefill", type=non_negative_int, default=None,
                         metavar="TOKENS", help="with --prefill-replicas: prompts of at most "
                         "this many tokens are prefilled on the decode replica, not handed "
                         "over (default 0: every prompt goes through a prefill replica)")
    cluster.add_argument("--router", choices=ROUTERS, default=None,
                         help="cache-aware (default): the replica holding the longest cached "
                         "prefix, weighed against load; round-robin; pow2 (Ray Serve's default)")
    cluster.add_argument("--ray-address", default=None, metavar="ADDR",
                         help="join this Ray cluster ('auto', or host:port of `ray start "
                         "--head`) instead of starting a local Ray instance")
    cluster.add_argument("--replica-threads", type=positive_int, default=None, metavar="T",
                         help="torch threads (and Ray CPUs) per replica (default 1)")


def _add_ui_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "live view", "GET /ui shows the block pool, the prefix tree, charts and a playground; "
        "with API keys it asks for one and shows that tenant's text only")
    group.add_argument("--admin-key", default=None, metavar="KEY",
                       help=f"a key that shows everyone's blocks and prompts in /ui (not an "
                       f"API key; also ${ADMIN_KEY_ENV})")
    group.add_argument("--no-ui", action="store_true",
                       help="do not serve the live view at /ui")


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return keys


def admin_key(args: argparse.Namespace) -> str | None:
    return args.admin_key if args.admin_key is not None else os.environ.get(ADMIN_KEY_ENV) or None


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


def check_cluster_flags(args: argparse.Namespace) -> None:
    if args.replicas is None:
        given = {"--router": args.router, "--ray-address": args.ray_address,
                 "--replica-threads": args.replica_threads,
                 "--prefill-replicas": args.prefill_replicas,
                 "--max-local-prefill": args.max_local_prefill}
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise InvalidRequestError(f"{stray[0]} needs --replicas N")
        return
    if args.prefill_replicas is not None and args.prefill_replicas >= args.replicas:
        raise InvalidRequestError(f"--prefill-replicas {args.prefill_replicas} leaves no "
                                  f"decode replica of --replicas {args.replicas}; give fewer")
    if args.max_local_prefill is not None and not args.prefill_replicas:
        raise InvalidRequestError("--max-local-prefill needs --prefill-replicas P")
    if not args.kv_redis_url:
        # As vLLM's and SGLang's routers do: routing alone, each replica's KV its own.
        print("warning: --replicas without --kv-redis-url: replicas share no KV tier (routing "
              "alone; a prefix held by a busy or dead replica is recomputed)", file=sys.stderr)
    if args.drain_timeout is not None:
        raise InvalidRequestError("--drain-timeout applies to one engine; with --replicas, "
                                  "Ray Serve drains each replica on shutdown")
    if args.kv_window is not None or args.no_prefix_caching or args.no_kv_cache:
        raise InvalidRequestError("--replicas routes by cached prefixes: it needs the prefix "
                                  "cache (no --kv-window, --no-prefix-caching or --no-kv-cache)")


def run(args: argparse.Namespace) -> int:
    from kvstack.server.auth import KeyRing
    from kvstack.server.state import ServerConfig

    keys = api_keys(args)
    ring = KeyRing(keys, admin_key(args))  # bad flags fail before the model loads
    check_cluster_flags(args)
    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        cache_ttl_scale=args.cache_ttl_scale,
        semantic=semantic_config(args),
        # The live view reads one engine's block pool; a cluster's ingress has none.
        ui=not args.no_ui and args.replicas is None,
        responses_db=Path(args.responses_db) if args.responses_db else None,
        responses_pin_ttl_s=args.responses_pin_ttl,
    )
    if args.replicas is not None:
        from kvstack.cli.serve_cluster import run_cluster

        return run_cluster(args, keys, config)
    return _run_one(args, ring, config)


def _run_one(args: argparse.Namespace, keys: KeyRing, config: ServerConfig) -> int:
    import uvicorn

    from kvstack.server.app import create_app, stop_streams

    # uvicorn re-raises the signal it drained on; a SIGTERM handled to the end is a clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    llm = load_llm(args, max_num_seqs=args.max_num_seqs,
                   max_pinned_fraction=args.max_pinned_fraction,
                   max_parallel_samples=args.max_parallel_samples)
    app = create_app(llm, keys, config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            stop_streams(app)  # open /ui pages must not hold the drain
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    ))
    server.run()
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
