"""L11: the smoke script follows the contract: a real HTTP client's ids equal HF's, texts equal the
decoded ids, every block free after; bad input exits 2 with one line."""

from __future__ import annotations

import pytest

from helpers import run_script_json
from probes_l11 import hold_the_first_loop_until_queued, release_loop_start

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.points(2)
def test_default_run_passes_over_http(capsys):
    hold_the_first_loop_until_queued(3)  # the loop the smoke script builds waits for its 3 requests
    try:
        status, report, _ = run_script_json("l11_smoke", [], capsys)
    finally:
        held = release_loop_start()
    assert status == 0 and report["match"] is True
    assert (report["lesson"], report["device"], report["dtype"]) == ("L11", "cpu", "float32")
    assert len(report["requests"]) == 3
    for row in report["requests"]:
        assert row["ids"] == row["hf_ids"] and len(row["ids"]) == 20 and row["first_mismatch"] is None
    assert report["texts_equal_decoded_ids"] and report["all_blocks_free_at_end"]
    assert report["blocks_used_after"] == 0 and report["url_host"] == "127.0.0.1"
    # Three requests of 20 tokens, all queued before the first step (held, so the machine's load
    # cannot spread their arrivals): continuous batching runs them together, one prefill step and
    # 19 decode steps, not one request after another (about 60).
    assert held and report["engine_steps"] <= 21, report["engine_steps"]


@pytest.mark.parametrize("argv, words", [
    (["--num-blocks", "0"], "at least 1"),
    (["--model", "/no/such/folder"], "does not exist"),
    (["--prompt-ids", "1,2", "--num-blocks", "1", "--block-size", "4"], "blocks"),  # 2 + 20 tokens: 6 blocks
])
def test_bad_input_exits_2_with_one_line(capsys, argv, words):
    status, report, err = run_script_json("l11_smoke", argv, capsys)
    assert status == 2 and report is None
    assert words in err and err.strip().count("\n") == 0
