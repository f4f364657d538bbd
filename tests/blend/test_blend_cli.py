"""`kvstack bench rag` (tiny model, --quick) and `kvstack eval blend` (the embedded model, one
item): they run and write what they promise. Timings are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstack.cli.main import main
from kvstack.errors import KvstackError
from kvstack.eval import blend as blend_eval
from kvstack.eval.blend_data import make_items

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_rag_quick(tiny4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                         ) -> None:
    code = main(["bench", "rag", "--quick", "--model", str(tiny4), "--threads", "1",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("rag: ") and "approximate" in line
    data = json.loads((tmp_path / "rag.json").read_text())
    arms = data["results"]["arms"]
    assert list(arms) == ["full_prefill", "prefix_cache", "blend_default", "blend_first_k",
                          "blend_0.05", "blend_disk"]
    assert arms["full_prefill"]["mean_kl"] == pytest.approx(0, abs=1e-6)
    assert arms["full_prefill"]["median_cached_tokens"] == 0
    for name in ("blend_default", "blend_first_k", "blend_0.05", "blend_disk"):
        assert 0 < arms[name]["mean_compute"] < 1 and arms[name]["mean_kl"] >= 0
    # The disk arm restores the same entries the memory arm placed: the same result.
    assert arms["blend_disk"]["mean_kl"] == pytest.approx(arms["blend_default"]["mean_kl"])
    assert (tmp_path / "rag.png").read_bytes().startswith(b"\x89PNG")


def test_synthetic_items_are_seeded_and_sized() -> None:
    encode = lambda text: text.split()  # noqa: E731  (a word tokenizer is enough here)
    items = make_items(3, 6, encode, doc_tokens=(150, 400))
    assert items == make_items(3, 6, encode, doc_tokens=(150, 400))
    assert [i.hops for i in items] == [1, 2] * 3
    for item in items:
        assert 4 <= len(item.documents) <= 8
        assert all(150 <= len(encode(d)) <= 420 for d in item.documents)
        assert item.answer.strip() in " ".join(item.documents)
        assert item.stem.split(" was born")[0].split("founder of ")[-1] in item.question


@pytest.mark.slow
def test_eval_blend_one_item(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    out, partial = tmp_path / "blend.json", tmp_path / "items.jsonl"
    command = ["eval", "blend", "--items", "1", "--arms", "full_reuse,kv_dev_0.15",
               "--threads", "1", "--out", str(out), "--resume", str(partial)]
    code = main(command)
    assert code == 0
    printed = capsys.readouterr()
    assert "APPROXIMATE" in printed.out
    assert "items" in printed.err and "1/1" in printed.err  # the progress bar, on stderr
    written = json.loads(out.read_text())
    rows = {r["arm"]: r for r in written["rows"]}
    assert len(written["per_prompt"]["kv_dev_0.15"]["kl"]) == 2  # one item in two orders
    assert sum(written["per_prompt"]["full_reuse"]["kl"]) / 2 == pytest.approx(
        rows["full_reuse"]["kl"]["mean"])
    assert list(rows) == ["full_prefill", "full_reuse", "kv_dev_0.15"]
    assert rows["full_prefill"]["kl"]["mean"] == pytest.approx(0, abs=1e-6)
    assert rows["full_prefill"]["top1"]["mean"] == 1
    assert rows["full_reuse"]["compute"]["mean"] < rows["kv_dev_0.15"]["compute"]["mean"] < 1
    # --resume: the item's figures were kept; the same command again measures nothing (a
    # line cut short by an interruption is dropped) and reports the same table.
    assert len(partial.read_text().splitlines()) == 2  # the run's spec, then item 0
    with partial.open("a") as f:
        f.write('{"item": 1, "figu')
    monkeypatch.setattr(blend_eval, "_measure", lambda *a: pytest.fail("measured again"))
    assert main(command) == 0
    assert json.loads(out.read_text())["rows"] == written["rows"]
    capsys.readouterr()
    assert main([*command[:5], "full_reuse", *command[6:]]) == 2  # other arms: refused
    assert "holds another run" in capsys.readouterr().err


def test_resume_file_survives_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "items.jsonl"  # its folder is made on the first write
    spec = {"model": "m", "seed": 0, "orders": 2, "arms": ["a"]}
    figures = {"a": {"kl": [0.5, 0.25]}}
    assert blend_eval.load_items(path, spec) == {}
    blend_eval.append_item(path, spec, 0, figures)
    empty = tmp_path / "empty.jsonl"
    empty.touch()  # killed before its first write
    assert blend_eval.load_items(empty, spec) == {}
    with path.open("a") as f:
        f.write('{"item": 1, "figures": {"a": {"kl": [0.')  # interrupted mid-line
    blend_eval.append_item(path, spec, 1, figures)
    blend_eval.append_item(path, spec, 2, figures)
    assert blend_eval.load_items(path, spec) == {0: figures, 1: figures, 2: figures}
    with pytest.raises(KvstackError, match="another run"):
        blend_eval.load_items(path, spec | {"seed": 1})


@pytest.mark.slow
def test_cache_warm_chunks_then_held(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for i, text in enumerate(("The harbor town of Velm ships salt.", "Velm has a lighthouse.")):
        files.append(tmp_path / f"c{i}.txt")
        files[-1].write_text(text)
    argv = ["cache", "warm", "--chunk", *map(str, files), "--kv-disk-dir", str(tmp_path / "kv"),
            "--kv-cache-memory", "32MiB", "--threads", "1"]
    assert main(argv) == 0
    assert "warmed 2 chunk entries (0 held already)" in capsys.readouterr().out
    assert main(argv) == 0  # a fresh engine finds both in the disk tier
    assert "warmed 0 chunk entries (2 held already)" in capsys.readouterr().out
    assert main(["cache", "ls", "--kv-disk-dir", str(tmp_path / "kv")]) == 0
    assert capsys.readouterr().out.count("chunk entry") == 2
