"""L12: the smoke script follows the contract: fp8 and int8 pools PASS against the quantizing
oracle (with preemption by swap, and with sharing off), the accuracy figures are reported, and bad
input exits 2 with a one-line message."""

from __future__ import annotations

import pytest

from helpers import run_script_json

pytestmark = [pytest.mark.l12, pytest.mark.usefixtures("one_torch_thread")]


def test_default_run_passes_and_reports_the_accuracy_cost(capsys):
    status, report, _ = run_script_json("l12_smoke", ["--max-new-tokens", "12"], capsys)
    assert status == 0 and report["match"] is True
    assert (report["lesson"], report["kv_format"], report["scales"]) == ("L12", "fp8", "head")
    assert all(row["ids"] == row["hf_ids"] for row in report["requests"]) and len(report["requests"]) == 7
    assert report["all_blocks_free_at_end"] and report["prefix_hit_tokens"] > 0
    cost = report["accuracy_vs_float32"]
    assert cost["positions"] > 500 and 0.9 < cost["top1_agreement"] < 1 and 0 < cost["kl_mean"] < 0.01


def test_int8_with_preemption_by_swap_passes(capsys):
    status, report, _ = run_script_json("l12_smoke", ["--kv-format", "int8", "--scales", "tensor", "--num-blocks", "12",
                                                      "--preempt", "swap", "--no-accuracy"], capsys)
    assert status == 0 and report["match"] is True
    assert report["preempted_swap"] > 0 and report["all_blocks_free_at_end"]
    assert "accuracy_vs_float32" not in report


def test_sharing_off_passes(capsys):
    status, report, _ = run_script_json("l12_smoke", ["--prefix-sharing", "off", "--max-new-tokens", "8",
                                                      "--no-accuracy"], capsys)
    assert status == 0 and report["match"] is True and report["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--kv-format", "fp4"], "invalid choice"),
    (["--scales", "channel"], "invalid choice"),
    (["--block-size", "0"], "must be at least 1"),
    (["--num-blocks", "1"], "raise --num-blocks"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, message):
    status, report, err = run_script_json("l12_smoke", argv + ["--max-new-tokens", "2", "--no-accuracy"], capsys)
    assert status == 2 and report is None
    assert message in err and len(err.strip().splitlines()) == 1
