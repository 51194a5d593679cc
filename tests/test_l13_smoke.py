"""L13: the smoke script follows the contract: the embedded model as a hybrid and a random hybrid
folder PASS against HF (with a pool small enough to preempt, by recompute and by swap), the window
bound and the pool's figures are reported, and bad input exits 2 with a one-line message."""

from __future__ import annotations

import pytest

from helpers import load_script, run_script_json
from test_l3_kernel import needs_compiler

pytestmark = [pytest.mark.l13, pytest.mark.usefixtures("one_torch_thread")]


def test_default_run_is_the_embedded_model_as_a_hybrid_and_passes(capsys):
    status, report, _ = run_script_json("l13_smoke", ["--max-new-tokens", "12"], capsys)
    assert status == 0 and report["match"] is True and len(report["requests"]) == 8  # two turns of four
    assert report["sliding_layers"] == [0, 2] and report["sliding_windows"] == [64]
    assert report["kv_cache_groups"] == 2 and report["layers_per_group"] == 2
    assert report["decode_window_blocks_peak"] <= report["decode_window_block_bound"] == 64 // 16 + 1
    assert report["all_blocks_free_at_end"] and report["preempted_recompute"] == 0
    assert report["prefix_hit_tokens"] > 0 and report["hit_rule"] == "hybrid"


def test_the_all_blocks_rule_finds_less_and_sharing_off_nothing(capsys):
    runs = {}
    for argv in (["--hit-rule", "all-blocks"], ["--prefix-sharing", "off"], []):
        status, report, _ = run_script_json("l13_smoke", ["--max-new-tokens", "12", *argv], capsys)
        assert status == 0 and report["match"] is True
        runs[" ".join(argv)] = report["prefix_hit_tokens"]
    assert runs["--prefix-sharing off"] == 0 < runs["--hit-rule all-blocks"] < runs[""]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_small_pool_preempts_and_still_passes(capsys, mode):
    status, report, _ = run_script_json("l13_smoke", ["--max-new-tokens", "12", "--num-blocks", "24",
                                                      "--prefill-chunk", "32", "--preempt", mode], capsys)
    assert status == 0 and report["match"] is True
    assert report[f"preempted_{mode}"] > 0 and report["all_blocks_free_at_end"]


@pytest.mark.parametrize("backend", ["reference", pytest.param("emulated", marks=needs_compiler)])
def test_sliding_decodes_equal_hf_on_every_cpu_backend(capsys, backend):
    """The window through L4's reference and through its CUDA kernel's own code (the default, cpu,
    is the runs above; the kernel itself runs in scripts/gpu_checks.sh)."""
    status, report, _ = run_script_json("l13_smoke", ["--max-new-tokens", "12", "--backend", backend], capsys)
    assert status == 0 and report["match"] is True and report["backend"] == backend
    assert report["decode_window_blocks_peak"] <= report["decode_window_block_bound"]


def test_a_random_hybrid_folder_runs_as_it_is(capsys, make_model):
    model_dir = make_model(seed=5, num_hidden_layers=6, use_sliding_window=True, sliding_window=12,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    status, report, _ = run_script_json("l13_smoke", ["--model", str(model_dir), "--prompt-ids", ",".join(map(str, range(3, 50))),
                                                      "--prompt-ids", "7,8,9", "--max-new-tokens", "20",
                                                      "--block-size", "4"], capsys)
    assert status == 0 and report["match"] is True
    assert report["sliding_layers"] == [0, 1, 3, 4] and report["kv_cache_groups"] == 3


def test_a_layout_whose_groups_are_short_pads_them_and_still_passes(capsys, make_model):
    """3 sliding + 2 full layers: groups of 2 (the smaller kind), so the sliding kind is two groups
    of 2 and 1 layer, and a block has one layer slot that group never writes."""
    model_dir = make_model(seed=6, num_hidden_layers=5, use_sliding_window=True, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"])
    status, report, _ = run_script_json("l13_smoke", ["--model", str(model_dir), "--prompt-ids", ",".join(map(str, range(3, 40))),
                                                      "--max-new-tokens", "16", "--block-size", "4"], capsys)
    assert status == 0 and report["match"] is True
    assert report["kv_cache_groups"] == 3 and report["layers_per_group"] == 2 and report["padding_layer_slots"] == 1


def test_the_teacher_forced_rerun_sends_the_first_runs_second_turns():
    """In bf16 a first turn can leave HF's path at a near-tie; the rerun then forces HF's ids there,
    and a second turn built from them would be a prompt the comparison never asked about (on an
    H200 that failed two requests with "new token 0 was never computed"). Here every first turn is
    forced off our path after its first new token: each second turn must still get every row."""
    from harness.forcing import ForcedPaths
    from harness.smoke import make_parser, resolve, rerun_forced

    module = load_script("l13_smoke")
    parser = make_parser(module.LESSON, module.__doc__)
    module.add_options(parser)
    args = parser.parse_args(["--max-new-tokens", "6"])
    setup = resolve(args)
    first = module.run(args, setup).requests
    turn_one, turn_two = first[:len(first) // 2], first[len(first) // 2:]
    other = {r.ids[1]: r.ids[1] + 1 for r in turn_one}  # an id that is not ours
    paths = {tuple(r.prompt_ids): r.ids[:1] + [other[r.ids[1]]] + r.ids[2:] for r in turn_one}
    paths.update({tuple(r.prompt_ids): r.ids for r in turn_two})
    forced = rerun_forced(module.run)(args, setup, ForcedPaths(paths))
    for r in turn_two:
        assert all(forced.logits(r.prompt_ids)), r.label


@pytest.mark.parametrize("argv, message", [
    (["--window", "0"], "--window must be at least 1"),
    (["--sliding-layers", "0,9"], "--sliding-layers must name layers from 0 to 3"),
    (["--sliding-layers", "a"], "--sliding-layers takes layer numbers"),
    (["--num-blocks", "3"], "needs"),
    (["--turns", "3"], "invalid choice"),
    (["--block-size", "0"], "--block-size must be at least 1"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    status, report, err = run_script_json("l13_smoke", argv, capsys)
    assert status == 2 and report is None
    assert message in err and len(err.strip().splitlines()) == 1, err
