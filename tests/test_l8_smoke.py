"""L8: the smoke script follows the contract and reports the sharing counters, sharing on and off."""

from __future__ import annotations

import pytest

from helpers import random_prompt, run_script_json

pytestmark = [pytest.mark.l8, pytest.mark.usefixtures("one_torch_thread")]

COUNTERS = ["memory_utilization", "peak_memory_utilization", "sharing_ratio", "peak_sharing_ratio",
            "prefix_hit_tokens", "hit_rate", "prefill_tokens_computed", "prefill_tokens_total",
            "prefill_tokens_needed", "blocks_saved", "peak_blocks_saved", "cached_blocks_evicted",
            "shared_blocks_now", "peak_shared_blocks", "cow_copies", "fork_shared_tokens",
            "blocks_free_at_end", "blocks_total", "preemptions"]


@pytest.mark.points(4)
def test_default_run_passes_with_sharing_on_and_off_with_the_counters(capsys):
    reports = {}
    for mode in ("on", "off"):
        status, report, _ = run_script_json("l8_smoke", ["--prefix-sharing", mode], capsys)
        assert status == 0 and report["match"] is True, mode
        assert (report["lesson"], report["device"], report["dtype"]) == ("L8", "cpu", "float32")
        assert not set(COUNTERS) - set(report), set(COUNTERS) - set(report)
        rows = report["requests"]
        assert len(rows) == report["requests_and_samples"] == 7  # 4 prompts + 3 samples of a fifth
        for row in rows:
            assert row["ids"] == row["hf_ids"] and row["first_mismatch"] is None and row["ids"]
        assert sum("of 3" in row["label"] for row in rows) == 3
        head = rows[0]["prompt_ids"][:64]
        assert all(row["prompt_ids"][:64] == head for row in rows)  # one long shared prefix
        assert report["blocks_free_at_end"] == report["blocks_total"] and report["all_blocks_free_at_end"]
        assert report["preemptions"] == 0 and report["shared_blocks_now"] == 0  # default pool: enough
        reports[mode] = report
    on, off = reports["on"], reports["off"]
    assert [r["ids"] for r in on["requests"]] == [r["ids"] for r in off["requests"]]
    assert on["prefill_tokens_needed"] == off["prefill_tokens_needed"] == off["prefill_tokens_computed"]
    assert off["prefix_hit_tokens"] == off["cow_copies"] == off["peak_shared_blocks"] == 0
    # Four later arrivals each find the system prompt's 5 full blocks (80 tokens) cached; the other
    # two samples get the whole prompt from their parent; the two forks copy its partial block.
    assert on["prefix_hit_tokens"] == 4 * 80 and on["cow_copies"] == 2
    assert on["fork_shared_tokens"] == 2 * len(on["requests"][-1]["prompt_ids"])
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"] / 3
    assert on["peak_shared_blocks"] >= 5 and on["peak_blocks_saved"] >= 20 and on["peak_sharing_ratio"] > 2
    assert on["blocks_peak_used"] < off["blocks_peak_used"] / 2


def ids_arg(ids: list[int]) -> str:
    return ",".join(map(str, ids))


PREFIX = random_prompt(22, 512, seed=4)  # as in test_l8_engine: HF's top-2 gaps are not near ties
PROMPTS = [PREFIX + random_prompt(5, 512, seed=105), PREFIX + random_prompt(3, 512, seed=103)]


@pytest.mark.points(2)
@pytest.mark.parametrize("num_blocks,preempted", [(None, False), (9, True)])
def test_prompt_ids_with_n_samples_and_a_small_pool(tiny_model_dir, capsys, num_blocks, preempted):
    argv = ["--model", str(tiny_model_dir), "--prompt-ids", ids_arg(PROMPTS[0]), "--prompt-ids", ids_arg(PROMPTS[1]),
            "--n", "2", "--block-size", "4", "--max-new-tokens", "6"]
    argv += ["--num-blocks", str(num_blocks)] if num_blocks else []
    status, report, _ = run_script_json("l8_smoke", argv, capsys)
    assert status == 0 and report["match"] is True
    assert [r["prompt_ids"] for r in report["requests"]] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert report["requests_and_samples"] == 4 and report["blocks_free_at_end"] == report["blocks_total"]
    assert (report["preemptions"] > 0) == preempted
    if not preempted:
        assert report["prefix_hit_tokens"] == 20 and report["cow_copies"] == 2  # 27 and 25 tokens: partial tails
        assert report["fork_shared_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])


BAD_INPUT = {
    "no samples": (["--n", "0"], "--n"),
    "negative samples": (["--n", "-2"], "--n"),
    "zero block size": (["--block-size", "0"], "--block-size"),
    "pool too small": (["--num-blocks", "1"], "--num-blocks"),
    "unknown sharing mode": (["--prefix-sharing", "maybe"], "invalid choice"),
    "unknown preemption": (["--preempt", "later"], "invalid choice"),
    "samples not a number": (["--n", "x"], "invalid int"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gives_one_line_and_exit_2(case, tiny_model_dir, capsys):
    argv, fragment = BAD_INPUT[case]
    try:
        status, _, err = run_script_json("l8_smoke", ["--model", str(tiny_model_dir), *argv], capsys)
    except SystemExit as exc:  # argparse rejects before the run starts
        status, err = exc.code, capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err


@pytest.mark.points(1)
def test_keys_without_the_chain_make_a_mismatch_and_exit_1(tiny_model_dir, capsys, monkeypatch):
    """Hash each block alone (no parent): block Y of 'X Y Z' then matches a prompt starting with Y."""
    import l8_prefix.block_hash as bh
    import l8_prefix.kv_manager as eng

    real = bh.block_key
    monkeypatch.setattr(bh, "block_key", lambda parent, tokens: real(None, tokens))
    monkeypatch.setattr(eng, "block_key", lambda parent, tokens: real(None, tokens))
    x, y, z = (random_prompt(4, 512, seed) for seed in (31, 32, 33))
    status, report, _ = run_script_json(
        "l8_smoke", ["--model", str(tiny_model_dir), "--prompt-ids", ids_arg(x + y + z),
                     "--prompt-ids", ids_arg(y + z + x[:2]), "--block-size", "4", "--max-new-tokens", "6"], capsys)
    assert status == 1 and report["match"] is False
    assert report["requests"][0]["match"] and not report["requests"][1]["match"]
    assert report["prefix_hit_tokens"] == 8  # Y and Z "found", at positions 4..11 instead of 0..7
