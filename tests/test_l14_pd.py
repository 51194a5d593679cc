"""L14's prefill/decode split. In one process first: the receiving side's block plan against the
allocator's own state, and requests prefilled by one engine, moved byte for byte into another pool
under other block ids, decoded there to HF's ids with no prompt token computed. Then for real, two
processes over gloo: torchrun runs the smoke script's two-process form; a rank killed mid-run and
a transfer held back past its deadline end only the requests concerned, within a bounded time."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
import torch

import helpers
from helpers import random_prompt
from l2_paged import OutOfBlocksError
from l5_eviction import WorkItem
from l8_prefix import PrefixBlockAllocator, chain_keys
from l14_kv_transfer import make_offload_engine
from l14_kv_transfer import pd
from probes_l14 import HoldingConnector, signal_rank, torchrun_smoke, use_connector
from test_l14_offload import hf_ids, model  # noqa: F401 - the same fixtures: the tiny model and HF's ids for it

pytestmark = [pytest.mark.l14, pytest.mark.usefixtures("one_torch_thread")]

BS = 4
VOCAB = 512


def allocator_state(alloc: PrefixBlockAllocator) -> tuple:
    return (sorted(alloc.free_blocks), list(alloc.cached_free), list(alloc.ref_count), dict(alloc.key_of))


def keyed_allocator(num_blocks: int, keys: list[bytes], in_use: int) -> tuple[PrefixBlockAllocator, list[int]]:
    """`keys` registered on blocks, the first `in_use` of them still held, the rest cached free."""
    alloc = PrefixBlockAllocator(num_blocks, BS)
    blocks = alloc.alloc_blocks(len(keys))
    for b, k in zip(blocks, keys):
        alloc.register(b, k)
    alloc.free(blocks[in_use:])
    return alloc, blocks


@pytest.mark.points(3)
def test_plan_receive_shares_the_leading_run_it_holds_and_allocates_the_rest():
    keys = chain_keys(random_prompt(6 * BS, VOCAB, seed=1), BS)
    alloc, blocks = keyed_allocator(12, keys[:3], in_use=1)  # blocks of keys 0..2: 0 in use, 1 and 2 cached free
    held, fresh = pd.plan_receive(alloc, keys[:5], 6)  # 5 full blocks and a partial one arriving
    assert held == blocks[:3] and len(fresh) == 3 and not set(fresh) & set(blocks)
    assert [alloc.ref_count[b] for b in held] == [2, 1, 1] and all(alloc.ref_count[b] == 1 for b in fresh)
    assert not set(held) & set(alloc.cached_free) and not set(fresh) & set(alloc.free_blocks)
    alloc.check()
    other = chain_keys([9] + random_prompt(6 * BS - 1, VOCAB, seed=1), BS)  # another first block: no hit at all
    held2, fresh2 = pd.plan_receive(alloc, other[:2], 3)
    assert held2 == [] and len(fresh2) == 3
    alloc.check()
    before = allocator_state(alloc)  # 12 - 6 - 3 = 3 free: 3 held + 4 fresh do not fit
    with pytest.raises(OutOfBlocksError):
        pd.plan_receive(alloc, keys[:5], 7)
    assert allocator_state(alloc) == before


@pytest.mark.points(1)
def test_plan_receive_stops_at_the_first_key_it_lacks_and_never_holds_more_than_arrive():
    keys = chain_keys(random_prompt(4 * BS, VOCAB, seed=2), BS)
    alloc, blocks = keyed_allocator(10, [keys[0], keys[2], keys[3]], in_use=0)  # key 1 missing
    held, fresh = pd.plan_receive(alloc, keys, 4)
    assert held == blocks[:1] and len(fresh) == 3
    alloc2, blocks2 = keyed_allocator(10, keys, in_use=0)
    held2, fresh2 = pd.plan_receive(alloc2, keys, 4)  # all four held: nothing to receive
    assert held2 == blocks2 and fresh2 == []
    alloc2.check()


@pytest.mark.points(2)
def test_plan_receive_is_all_or_nothing_when_the_pool_is_short():
    keys = chain_keys(random_prompt(3 * BS, VOCAB, seed=3), BS)
    alloc, _ = keyed_allocator(5, keys[:2], in_use=0)
    alloc.alloc_blocks(2)  # 2 in use elsewhere; 2 cached free (ours) and 1 free left
    before = allocator_state(alloc)
    with pytest.raises(OutOfBlocksError):
        pd.plan_receive(alloc, keys, 5)  # needs 2 held + 3 fresh, only 1 free
    assert allocator_state(alloc) == before
    alloc.check()


# ---------------------------------------------------------------- one process, two pools

def transfer_in_process(prefill, decode, prompts: list[list[int]], new: int) -> tuple[list, list[int], list]:
    """What the two ranks do, without the wire: prefill each prompt, move its blocks, receive it."""
    connector = HoldingConnector()
    use_connector(prefill, connector)
    prefill.run([WorkItem(p, 1) for p in prompts])
    moved, adopted, tables = [], [], []
    for req in connector.held:
        keys = chain_keys(req.prompt_ids, BS)
        held, fresh = pd.plan_receive(decode.alloc, keys, len(req.blocks))
        payload = pd.pack_blocks(prefill.pool, list(req.blocks)[len(held):])
        header = pd.Header(req.request_id, req.prompt_ids, req.output_ids[0], len(req.blocks), keys, False, new)
        adopted.append(pd.receive(decode, header, held, fresh, payload))
        moved.append(len(fresh))
        tables.append((list(req.blocks), held + fresh))
    connector.released = {r.request_id for r in connector.held}
    prefill.release_finished()
    assert prefill.alloc.num_free == prefill.alloc.num_blocks
    decode.run()
    return adopted, moved, tables


@pytest.mark.points(3)
def test_receive_decodes_hfs_ids_from_blocks_moved_into_other_ids_with_no_prompt_token_computed(model, hf_ids):
    system = random_prompt(3 * BS, VOCAB, seed=7)
    prompts = [system + random_prompt(5 + 3 * i, VOCAB, seed=8 + i) for i in range(3)]
    prefill = make_offload_engine(model, 40, BS)
    decode = make_offload_engine(model, 40, BS)
    decode.alloc.alloc_blocks(5)  # so the decode pool's ids differ from the prefill pool's
    adopted, moved, tables = transfer_in_process(prefill, decode, prompts, 7)
    for req, prompt in zip(adopted, prompts):
        assert tuple(req.output_ids) == hf_ids(tuple(prompt), 7) and req.finish_reason == "length"
    assert decode.summary()["prefill_tokens_computed"] == 0
    sizes = [-(-len(p) // BS) for p in prompts]
    assert moved == [sizes[0], sizes[1] - 3, sizes[2] - 3]  # the system prompt's 3 blocks are held
    assert all(theirs != ours for theirs, ours in tables)  # other ids on the decode side
    assert decode.alloc.lookup(chain_keys(system, BS)) == tables[0][1][:3] == tables[1][1][:3] == tables[2][1][:3]
    s = decode.summary()
    assert s["blocks_free_at_end"] == s["blocks_total"] - 5
    decode.alloc.check()


def test_receive_registers_the_keys_and_a_first_token_that_ends_the_request_ends_it(model, hf_ids):
    prompt = random_prompt(4 * BS + 1, VOCAB, seed=12)
    prefill, decode = make_offload_engine(model, 20, BS), make_offload_engine(model, 20, BS)
    adopted, _, tables = transfer_in_process(prefill, decode, [prompt], 1)  # max_new_tokens 1: done on arrival
    assert adopted[0].output_ids == list(hf_ids(tuple(prompt), 1)) and adopted[0].finish_reason == "length"
    keys = chain_keys(prompt, BS)
    assert decode.alloc.lookup(keys) == tables[0][1][:4]  # cached under their keys for later prompts
    s = decode.summary()
    assert s["blocks_free_at_end"] == s["blocks_total"]


@pytest.mark.points(3)
def test_receive_refuses_a_payload_that_is_not_the_fresh_blocks_and_changes_nothing(model):
    """One block short, one byte long, the right bytes as float32: TransferError, and the pool,
    the allocator and the engine's requests are as before (the caller frees the blocks)."""
    prompt = random_prompt(3 * BS + 2, VOCAB, seed=14)
    prefill, decode = make_offload_engine(model, 20, BS), make_offload_engine(model, 20, BS)
    connector = HoldingConnector()
    use_connector(prefill, connector)
    prefill.run([WorkItem(prompt, 1)])
    req = connector.held[0]
    keys = chain_keys(prompt, BS)
    held, fresh = pd.plan_receive(decode.alloc, keys, len(req.blocks))
    good = pd.pack_blocks(prefill.pool, list(req.blocks))
    header = pd.Header(0, prompt, req.output_ids[0], len(req.blocks), keys, False, 4)
    block_bytes = good.numel() // len(fresh)
    before = [t.clone() for t in decode.pool.K + decode.pool.V], allocator_state(decode.alloc)
    for bad in (good[:-block_bytes], torch.cat([good, good[:1]]), good.view(torch.float32)):
        with pytest.raises(pd.TransferError):
            pd.receive(decode, header, held, fresh, bad)
        assert all(torch.equal(t.view(torch.uint8), b.view(torch.uint8))  # bit for bit: the pool may hold NaN
                   for t, b in zip(decode.pool.K + decode.pool.V, before[0]))
        assert allocator_state(decode.alloc) == before[1] and not decode.requests
    assert pd.receive(decode, header, held, fresh, good).cur_len == len(prompt)


# ---------------------------------------------------------------- two processes

def last_json(text: str):
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


MAX_NEW = 8


def torchrun(argv: list[str]) -> tuple[int, str, dict]:
    done = torchrun_smoke(["--max-new-tokens", str(MAX_NEW), "--json", *argv])
    return done["status"], done["stdout"] + done["stderr"], last_json(done["stdout"])


def equal_hf(report: dict) -> list[bool]:
    """Each request's ids against HF's on the embedded model, computed here: never the run's own
    "match" (under the judge the run is the student's process, which has no HF to compare with)."""
    from harness.smoke import DEFAULT_MODEL

    return [r["ids"] == helpers.hf_ids(DEFAULT_MODEL, r["prompt_ids"], MAX_NEW) for r in report["requests"]]


@pytest.mark.points(2)
def test_two_processes_under_torchrun_equal_hf_and_send_only_the_blocks_the_decode_rank_lacks():
    status, output, report = torchrun([])
    assert status == 0 and report is not None and all(equal_hf(report)), output[-3000:]
    assert len(report["requests"]) == 5 and report["errors"] == 0
    assert report["decode_prefill_tokens_computed"] == 0 and report["all_blocks_free_at_end"]
    assert report["blocks_already_held"] == 4 * 5  # the system prompt's 5 full blocks, after the first request
    per_block = report["bytes_received"] // report["blocks_received"]
    assert report["bytes_received"] == report["blocks_received"] * per_block
    sent = next(line for line in output.splitlines() if line.startswith("rank 0 (prefill)"))
    assert f"bytes_sent {report['bytes_received']}," in sent and f"blocks_sent {report['blocks_received']}," in sent


def test_a_transfer_held_past_its_deadline_ends_only_its_request_and_the_ones_behind_it_pass_it():
    """Request 2's payload is held back past its deadline: it alone ends with an error, and
    requests 3 and 4 are sent, received and decoded meanwhile (neither rank waits for it)."""
    start = time.monotonic()
    status, output, report = torchrun(["--transfer-timeout", "2", "--stall-transfer", "2"])
    assert report is not None, output[-3000:]
    assert report["errors"] == 1 and report["all_blocks_free_at_end"]
    bad = [r for r, equal in zip(report["requests"], equal_hf(report)) if not equal]
    assert len(bad) == 1 and bad[0]["ids"] == [] and len(report["requests"]) == 5
    assert "transfer timed out" in output and time.monotonic() - start < 120
    assert report["received_past_a_late_one"] == 2, report["received_past_a_late_one"]
    sent = re.findall(r"rank 0: sent request (\d)", output)
    assert sent.index("2") > sent.index("4"), sent


def test_a_killed_prefill_rank_ends_what_it_owed_and_the_decode_rank_finishes_the_rest():
    """Ranks started by hand (torchrun would take the decode rank down with the dead one)."""
    run = signal_rank(["--max-new-tokens", str(MAX_NEW), "--json", "--transfer-timeout", "20"],
                      0, signal.SIGKILL, "rank 0: sent request 1")
    assert run["signalled"], "".join(run["prefill_lines"])[-2000:]
    assert run["seconds_after"] < 60, "the decode rank waited for a dead rank"
    report = last_json(run["stdout"])
    assert report is not None and report["all_blocks_free_at_end"], run["stderr"][-2000:]
    verdicts = equal_hf(report)
    finished = [r for r, equal in zip(report["requests"], verdicts) if equal]
    assert len(finished) >= 2 and all(r["ids"] for r in finished)  # requests 0 and 1 were sent before the kill
    lost = [r for r, equal in zip(report["requests"], verdicts) if not equal]
    assert lost and all(r["ids"] == [] for r in lost) and report["errors"] == len(lost)
    assert "lost the prefill rank" in run["stdout"]


def one_error_line(output: str, named: str) -> bool:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    return len(errors) == 1 and named in errors[0] and "Traceback" not in output


# Request 4's payload is held back 5 s: the signal lands while a transfer is still on its way.
WHILE_SENDING = ["--max-new-tokens", str(MAX_NEW), "--json", "--transfer-timeout", "4", "--stall-transfer", "4"]


def test_sigterm_on_the_prefill_rank_mid_transfer_exits_2_with_one_line_and_the_decode_rank_ends_cleanly():
    run = signal_rank(WHILE_SENDING, 0, signal.SIGTERM, "rank 0: sent request 1")
    prefill_output = "".join(run["prefill_lines"])
    assert run["signalled"] and run["prefill_status"] == 2, (run["prefill_status"], prefill_output[-2000:])
    assert one_error_line(prefill_output, "interrupted (SIGTERM)"), prefill_output[-2000:]
    report = last_json(run["stdout"])
    assert run["status"] in (0, 1) and report is not None and report["all_blocks_free_at_end"], run["stderr"][-2000:]
    assert "Traceback" not in run["stderr"] and run["seconds_after"] < 60
    finished = [r for r, equal in zip(report["requests"], equal_hf(report)) if equal]
    assert len(finished) >= 2 and report["errors"] == 5 - len(finished)  # the rest ended, none hangs


def test_sigterm_on_the_decode_rank_mid_transfer_exits_2_with_one_line_and_the_prefill_rank_names_it_lost():
    run = signal_rank(WHILE_SENDING, 1, signal.SIGTERM, "rank 0: sent request 1")
    assert run["signalled"] and run["status"] == 2, (run["status"], run["stderr"][-2000:])
    assert one_error_line(run["stderr"], "interrupted (SIGTERM)"), run["stderr"][-2000:]
    prefill_output = "".join(run["prefill_lines"])
    assert run["prefill_status"] == 2 and one_error_line(prefill_output, "lost the decode rank"), prefill_output[-2000:]
    assert run["seconds_after"] < 60


def test_a_prompt_the_decode_rank_holds_whole_moves_no_block():
    """Two prompts of exactly two full blocks: the second finds both on the decode side, and its
    transfer is the header and the reply only (no empty payload waiting for a receive)."""
    ids = ",".join(str(i) for i in range(100, 132))
    status, output, report = torchrun(["--prompt-ids", ids, "--prompt-ids", ids])
    assert status == 0 and report is not None and all(equal_hf(report)), output[-3000:]
    assert report["blocks_received"] == 2 and report["blocks_already_held"] == 2
    assert report["decode_prefill_tokens_computed"] == 0 and report["all_blocks_free_at_end"]


# ---------------------------------------------------------------- two processes: faults at the door

def torchrun_with_rank1_options(extra: list[str], tmp_path, argv=("--max-new-tokens", "4"),
                                min_step_s: float = 0.0) -> tuple[int, str]:
    """torchrun as above, rank 1 started with `extra` options more than rank 0 (through a wrapper
    script: torchrun gives every rank the same arguments); min_step_s > 0: each of rank 1's engine
    steps takes at least that long (a sleep before it), whatever the machine's speed."""
    from probes_l14 import SMOKE

    wrapper = tmp_path / "rank1_differs.py"
    slow = ("    import time, l5_eviction.engine as e\n    step = e.Engine.step\n"
            f"    e.Engine.step = lambda self: (time.sleep({min_step_s!r}), step(self))[1]\n") if min_step_s else ""
    wrapper.write_text("import os, runpy, sys\n"
                       f"if os.environ.get('RANK') == '1':\n    sys.argv += {extra!r}\n{slow}"
                       f"sys.argv[0] = {str(SMOKE)!r}\n"
                       f"runpy.run_path({str(SMOKE)!r}, run_name='__main__')\n")
    done = torchrun_smoke(list(argv), script=wrapper)
    return done["status"], done["stdout"] + done["stderr"]


def door_errors(output: str, named: str) -> bool:
    """Each rank's error line names the problem, one line per rank; a rank torchrun stopped first
    (it stops the others when one exits) may say that instead."""
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    return (1 <= len(errors) <= 2 and any(named in line for line in errors)
            and all(named in line or "SIGTERM from torchrun" in line for line in errors))


@pytest.mark.parametrize("extra, named", [(["--block-size", "8"], "block_size is 16 on rank 0 and 8 on rank 1"),
                                          (["--dtype", "bfloat16"], "dtype is float32 on rank 0 and bfloat16 on rank 1"),
                                          (["--max-new-tokens", "3"], "max_new_tokens is [4] on rank 0 and [3] on rank 1")])
def test_ranks_started_differently_both_stop_with_one_line_naming_the_difference(extra, named, tmp_path):
    status, output = torchrun_with_rank1_options(extra, tmp_path)
    assert status != 0 and door_errors(output, named), output[-3000:]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", output)
    # bad input on both ranks, not a crash (one that already said so may be stopped by torchrun as it exits)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    ours = output.split("torch/distributed/elastic")[0]  # what the ranks printed before torchrun's report
    assert "Traceback" not in ours, ours[-3000:]


def test_a_short_transfer_timeout_does_not_cut_start_up_short():
    """gloo's timeout is the start-up's (generous), not the transfer's: 0.3 s once ended start-up
    with DistStoreError while a rank was still loading its model."""
    status, output, report = torchrun(["--transfer-timeout", "0.3"])
    assert report is not None and "DistStoreError" not in output, output[-3000:]
    assert len(report["requests"]) == 5 and report["all_blocks_free_at_end"]


def test_a_stalled_transfer_that_names_no_request_is_bad_input():
    status, output, _ = torchrun(["--stall-transfer", "99"])
    assert status != 0 and door_errors(output, "--stall-transfer 99: the run has requests 0 to 4"), output[-3000:]


def test_a_decode_pool_full_for_ten_transfer_timeouts_is_backpressure_and_loses_no_request(tmp_path):
    """Three prompts of 140 tokens (9 blocks), nothing shared, 120 new tokens; rank 1's pool (17
    blocks) holds one request at its longest, and never two prompts: each request after the first
    is told "not now" until the one decoding finishes, about 120 steps of at least 10 ms (rank 1's
    steps are slowed so on any machine), far longer than ten transfer timeouts. The prefill rank
    keeps their blocks and asks again; every request still equals HF's ids, none is lost, no block
    leaks."""
    timeout, new = 0.05, 120
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(140)] for i in range(3)]
    argv = ["--max-new-tokens", str(new), "--transfer-timeout", str(timeout), "--json"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    status, output = torchrun_with_rank1_options(["--num-blocks", "17"], tmp_path, argv, min_step_s=0.01)
    report = last_json(output)
    assert status == 0 and report is not None, output[-3000:]
    assert report["errors"] == 0 and report["all_blocks_free_at_end"] and report["not_now_replies"] > 0
    assert report["longest_wait_for_room_s"] >= 10 * timeout, report["longest_wait_for_room_s"]
    from harness.smoke import DEFAULT_MODEL
    assert all(r["ids"] == helpers.hf_ids(DEFAULT_MODEL, r["prompt_ids"], new) for r in report["requests"])
