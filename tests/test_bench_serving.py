"""The benchmarks' serving harness (provided code, no points): both systems driven on one wall
clock give every request's ids, the TTFTs and the set-up apart; the L5/L8 benchmarks run end to
end on a tiny workload and write their markdown sections."""

from __future__ import annotations

import pytest

from harness import hf_reference as hf
from harness.benchmark import (hf_continuous_config, replace_section, serve_engine, serve_hf_continuous)
from helpers import load_script, random_prompt
from l5_eviction import WorkItem, load_engine_model, make_engine
from l8_prefix import make_prefix_engine

pytestmark = [pytest.mark.l8, pytest.mark.usefixtures("one_torch_thread")]


def items(vocab: int) -> list[WorkItem]:
    prefix = random_prompt(20, vocab, seed=1)
    return [WorkItem(prefix + random_prompt(3 + k, vocab, seed=10 + k), 4 + k) for k in range(3)]


def test_serve_engine_and_hf_continuous_agree_with_hf_alone(tiny_model_dir):
    ours, theirs = load_engine_model(tiny_model_dir), hf.load_hf_model(str(tiny_model_dir))
    work = items(512)
    want = [hf.hf_greedy(theirs, w.prompt_ids, w.max_new_tokens) for w in work]
    offsets = [0.0, 0.02, 0.0]  # the third is handed over before the second
    for make in (lambda: make_engine(ours, 32, 4), lambda: make_prefix_engine(ours, 32, 4)):
        run = serve_engine(make, work, offsets)
        assert run.ids == want and len(run.ttft_s) == 3 and all(t > 0 for t in run.ttft_s)
        assert run.serve_s >= 0.02 and run.engine is not None
    run = serve_hf_continuous(theirs, work, offsets, hf_continuous_config(4, 32, 64, block_sharing=True))
    assert run.ids == want and all(t > 0 for t in run.ttft_s) and run.serve_s >= 0.02
    assert run.setup_s > 0 and run.teardown_s > 0 and run.engine is None


def test_replace_section_rewrites_only_its_block(tmp_path):
    path = tmp_path / "b.md"
    path.write_text("# title\n\nhand-written\n")
    replace_section(str(path), "x", "first")
    replace_section(str(path), "y", "other")
    replace_section(str(path), "x", "second")
    text = path.read_text()
    assert text.startswith("# title\n\nhand-written\n") and "second" in text and "first" not in text
    assert text.count("BEGIN x") == text.count("END x") == 1 and "other" in text


def test_bench_l8_runs_a_small_workload_and_writes_its_section(tmp_path, capsys):
    bench = load_script("bench_l8")
    md = tmp_path / "benchmarks.md"
    argv = ["--requests", "3", "--prefix-len", "32", "--tail-len", "4", "--max-new-tokens", "2", "--repeat", "1",
            "--skip-0.6b", "--hf-batch-tokens", "64", "--stagger-ms", "1", "--markdown", str(md)]
    assert bench.main(argv) == 0
    text = md.read_text()
    assert "| L8, sharing on | 44 |" in text  # 36, then 4 + 4: the two prefix blocks are computed once
    assert text.count("3/3") >= 9 and "allow_block_sharing True" in text and "page_size 16" in text
    with pytest.raises(SystemExit) as refused:  # refused at the door: one line, exit 2, before any work
        bench.main(["--requests", "0"])
    assert refused.value.code == 2 and "must be at least 1" in capsys.readouterr().err
