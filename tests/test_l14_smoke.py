"""L14: the smoke script follows the contract in its one-process form: second turns that come back
after other traffic PASS against HF with every tier setting and with the tier off; the tier turns
recomputed prompt tokens into loaded ones, bytes as counted; bad input exits 2 with one line. (The
two-process form is run by tests/test_l14_pd.py under torchrun.)"""

from __future__ import annotations

import pytest

from helpers import run_script_json

pytestmark = [pytest.mark.l14, pytest.mark.usefixtures("one_torch_thread")]


def test_default_run_loads_the_second_turns_prefixes_from_the_tiers_and_passes(capsys):
    status, on, _ = run_script_json("l14_smoke", ["--max-new-tokens", "12"], capsys)
    assert status == 0 and on["match"] is True and len(on["requests"]) == 12  # 4 turns 1, 4 traffic, 4 turns 2
    assert on["tier"] == "cpu+file" and on["tokens_loaded"] > 0 and on["file_blocks_loaded"] > 0
    assert on["bytes_loaded"] == on["blocks_loaded"] * on["bytes_per_block"]
    assert on["bytes_saved"] == on["blocks_saved"] * on["bytes_per_block"]
    assert on["all_blocks_free_at_end"]
    status, off, _ = run_script_json("l14_smoke", ["--max-new-tokens", "12", "--tier", "off"], capsys)
    assert status == 0 and off["match"] is True and off.get("tokens_loaded", 0) == 0
    assert off["prefill_tokens_computed"] - on["prefill_tokens_computed"] == on["tokens_loaded"]


@pytest.mark.parametrize("argv", [["--tier", "cpu", "--cpu-blocks", "64"], ["--tier", "file", "--offload-mode", "write-back"],
                                  ["--tier", "cpu+file", "--cpu-blocks", "0", "--prefill-chunk", "32"]])
def test_every_tier_setting_passes(capsys, argv, tmp_path):
    status, report, _ = run_script_json("l14_smoke", ["--max-new-tokens", "6", "--tier-dir", str(tmp_path / "t"),
                                                      *argv], capsys)
    assert status == 0 and report["match"] is True and report["tokens_loaded"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--cpu-blocks", "-1"], "must be at least 0"),
    (["--block-size", "0"], "must be at least 1"),
    (["--transfer-timeout", "0"], "positive number of seconds"),
    (["--tier", "disk"], "invalid choice"),
    (["--num-blocks", "2"], "give the pool more blocks"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, message):
    status, report, err = run_script_json("l14_smoke", argv + ["--max-new-tokens", "2"], capsys)
    assert status == 2 and report is None
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_tier_folder_that_is_a_file_is_bad_input(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    status, _, err = run_script_json("l14_smoke", ["--tier-dir", str(tmp_path / "f"), "--max-new-tokens", "2"], capsys)
    assert status == 2 and "is a file" in err


def smoke_in_a_new_process(argv: list[str]) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "l14_smoke.py"), "--json", *argv],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def test_a_second_run_on_a_persistent_tier_dir_loads_the_first_runs_blocks_and_survives_damaged_ones(tmp_path):
    """Three processes, one --tier-dir: the second finds the first's blocks at start and loads more
    of them than the first could (its turns 1 too); before the third, five block files are zeroed
    (their headers intact): it recomputes those, loads the rest, and still PASSes."""
    argv = ["--tier", "file", "--tier-dir", str(tmp_path), "--max-new-tokens", "2"]
    first, second = smoke_in_a_new_process(argv), smoke_in_a_new_process(argv)
    assert first["match"] is True and second["match"] is True and first["file_blocks_found_at_open"] == 0
    assert second["file_blocks_found_at_open"] > 0 and second["tokens_loaded"] > first["tokens_loaded"]
    assert second["prefill_tokens_computed"] < first["prefill_tokens_computed"]
    for path in sorted(tmp_path.glob("*.kv"))[:5]:
        header, _, payload = path.read_bytes().partition(b"\n")
        path.write_bytes(header + b"\n" + bytes(len(payload)))
    third = smoke_in_a_new_process(argv)
    assert third["match"] is True and third["block_load_errors"] > 0
    assert third["tokens_recomputed_after_failed_loads"] > 0 and third["tokens_loaded"] > 0
