"""L11: the smoke script follows the contract: a real HTTP client's ids equal HF's, texts equal the
decoded ids, every block free after; bad input exits 2 with one line."""

from __future__ import annotations

import pytest

from helpers import run_script_json

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.points(2)
def test_default_run_passes_over_http(capsys):
    status, report, _ = run_script_json("l11_smoke", [], capsys)
    assert status == 0 and report["match"] is True
    assert (report["lesson"], report["device"], report["dtype"]) == ("L11", "cpu", "float32")
    assert len(report["requests"]) == 3
    for row in report["requests"]:
        assert row["ids"] == row["hf_ids"] and len(row["ids"]) == 20 and row["first_mismatch"] is None
    assert report["texts_equal_decoded_ids"] and report["all_blocks_free_at_end"]
    assert report["blocks_used_after"] == 0 and report["url_host"] == "127.0.0.1"
    # Three requests of 20 tokens sent at once: continuous batching runs them together, not one after another.
    assert report["engine_steps"] < 2 * 20


@pytest.mark.parametrize("argv, words", [
    (["--num-blocks", "0"], "at least 1"),
    (["--model", "/no/such/folder"], "does not exist"),
    (["--prompt-ids", "1,2", "--num-blocks", "1", "--block-size", "4"], "blocks"),  # 2 + 20 tokens: 6 blocks
])
def test_bad_input_exits_2_with_one_line(capsys, argv, words):
    status, report, err = run_script_json("l11_smoke", argv, capsys)
    assert status == 2 and report is None
    assert words in err and err.strip().count("\n") == 0
