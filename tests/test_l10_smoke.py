"""L10: the smoke script follows the contract: both drafters PASS on the embedded model with their
acceptance and forwards per token, and bad input exits 2 with a one-line message."""

from __future__ import annotations

import pytest

from helpers import run_script_json

pytestmark = [pytest.mark.l10, pytest.mark.usefixtures("one_torch_thread")]


def test_default_run_passes_with_both_drafters(capsys):
    status, report, _ = run_script_json("l10_smoke", [], capsys)
    assert status == 0 and report["match"] is True
    assert (report["lesson"], report["device"], report["dtype"]) == ("L10", "cpu", "float32")
    rows = report["requests"]
    assert len(rows) == 6 and all(row["ids"] == row["hf_ids"] for row in rows)
    for name in ("prompt-lookup", "draft-model"):
        figures = report[name]
        assert figures["proposed"] > 0 and 0 < figures["acceptance_rate"] <= 1
        assert figures["forwards_per_token"] < 1, f"{name}: speculation saved no forward"
        assert figures["all_blocks_free_at_end"]
    assert report["draft-model"]["draft_blocks_free_at_end"]


@pytest.mark.parametrize("argv, message", [
    (["--k", "0"], "--k must be in 1..16"),
    (["--draft-model", "/nonexistent"], "is not a folder"),
    (["--block-size", "0"], "must be at least 1"),
    (["--block-size", "4", "--num-blocks", "1"], "raise --num-blocks"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, message):
    status, report, err = run_script_json("l10_smoke", argv + ["--max-new-tokens", "2"], capsys)
    assert status == 2 and report is None
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_model_without_a_draft_runs_prompt_lookup_and_refuses_draft_model(tiny_model_dir, capsys):
    ids = ",".join(map(str, [5, 6, 7, 5, 6, 7, 5, 6]))
    status, report, _ = run_script_json("l10_smoke", ["--model", str(tiny_model_dir), "--prompt-ids", ids,
                                                      "--max-new-tokens", "8"], capsys)
    assert status == 0 and "prompt-lookup" in report and "draft-model" not in report
    status, _, err = run_script_json("l10_smoke", ["--model", str(tiny_model_dir), "--prompt-ids", ids,
                                                   "--drafter", "draft-model"], capsys)
    assert status == 2 and "needs --draft-model" in err


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, make_model, capsys):
    other = make_model(seed=1, vocab_size=300)
    status, _, err = run_script_json("l10_smoke", ["--model", str(tiny_model_dir), "--draft-model", str(other),
                                                   "--prompt-ids", "1,2,3", "--max-new-tokens", "2"], capsys)
    assert status == 2 and "share its target's tokenizer" in err and len(err.strip().splitlines()) == 1
