"""`kvstack eval blend`: what blending (APPROXIMATE chunk reuse, `blend/`) costs in quality.

On a seeded synthetic multi-document QA set (`blend_data.py`: 4-8 documents of 150-400
tokens, single-hop and two-hop questions, each asked with its documents in two orders), every
arm scores the same prompts as full prefill does: at the answer's first token the top-1
agreement with full prefill and the KL divergence KL(full || arm) in nats, the answer's NLL
(teacher-forced, summed over its tokens), exact match (the greedy answer is the gold one, as
teacher-forced argmax over its tokens) relative to full prefill's, and the compute used
(prompt token-layers computed over full prefill's). Means come with 95% confidence intervals
(normal approximation over prompts); paired differences compare selectors.

Each item is compared as soon as it is measured (one item's logprob rows held at a time), and
`--resume FILE` keeps every finished item's figures, so a long run (200 items take 2-2.5 hours
on 2 cores) that was interrupted continues where it stopped when given the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstack.argtypes import DEFAULT_MODEL, name_list, positive_int
from kvstack.errors import InvalidRequestError
from kvstack.eval.quality import write_eval_json

# arm name -> BlendParams fields (None: full prefill, the reference)
ARMS: dict[str, dict[str, Any] | None] = {
    "full_prefill": None,
    "full_reuse": {"recompute_ratio": 0.0},
    "kv_dev_0.05": {"recompute_ratio": 0.05},
    "kv_dev_0.15": {"recompute_ratio": 0.15},
    "kv_dev_0.3": {"recompute_ratio": 0.3},
    "first_k_8": {"selector": "first_k", "first_k": 8},
    "random_0.15": {"selector": "random", "recompute_ratio": 0.15},
    "attention_0.15": {"selector": "attention", "recompute_ratio": 0.15},
    "impact_0.15": {"selector": "impact", "recompute_ratio": 0.15},
    "first_k_dev_0.15": {"selector": "first_k_deviation", "recompute_ratio": 0.15},
    "first_k_dev_0.1": {"selector": "first_k_deviation", "recompute_ratio": 0.1},
    "gradual_0.12": {"selector": "gradual", "recompute_ratio": 0.12},
}
PAIRS = (("kv_dev_0.15", "random_0.15"), ("kv_dev_0.05", "random_0.15"),
         ("attention_0.15", "kv_dev_0.15"), ("impact_0.15", "kv_dev_0.15"),
         ("first_k_8", "kv_dev_0.15"),
         ("first_k_dev_0.15", "kv_dev_0.15"), ("gradual_0.12", "kv_dev_0.15"),
         ("gradual_0.12", "kv_dev_0.3"))
INSTRUCTION = "Answer the question using the documents.\n\n"
METRICS = ("top1", "kl", "nll", "exact_match", "compute")  # per prompt


@dataclass(frozen=True)
class Mean:
    mean: float
    ci95: float  # half-width


def mean_ci(values: list[float]) -> Mean:
    if not values:
        return Mean(float("nan"), float("nan"))
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return Mean(statistics.fmean(values), 1.96 * sd / math.sqrt(len(values)))


@dataclass(frozen=True)
class ArmRow:
    arm: str
    top1: Mean  # agreement with full prefill at the answer's first token
    kl: Mean  # KL(full || arm), nats, at the answer's first token
    nll: Mean  # the answer's NLL, nats
    exact_match: Mean  # greedy answer == gold
    compute: Mean  # prompt token-layers computed / full prefill's


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "blend",
        help="blending (approximate chunk reuse): KL, top-1 agreement, NLL, accuracy vs full "
        "prefill per selector",
        description="Score a seeded synthetic multi-document QA set (single- and two-hop, "
        "each item in two document orders) with full prefill and with each blending arm; "
        "report top-1 agreement and KL at the answer's first token, answer NLL, exact match "
        "and compute, with 95%% confidence intervals.",
        epilog="example: kvstack eval blend --items 200 --out blend.json",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the embedded model's name, a .gguf file or a Hugging Face folder")
    parser.add_argument("--items", type=positive_int, default=200, metavar="N",
                        help="QA items (each asked in --orders document orders)")
    parser.add_argument("--orders", type=positive_int, default=2, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", type=name_list(tuple(ARMS), "arm"), default=list(ARMS),
                        metavar="LIST", help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the table as JSON here")
    parser.add_argument("--resume", type=Path, default=None, metavar="FILE",
                        help="keep each finished item's figures in FILE (JSON lines) and skip "
                        "the items it holds already: an interrupted run, given the same "
                        "command, continues where it stopped")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar on stderr (200 items take 2-2.5 hours on 2 cores)")
    parser.set_defaults(run=run)
    return parser


def prompts_of(items: list[Any], orders: int, seed: int) -> list[tuple[list[Any], str]]:
    """(segments without the answer, answer text) per item and order; order 0 is the item's,
    the others are seeded permutations."""
    import random

    from kvstack.blend.params import Chunk

    rng = random.Random(seed + 1)
    out = []
    for item in items:
        for k in range(orders):
            docs = list(item.documents)
            if k:
                rng.shuffle(docs)
            segments: list[Any] = [INSTRUCTION]
            for doc in docs:
                segments += [Chunk(doc), "\n\n"]
            segments.append(f"Question: {item.question}\nAnswer: {item.stem}")
            out.append((segments, item.answer))
    return out


def _measure(llm: Any, prompts: list[tuple[list[Any], str]], params: Any,
             ) -> list[dict[str, Any]]:
    """Per prompt: logprob rows over the answer and the blend usage."""
    tok = llm.engine.tokenizer
    rows = []
    for segments, answer in prompts:
        ids = tok.encode(answer, add_special_tokens=False)
        scored = llm.score({"segments": [*segments, ids]}, len(ids) + 1, blend=params)[0]
        rows.append({"logprobs": scored.logprobs[:-1], "answer": ids,
                     "compute": scored.output.blend.compute if scored.output.blend else 1.0})
    return rows


def _compare(ref: list[dict[str, Any]], arm: list[dict[str, Any]]) -> dict[str, list[float]]:
    import torch

    out: dict[str, list[float]] = {k: [] for k in METRICS}
    for r, a in zip(ref, arm, strict=True):
        p, q = r["logprobs"][0], a["logprobs"][0]
        out["top1"].append(float(int(p.argmax()) == int(q.argmax())))
        out["kl"].append(float((p.exp() * (p - q)).sum()))
        answer = torch.tensor(a["answer"])
        out["nll"].append(-float(a["logprobs"].gather(1, answer[:, None]).sum()))
        out["exact_match"].append(float(bool((a["logprobs"].argmax(1) == answer).all())))
        out["compute"].append(a["compute"])
    return out


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from kvstack.blend.params import BlendParams
    from kvstack.engine.llm import LLM
    from kvstack.eval.blend_data import make_items

    if args.threads:
        torch.set_num_threads(args.threads)
    arms = ["full_prefill"] + [a for a in args.arms if a != "full_prefill"]
    spec = {"model": args.model, "seed": args.seed, "orders": args.orders, "arms": arms}
    done = load_items(args.resume, spec)
    with LLM(model=args.model, kv_cache_memory="256MiB", enable_prefix_caching=False,
             max_num_batched_tokens=4096, num_threads=args.threads) as llm:
        tok = llm.engine.tokenizer
        assert tok is not None  # the LLM loads its tokenizer
        items = make_items(args.seed, args.items,
                           lambda t: tok.encode(t, add_special_tokens=False))
        prompts = prompts_of(items, args.orders, args.seed)
        params = {arm: None if (kw := ARMS[arm]) is None else BlendParams(**kw) for arm in arms}
        per_item: list[dict[str, dict[str, list[float]]]] = []
        for i, item in enumerate(tqdm(items, desc="items", file=sys.stderr, leave=False,
                                      dynamic_ncols=True, disable=not args.progress)):
            if i in done:
                per_item.append(done[i])
                continue
            # One item's documents just before its prompts: all items' documents together
            # overflow the chunk cache, and a prompt would then compute evicted ones exactly.
            llm.precompute_chunks(list(item.documents))
            mine = prompts[i * args.orders:(i + 1) * args.orders]
            # Compared item by item, so that only one item's logprob rows are ever held.
            ref = _measure(llm, mine, None)
            figures = {arm: _compare(ref, ref if params[arm] is None
                                     else _measure(llm, mine, params[arm])) for arm in arms}
            append_item(args.resume, spec, i, figures)
            per_item.append(figures)
    per_arm = {arm: {k: [v for f in per_item for v in f[arm][k]] for k in METRICS}
               for arm in arms}
    return {"items": items, "num_prompts": len(prompts), "per_arm": per_arm}


def load_items(path: Path | None, spec: dict[str, Any]) -> dict[int, Any]:
    """The items a `--resume` file holds (a last line cut short by an interruption is
    dropped); the file must come from the same model, seed, orders and arms."""
    if path is None or not path.exists() or path.stat().st_size == 0:
        return {}
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if header != {"spec": spec}:
        raise InvalidRequestError(f"{path} holds another run (not the same model, seed, orders "
                                  f"and arms as this one); give another --resume file")
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
            done[int(row["item"])] = row["figures"]
        except (ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
            continue
    return done


def append_item(path: Path | None, spec: dict[str, Any], index: int,
                figures: dict[str, dict[str, list[float]]]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = not path.exists() or path.stat().st_size == 0
    cut = False  # the last line was cut short by an interruption: start a line of our own
    if not fresh:
        with path.open("rb") as f:
            f.seek(-1, 2)
            cut = f.read(1) != b"\n"
    with path.open("a") as f:
        if fresh:
            f.write(json.dumps({"spec": spec}) + "\n")
        if cut:
            f.write("\n")
        f.write(json.dumps({"item": index, "figures": figures}) + "\n")


def summarize(per_arm: dict[str, dict[str, list[float]]]) -> tuple[list[ArmRow],
                                                                    dict[str, Mean]]:
    rows = [ArmRow(arm, *(mean_ci(m[k]) for k in ("top1", "kl", "nll", "exact_match",
                                                   "compute")))
            for arm, m in per_arm.items()]
    pairs = {}
    for a, b in PAIRS:
        if a in per_arm and b in per_arm:
            pairs[f"kl {a} - {b}"] = mean_ci([x - y for x, y in zip(
                per_arm[a]["kl"], per_arm[b]["kl"], strict=True)])
    return rows, pairs


def run(args: argparse.Namespace) -> int:
    result = evaluate(args)
    rows, pairs = summarize(result["per_arm"])
    items = result["items"]
    print(f"{len(items)} items ({sum(i.hops == 1 for i in items)} single-hop) x {args.orders} "
          f"orders = {result['num_prompts']} prompts, {min(len(i.documents) for i in items)}-"
          f"{max(len(i.documents) for i in items)} documents; seed {args.seed}; blending is "
          f"APPROXIMATE, every figure is against full prefill (95% CI)")
    ref_em = rows[0].exact_match.mean
    print(f"{'arm':<16} {'compute':>8} {'top-1':>13} {'KL (nats)':>15} {'answer NLL':>15} "
          f"{'EM / full':>10}")
    for r in rows:
        rel = r.exact_match.mean / ref_em if ref_em else float("nan")
        print(f"{r.arm:<16} {100 * r.compute.mean:7.1f}% {r.top1.mean:6.3f}±{r.top1.ci95:.3f} "
              f"{r.kl.mean:7.3f}±{r.kl.ci95:.3f} {r.nll.mean:7.3f}±{r.nll.ci95:.3f} "
              f"{rel:10.2f}")
    for name, m in pairs.items():
        print(f"paired {name}: {m.mean:+.3f} ± {m.ci95:.3f}")
    write_eval_json(args.out, {
        "eval": "blend", "model": args.model, "items": len(items), "orders": args.orders,
        "seed": args.seed, "full_prefill_exact_match": ref_em,
        "rows": [asdict(r) for r in rows],
        "paired": {k: asdict(v) for k, v in pairs.items()},
        # Per prompt, so that any other paired comparison can be made from the file.
        "per_prompt": result["per_arm"],
    })
    return 0
