"""bench_peer.py and harness/llama_peer.py: the engine beside llama.cpp and HF.

llama.cpp is optional (`make peer`): without it the benchmark still runs the engine and HF and
says, in the llama.cpp rows, why they are missing; with it (where installed), its F32 run must
give HF's ids, the check that the converter, the peer's step loop and its greedy pick are right.
"""

from __future__ import annotations

import pytest

from harness import llama_peer
from harness.smoke import DEFAULT_MODEL
from helpers import hf_ids, load_script, random_prompt
from l5_eviction import WorkItem

pytestmark = [pytest.mark.l5]


def test_bench_peer_runs_the_engine_and_hf_and_says_why_llama_cpp_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_peer, "available", lambda: "llama-cpp-python is not installed (test)")
    bench = load_script("bench_peer")
    doc = tmp_path / "b.md"
    assert bench.main(["--requests", "4", "--new", "4", "--repeat", "1", "--markdown", str(doc)]) == 0
    text = doc.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| L5 engine | " in text and "4/4" in rows["L5 engine"]  # the engine's ids are HF's, both workloads
    assert "not run: llama-cpp-python is not installed (test)" in rows["llama.cpp F32 (KV f32)"]
    cells = [c.strip() for c in rows["L5 engine"].strip("|").split("|")]
    values = dict(zip(bench.COLUMNS, cells))
    assert float(values["mixed tok/s"]) > 0 and float(values["batch-1 tok/s"]) > 0 and values["batch-1 ids = HF"] == "True"


def test_a_missing_converter_says_how_to_get_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="make peer"):
        llama_peer.convert(DEFAULT_MODEL, tmp_path / "m.gguf", "f32", llama_cpp_dir=tmp_path)


@pytest.mark.skipif(llama_peer.available() is not None or not (llama_peer.DEFAULT_LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp is not installed here (make peer)")
def test_llama_cpp_in_f32_gives_hfs_ids_stepped_like_the_engine(tmp_path):
    items = [WorkItem(random_prompt(n, 4096, seed=n), m) for n, m in ((5, 6), (40, 3), (300, 4))]
    gguf = llama_peer.convert(DEFAULT_MODEL, tmp_path / "m.gguf", "f32")
    peer = llama_peer.LlamaCppPeer(gguf, kv="f32", threads=1, n_ctx=1024, n_seq=2)
    try:
        outs, seconds = peer.serve(items, prefill_chunk=64)  # two sequences at most: the third waits
        alone, alone_s = peer.decode_alone(items[0].prompt_ids, 6)
    finally:
        peer.close()
    assert outs == [hf_ids(DEFAULT_MODEL, w.prompt_ids, w.max_new_tokens) for w in items]
    assert alone == outs[0] and seconds > 0 and alone_s > 0
