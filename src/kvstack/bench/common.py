"""What every benchmark case shares: the model under test, prompts, progress, results on disk.

A case returns a `CaseResult`; `report` prints its one summary line (stdout) and writes
`<out>/<case>.json`:

    {"case": ..., "summary": "<the printed line>", "created": ISO time,
     "machine": {cpu, logical_cpus, threads, load_average, torch, transformers, python, ...},
     "config": {what was run: model, sizes, quick}, "results": {case-specific numbers},
     "plots": [PNG file names beside the JSON],
     "table": [{"workload", "kvstack", "peer", "speedup"}: rows for the benchmark pages' tables]}
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvstack.engine.llm import LLM
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.errors import InvalidRequestError, KvstackError, ModelLoadError
from kvstack.kv.sizing import KVShape
from kvstack.version import __version__
from kvstack.weights import load_checkpoint

if TYPE_CHECKING:
    from tqdm import tqdm

    from kvstack.bench.peers.hf import TransformersPeer


# The single-stream decode prompt of `cache` and `peers`: 46 tokens through SmolLM2's chat
# template (system prompt included).
CHAT_QUESTION = "Explain in a few sentences how a key-value cache speeds up text generation."


class MissingBenchDependencyError(KvstackError):
    """matplotlib or tqdm is not installed."""


@dataclass(frozen=True)
class BenchOptions:
    model: str
    threads: int
    out: Path
    quick: bool = False
    peer_max_batch: int | None = None  # throughput: largest batch the peer runs (None = all)
    show_progress: bool = True
    url: str | None = None  # serve: load this running server instead of starting one
    # Our engine's weight format (None: float32; `bench peers` then runs every format).
    dtype: str | None = None
    quantization: str | None = None
    # cluster: the routing simulator instead of a real cluster, and its sizes
    simulate: bool = False
    pd: bool = False  # cluster: prefill/decode disaggregation against colocated replicas
    requests: int | None = None  # None: the case's default
    policies: tuple[str, ...] = ()  # cluster: which runs (empty: the case's default)
    load: float | None = None  # cluster: arrival rate / probed capacity (None: the default)
    rate: float | None = None  # cluster: arrival rate in requests/s (overrides `load`)
    sim_replicas: tuple[int, ...] = ()
    sim_tenants: tuple[int, ...] = ()
    duration: float | None = None  # load: seconds per concurrency level (None: the default)
    minutes: float | None = None  # soak: how long the traffic runs (None: the default)

    @property
    def threads_text(self) -> str:
        return "1 thread" if self.threads == 1 else f"{self.threads} threads"

    def __post_init__(self) -> None:
        if self.quantization is not None and not supports_quantization():
            raise InvalidRequestError(
                "this kvstack's engine has no weight quantization yet; leave out --quantization"
            )


@dataclass(frozen=True)
class TableRow:
    """One line of the benchmark pages' table: a workload, our figure, the peer's, and how
    many times faster we are (> 1: kvstack wins), all as display text."""

    workload: str
    kvstack: str
    peer: str = ""
    speedup: str = ""


@dataclass
class CaseResult:
    case: str
    summary: str
    config: dict[str, Any]
    results: dict[str, Any]
    plots: list[str] = field(default_factory=list)
    table: list[TableRow] = field(default_factory=list)


class Subject:
    """The model under test, loaded once per run: our engines, the transformers peer and the
    prompts all come from the same checkpoint, so both sides see identical weights and ids.

    A checkpoint without a tokenizer (e.g. a bare safetensors folder) still benchmarks: text
    becomes its UTF-8 bytes taken as token ids (modulo the vocabulary) and engines run with
    `skip_tokenizer_init`.
    """

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        source_commit()  # pinned as the run starts: results name the code that was imported
        self.checkpoint = load_checkpoint(options.model)
        try:
            self.tokenizer: Any | None = load_tokenizer(self.checkpoint)
        except ModelLoadError:
            self.tokenizer = None
        self._peer: TransformersPeer | None = None

    @property
    def max_model_len(self) -> int:
        return self.checkpoint.config.max_model_len

    @property
    def weight_format(self) -> str:
        """Our engine's weights in this run: `float32`, `bfloat16` or a quantization."""
        return self.options.quantization or self.options.dtype or "float32"

    def kv_shape(self, dtype: str | None = None) -> KVShape:
        return KVShape.of(self.checkpoint.config, dtype or self.options.dtype or "float32")

    def llm(self, **kwargs: Any) -> LLM:
        """An engine on this model in the run's weight format (--dtype, --quantization) and
        thread count; kwargs go to `LLM` and override both."""
        torch.set_num_threads(self.options.threads)
        engine_args: dict[str, Any] = {"dtype": self.options.dtype or "float32"}
        if self.options.quantization is not None:
            engine_args["quantization"] = self.options.quantization
        engine_args |= kwargs
        return LLM(model=self.options.model, num_threads=self.options.threads,
                   skip_tokenizer_init=self.tokenizer is None, **engine_args)

    def peer(self) -> TransformersPeer:
        """The transformers model with our weights, built on first use."""
        from kvstack.bench.peers.hf import TransformersPeer

        torch.set_num_threads(self.options.threads)
        if self._peer is None:
            self._peer = TransformersPeer(self.checkpoint)
        return self._peer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        vocab = self.checkpoint.config.vocab_size
        return [b % vocab for b in text.encode()]

    def chat_prompt(self, question: str) -> list[int]:
        """A user question through the chat template (plain encoding without a tokenizer)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            return self.encode(question)
        assert self.tokenizer is not None  # it has a template
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        # transformers >= 5 returns a BatchEncoding here; older versions a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def require_context(self, num_tokens: int, what: str) -> None:
        if num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"{what} needs {num_tokens} tokens of context but {self.options.model} has "
                f"{self.max_model_len}; use --quick or a model with a longer context"
            )


def supports_quantization() -> bool:
    """Whether `LLM` takes `quantization=` (weight-only int8 and the like)."""
    return "quantization" in inspect.signature(LLM).parameters


def topic_texts() -> list[str]:
    """Python's own reference documentation (pydoc topics), one text per topic, sorted by name:
    realistic English-and-code prompts that ship with every Python."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def distinct_prompts(
    subject: Subject, num: int, length: int, block_size: int = 16
) -> list[list[int]]:
    """`num` prompts of about `length` tokens (length-4 .. length+4), no two with the same first
    block, so the prefix cache finds nothing to reuse among them. Each comes from its own topic;
    past the last topic, later passes start `length` tokens further into the texts."""
    texts = [subject.encode(t) for t in topic_texts()]
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    offset = 0
    while len(prompts) < num:
        if offset >= max(len(ids) for ids in texts):
            raise InvalidRequestError(f"the prompt texts hold fewer than {num} distinct prompts")
        for ids in texts:
            n = max(1, length + len(prompts) % 9 - 4)
            prompt = ids[offset:offset + n]
            if len(prompt) < n or tuple(prompt[:block_size]) in seen:
                continue
            seen.add(tuple(prompt[:block_size]))
            prompts.append(prompt)
            if len(prompts) == num:
                break
        offset += length
    return prompts


# -- measuring -------------------------------------------------------------------------------












def progress(options: BenchOptions, total: int, desc: str) -> tqdm:
    """A progress bar on stderr (stdout carries only the summary lines)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not options.show_progress)


def in_fresh_process(module: str, spec: dict[str, Any], what: str, timeout_s: float = 3600
                     ) -> Any:
    """Run `python -m module SPEC` (a case's measurement in a new process that shares nothing
    with this one but what `spec` names) and return the JSON its last stdout line holds."""
    done = subprocess.run([sys.executable, "-m", module, json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# -- reporting -------------------------------------------------------------------------------


def check_dependencies() -> None:
    """Fail with one line before any model loads when the plotting extras are missing."""
    try:
        import matplotlib  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as err:
        raise MissingBenchDependencyError(
            f"benchmarks need matplotlib and tqdm ({err.name} is missing); "
            "run `pip install 'kvstack[bench]'`"
        ) from err


def machine_info(threads: int) -> dict[str, Any]:
    import transformers

    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        # Other jobs on the machine show up here; read timings in that light.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvstack": __version__,
        "kvstack_commit": source_commit(),
    }


@functools.cache
def source_commit() -> str | None:
    """The git commit this kvstack runs from (`-dirty` with uncommitted changes), or None
    outside a git checkout. Cached: the first call (as a run starts) names the code that was
    imported, whatever is committed while the run goes on."""
    root = Path(__file__).resolve().parents[3]  # <root>/src/kvstack/bench/common.py
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()








def report(result: CaseResult, options: BenchOptions,
           echo: Callable[[str], None] = print) -> Path:
    """Print the case's summary line and write its JSON; return the JSON path."""
    payload: dict[str, Any] = {
        "case": result.case,
        "summary": result.summary,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(options.threads),
        "config": result.config,
        "results": result.results,
        "plots": result.plots,
        "table": [asdict(row) for row in result.table],
    }
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / f"{result.case}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    echo(result.summary)
    load, cpus = payload["machine"]["load_average"], payload["machine"]["logical_cpus"]
    if load and cpus and load[0] > cpus:
        print(f"note: load average {load[0]:.1f} on {cpus} CPUs while {result.case} ran; "
              "other jobs competed for the cores, so its timings are noisy", file=sys.stderr)
    return path
