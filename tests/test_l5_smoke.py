"""L5: the smoke script follows the contract (COURSE.md) and reports its memory figures."""

from __future__ import annotations

import pytest

from helpers import random_prompt, run_script_json

pytestmark = [pytest.mark.l5, pytest.mark.usefixtures("one_torch_thread")]



def check_figures(report) -> None:
    assert report["lesson"] == "L5" and report["match"] is True
    for row in report["requests"]:
        assert row["ids"] == row["hf_ids"] and row["first_mismatch"] is None
    assert report["blocks_free_at_end"] == report["blocks_total"]
    assert report["swapped_copies_left"] == 0
    assert report["preemptions"] == report["preempted_recompute"] + report["preempted_swap"]
    assert report["blocks_peak_used"] <= report["blocks_total"]


@pytest.mark.points(3)
def test_default_run_preempts_and_passes(capsys):
    status, report, _ = run_script_json("l5_smoke", [], capsys)
    assert status == 0
    check_figures(report)
    assert len(report["requests"]) >= 8
    assert report["blocks_total"] <= report["blocks_demanded"] // 3  # about a quarter
    assert report["preempt_mode"] == "recompute" and report["preempted_recompute"] > 0
    assert report["tokens_recomputed"] > 0


@pytest.mark.points(2)
def test_swap_mode_passes_and_copies_back_what_it_copied_out(capsys):
    status, report, _ = run_script_json("l5_smoke", ["--preempt", "swap"], capsys)
    assert status == 0
    check_figures(report)
    assert report["preempt_mode"] == "swap" and report["preempted_swap"] > 0
    assert report["bytes_swapped_out"] == report["bytes_swapped_in"] > 0


def tiny_args(model_dir, *extra):
    prompts = [",".join(map(str, random_prompt(n, 512, 30 + n))) for n in (3, 9, 14, 20, 6)]
    return (["--model", str(model_dir), "--max-new-tokens", "8", "--block-size", "4"]
            + [a for p in prompts for a in ("--prompt-ids", p)] + list(extra))


@pytest.mark.points(2)
@pytest.mark.parametrize("options", [["--policy", "score", "--prefill-chunk", "3"],
                                     ["--policy", "priority", "--preempt", "swap", "--num-blocks", "8"]],
                         ids=["score-chunked", "priority-swap"])
def test_lesson_options_on_a_random_model(options, tiny_model_dir, capsys):
    status, report, _ = run_script_json("l5_smoke", tiny_args(tiny_model_dir, *options), capsys)
    assert status == 0
    check_figures(report)
    assert report["policy"] == options[1] and report["block_size"] == 4 and report["preemptions"] > 0
    if "--num-blocks" in options:
        assert report["blocks_total"] == 8


@pytest.mark.points(1)
def test_a_broken_swap_in_is_caught_with_exit_1(tiny_model_dir, capsys, monkeypatch):
    """Swap-in that allocates blocks but forgets to copy the K/V back: stale cache, wrong ids."""
    from l2_paged import reserve
    from l5_eviction import Preemptor, State

    def swap_in_without_copy(self, req):
        reserve(req, self.alloc, req.cur_len)
        req.swapped, req.state = None, State.RUNNING

    monkeypatch.setattr(Preemptor, "swap_in", swap_in_without_copy)
    status, report, _ = run_script_json("l5_smoke", tiny_args(tiny_model_dir, "--preempt", "swap"), capsys)
    assert status == 1 and report["match"] is False and report["preempted_swap"] > 0
    assert any(row["first_mismatch"] is not None for row in report["requests"])


BAD_INPUT = {
    "zero block size": (["--block-size", "0"], "--block-size must be at least 1"),
    "zero blocks": (["--num-blocks", "0"], "--num-blocks must be at least 1"),
    "pool below the largest request": (["--num-blocks", "1"], "cannot hold the largest request"),
    "zero prefill chunk": (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1"),
    "negative prefill chunk": (["--prefill-chunk", "-3"], "--prefill-chunk must be at least 1"),
    "unknown policy": (["--policy", "fifo"], "invalid choice"),
    "unknown preempt mode": (["--preempt", "drop"], "invalid choice"),
    "not a number": (["--num-blocks", "many"], "invalid int value"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gives_one_line_and_exit_2(case, tiny_model_dir, capsys):
    argv, fragment = BAD_INPUT[case]
    try:
        status, _, err = run_script_json("l5_smoke", ["--model", str(tiny_model_dir)] + argv, capsys)
    except SystemExit as exc:  # argparse rejects before the run starts
        status, err = exc.code, capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err
