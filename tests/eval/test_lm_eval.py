"""lm-evaluation-harness, unmodified, against a live `kvstack serve` (`local-completions`:
echo + logprobs over token ids) and through its own `hf` backend on the same weights, on three
tiny tasks this test writes: multiple choice, a rolling-loglikelihood perplexity task and a
generate_until task. Per-sample loglikelihoods within 1e-3, the same accuracy and the same
generations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.live_server import LiveServer, start_server

from kvstack import LLM
from kvstack.bench.peers.hf import transformers_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TASKS = ("kvs_choice", "kvs_rolling", "kvs_answer")
QUESTIONS = [
    ("Which planet is known as the red planet?", ["Mars", "Venus", "Jupiter", "Saturn"], 0),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which gas do plants take in from the air?", ["oxygen", "helium", "nitrogen",
                                                   "carbon dioxide"], 3),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which animal is the largest mammal?", ["blue whale", "mouse", "cat", "horse"], 0),
]
TEXTS = ["The river runs through the old town, past the mill and under three stone bridges "
         "before it reaches the sea.",
         "To make bread, mix flour, water, salt and yeast, knead the dough, let it rise and "
         "bake it in a hot oven."]
# A shared few-shot preamble (the part of each request the prefix cache serves).
PREAMBLE = ("The following are simple questions with their answers.\n\n"
            "Question: What colour is the sky on a clear day?\nAnswer: blue\n\n"
            "Question: How many days are in a week?\nAnswer: seven\n\n")


def _write_tasks(folder: Path) -> None:
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "kvs_choice.yaml").write_text(
        f"task: kvs_choice\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'choice.jsonl'}\noutput_type: multiple_choice\n"
        f"description: {json.dumps(PREAMBLE)}\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "kvs_rolling.yaml").write_text(
        f"task: kvs_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'texts.jsonl'}\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (folder / "kvs_answer.yaml").write_text(
        f"task: kvs_answer\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'choice.jsonl'}\noutput_type: generate_until\n"
        f"description: {json.dumps(PREAMBLE)}\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \" {{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Any) -> Path:
    """The embedded model's weights in float32 as a plain Hugging Face folder, with its
    tokenizer: what `--model hf` loads and what both backends tokenize with."""
    folder = tmp_path_factory.mktemp("hf-smollm2")
    transformers_model(embedded_checkpoint).save_pretrained(folder)
    LLM(MODEL, kv_cache_memory="16MiB").get_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("lm-eval-server") / "server.log"
    live = start_server(["--model", MODEL, "--kv-cache-memory", "256MiB"], log)
    yield live
    assert live.terminate() == 0, live.log()[-3000:]


def _lm_eval(folder: Path, out: Path, model: str, model_args: str) -> dict[str, dict[int, Any]]:
    """Run the harness's CLI; per task, doc id -> that sample's filtered responses."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args",
           model_args, "--include_path", str(folder), "--tasks", ",".join(TASKS),
           "--log_samples", "--output_path", str(out), "--seed", "1234", "--device", "cpu"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples: dict[str, dict[int, Any]] = {}
    for task in TASKS:
        [path] = out.rglob(f"samples_{task}_*.jsonl")
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = {s["doc_id"]: s for s in lines}
    [results] = out.rglob("results_*.json")
    samples["results"] = json.loads(results.read_text())["results"]
    return samples


def test_lm_eval_local_completions_matches_its_hf_backend(server: LiveServer, hf_folder: Path,
                                                          tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(tasks)
    ours = _lm_eval(tasks, tmp_path / "kvstack", "local-completions",
                    f"model={MODEL},base_url={server.url}/v1/completions,"
                    f"tokenizer_backend=huggingface,tokenizer={hf_folder},"
                    "tokenized_requests=True,num_concurrent=1,max_retries=1")
    ref = _lm_eval(tasks, tmp_path / "hf", "hf",
                   f"pretrained={hf_folder},dtype=float32")
    for task in ("kvs_choice", "kvs_rolling"):
        assert sorted(ours[task]) == sorted(ref[task])
        for doc_id, sample in ours[task].items():
            got, want = _loglikelihoods(sample), _loglikelihoods(ref[task][doc_id])
            assert all(float(r[0]) != 0.0 for r in got), "a loglikelihood of 0: no scores"
            assert max(abs(float(a[0]) - float(b[0])) for a, b in zip(got, want,
                                                                       strict=True)) < 1e-3
            assert [r[1:] for r in got] == [r[1:] for r in want]  # the is-greedy flags
    assert ours["results"]["kvs_choice"]["acc,none"] == ref["results"]["kvs_choice"]["acc,none"]
    for doc_id, sample in ours["kvs_answer"].items():
        assert sample["filtered_resps"] == ref["kvs_answer"][doc_id]["filtered_resps"]
        assert sample["filtered_resps"][0].strip()  # a real answer, not an empty one
    match = ours["results"]["kvs_answer"]["exact_match,none"]
    assert match == ref["results"]["kvs_answer"]["exact_match,none"] and match > 0
    # The choices of a question and the questions behind the preamble shared their context.
    assert _cache_hit_tokens(server) > 0


def _loglikelihoods(sample: dict[str, Any]) -> list[Any]:
    """Per request of a sample, [loglikelihood, ...] (a rolling task: one float)."""
    return [r if isinstance(r, list) else [r] for r in sample["filtered_resps"]]


def _cache_hit_tokens(server: LiveServer) -> float:
    """Prompt tokens the server served from its prefix cache so far."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvstack_prefix_cache_hits_total "):
            return float(line.split()[-1])
    raise AssertionError("no prefix-cache hit counter in /metrics")
