"""L14's offload tier in the engine: the connector's scheduler-side answers against keys computed
here from the tokens, the step's loads and saves, and whole workloads whose second turns come back
after other traffic evicted their blocks: ids equal HF's with the tier on and off, every loaded
block equal bit for bit to what was stored, bytes moved = blocks x bytes per block."""

from __future__ import annotations

import functools

import pytest
import torch

from harness import hf_reference as hf
from helpers import random_prompt
from l1_contiguous import InputError
from l2_paged import bytes_per_block
from l5_eviction import WorkItem, load_engine_model
from l8_prefix import chain_keys, make_prefix_engine
from l14_kv_transfer import CpuTier, FileTier, OffloadConnector, TieredStore, kv_identity, make_offload_engine, make_store
from probes_l14 import RecordingConnector, connector_state, fail_next_forward, fake_request, use_connector
from test_l14_tiers import FAULTS, damage, tier_dir  # noqa: F401 - a folder the student's code may write

pytestmark = [pytest.mark.l14, pytest.mark.usefixtures("one_torch_thread")]

BS = 4
VOCAB = 512  # harness.tiny_models.TINY


def dummy_store(keys: list[bytes], tiers: int = 1) -> TieredStore:
    store = TieredStore([CpuTier(64) for _ in range(tiers)])
    for k in keys:
        store.save(k, torch.zeros(1))
    return store


# ---------------------------------------------------------------- the scheduler side

@pytest.mark.points(4)
def test_matched_tokens_continue_the_devices_run_stop_at_a_gap_and_never_reach_the_last_token():
    tokens = random_prompt(6 * BS + 2, VOCAB, seed=1)  # 6 full blocks and 2 more tokens
    keys = chain_keys(tokens, BS)
    store = dummy_store([keys[i] for i in (0, 1, 2, 3, 5)])  # block 4 is missing
    conn = OffloadConnector(store, BS)
    req = fake_request(tokens)

    def expect(conn, req, device_tokens, want, rule):
        got = conn.get_num_new_matched_tokens(req, device_tokens)
        assert got == want, (f"get_num_new_matched_tokens(req, {device_tokens}) with blocks of {BS} tokens "
                             f"returned {got}, expected {want}: {rule}")

    stored = "the store holds blocks 0, 1, 2, 3 and 5 of a 6-block prompt (plus 2 tokens)"
    expect(conn, req, 0, 4 * BS, f"{stored}; the run from block 0 stops at the first block it lacks (4)")
    expect(conn, req, 2 * BS, 2 * BS, f"{stored}; the device holds blocks 0-1, so the answer counts only tokens "
                                      "past them: blocks 2-3, a run that starts where the device's hits end")
    expect(conn, req, 4 * BS, 0, f"{stored}; the run past the device's blocks 0-3 starts at block 4, which the "
                                 "store lacks, so nothing after it counts")
    expect(conn, req, BS + 1, 0, "device hits that do not end on a block boundary leave no run to continue")
    store.save(keys[4], torch.zeros(1))
    expect(conn, req, 3 * BS, 3 * BS, "with block 4 stored too, blocks 3-5 continue the device's blocks 0-2; "
                                      "block 6 holds the last tokens and is never supplied")
    # the last token's block is never loaded: with exactly 6 full blocks, 5 at most
    exact = fake_request(tokens[:6 * BS])
    expect(conn, exact, 0, 5 * BS, "a prompt of exactly 6 full blocks, all stored: block 5 holds the last token, "
                                   "which must be computed to give logits, so 5 blocks at most")
    # the same tokens after another prefix have other keys: no hit
    expect(conn, fake_request([7] + tokens[1:]), 0, 0,
           "a different first token changes every chained key, so the store holds none of this prompt's blocks")
    expect(conn, fake_request(tokens[:BS]), 0, 0,
           "a one-block prompt: its only block holds the last token and is never supplied")
    # the device holds blocks the store does not (write-back, or the tier evicted them): the run goes on
    later = OffloadConnector(dummy_store([keys[2], keys[3]]), BS)
    expect(later, req, 2 * BS, 2 * BS, "the store lacks blocks 0-1 but the device holds them: the run continues "
                                       "from block 2 and the store's blocks 2-3 count")
    # the store's keys are the connector's (store_keys): inside its identity, so that blocks of
    # another model, dtype, block size or cache tag never match
    tagged = OffloadConnector(dummy_store(keys), BS, identity=b"model A")
    expect(tagged, req, 0, 0, "every block is stored, but under the plain chained keys: a connector whose "
                              "identity is 'model A' looks for its own keys (store_keys) and finds none")
    own = OffloadConnector(dummy_store(tagged.store_keys(tokens)[:3]), BS, identity=b"model A")
    expect(own, req, 0, 3 * BS, "blocks 0-2 stored under this connector's own keys (store_keys) match")


@pytest.mark.points(1)
def test_matched_tokens_change_nothing_and_see_every_tier(tier_dir):
    tokens = random_prompt(3 * BS + 1, VOCAB, seed=2)
    keys = chain_keys(tokens, BS)
    cpu, files = CpuTier(1), FileTier(4, tier_dir / "files")
    store = TieredStore([cpu, files])
    for k in keys:
        store.save(k, torch.ones(2))  # the first two spill to the files
    conn = OffloadConnector(store, BS)
    before = connector_state(conn)
    for _ in range(3):
        assert conn.get_num_new_matched_tokens(fake_request(tokens), 0) == 3 * BS
    assert connector_state(conn) == before


@pytest.mark.points(4)
def test_meta_saves_exactly_the_blocks_the_step_fills_that_the_store_lacks():
    tokens = random_prompt(5 * BS + 3, VOCAB, seed=3)
    keys = chain_keys(tokens, BS)
    store = dummy_store([keys[1]])
    conn = OffloadConnector(store, BS)
    blocks = [40, 41, 42, 43, 44, 45]
    prefill = fake_request(tokens, 0, cur_len=0, blocks=blocks)  # computes 0 .. 2*BS+1: fills blocks 0 and 1
    chunk = fake_request(tokens, 1, cur_len=2 * BS + 2, blocks=blocks)  # to 5*BS: fills 2, 3, 4
    decode = fake_request(tokens[:3 * BS], 2, cur_len=3 * BS - 1, blocks=blocks)  # its token completes block 2
    partial = fake_request(tokens, 3, cur_len=BS + 1, blocks=blocks)  # stays inside block 1
    # request 3 was admitted with 2 blocks present, the second from the store: block 41 gets key 1
    conn.update_state_after_alloc(fake_request(tokens, 3, cur_len=2 * BS, blocks=blocks), BS)
    plan = [(prefill, 2 * BS + 2), (chunk, 3 * BS - 2), (decode, 1), (partial, 2)]
    meta = conn.build_connector_meta(plan)
    assert [(j.request_id, list(j.blocks), list(j.keys)) for j in meta.loads] == [(3, [41], [keys[1]])]
    assert not conn.pending_loads
    assert meta.saves == [(40, keys[0]),  # block 1 is stored already
                          (42, keys[2]), (43, keys[3]), (44, keys[4]),
                          (42, keys[2])]
    assert conn.build_connector_meta(plan).loads == []  # a promise is kept once
    # with an identity, the saves name the store's keys (store_keys), never the plain chained ones
    tagged = OffloadConnector(dummy_store([]), BS, identity=b"model A")
    own = tagged.store_keys(tokens)
    assert tagged.build_connector_meta([(prefill, 2 * BS + 2)]).saves == [(40, own[0]), (41, own[1])]


@pytest.mark.points(1)
def test_meta_hands_over_the_promised_loads_of_planned_requests_only_and_write_back_saves_nothing():
    conn = OffloadConnector(dummy_store([]), BS, mode="write-back")
    tokens = random_prompt(3 * BS, VOCAB, seed=4)
    keys = chain_keys(tokens, BS)
    for rid in (5, 6):  # each admitted with its first block from the store
        conn.update_state_after_alloc(fake_request(tokens, rid, cur_len=BS, blocks=[rid, 7, 8]), BS)
    meta = conn.build_connector_meta([(fake_request(tokens, 5, cur_len=BS, blocks=[5, 7, 8]), 2 * BS)])
    assert [(j.request_id, list(j.blocks), list(j.keys)) for j in meta.loads] == [(5, [5], [keys[0]])]
    assert list(meta.saves) == []  # write-back: saved when evicted, not when full
    assert sorted(conn.pending_loads) == [6]
    again = conn.build_connector_meta([(fake_request(tokens, 5, cur_len=BS, blocks=[5, 7, 8]), 1)])
    assert list(again.loads) == []  # handed over once


# ---------------------------------------------------------------- whole workloads

@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_ids(tiny_model_dir):
    hf_model = hf.load_hf_model(str(tiny_model_dir))
    return functools.lru_cache(maxsize=None)(lambda prompt, n: tuple(hf.hf_greedy(hf_model, list(prompt), n)))


NEW = 6


def conversations() -> tuple[list[list[int]], list[list[int]]]:
    firsts = [random_prompt(26 + 5 * i, VOCAB, seed=10 + i) for i in range(3)]
    traffic = [random_prompt(30, VOCAB, seed=20 + i) for i in range(4)]
    return firsts, traffic


def run_two_turns(model, hf_ids, store, mode="write-through", num_blocks=16, **kwargs):
    """Turn 1 of three conversations, then traffic that evicts them, then their second turns."""
    engine = make_offload_engine(model, num_blocks, BS, store=store, mode=mode, **kwargs)
    firsts, traffic = conversations()
    engine.run([WorkItem(p, NEW, arrival_step=i) for i, p in enumerate(firsts)])
    seconds = [r.tokens + random_prompt(5, VOCAB, seed=30 + r.request_id) for r in list(engine.requests.values())]
    later = [WorkItem(p, NEW, arrival_step=engine.now + i) for i, p in enumerate(traffic)]
    later += [WorkItem(p, NEW, arrival_step=engine.now + len(traffic) + 2 * i) for i, p in enumerate(seconds)]
    engine.run(later)
    engine.alloc.check()
    for req in engine.requests.values():
        assert tuple(req.output_ids) == hf_ids(tuple(req.prompt_ids), NEW), req.request_id
    s = engine.summary()
    assert s["blocks_free_at_end"] == s["blocks_total"]
    return engine, s


@pytest.mark.points(1)
@pytest.mark.parametrize("tiers", ["cpu", "file", "cpu+file"])
def test_hf_ids_with_the_tier_on_and_off_and_the_tier_saves_exactly_what_it_loads(model, hf_ids, tiers, tier_dir):
    _, off = run_two_turns(model, hf_ids, None)
    cpu = {"cpu": 64, "file": 0, "cpu+file": 3}[tiers]
    store = make_store(cpu, 0 if tiers == "cpu" else 64, tier_dir / "files") if cpu else \
        TieredStore([FileTier(64, tier_dir / "files")])
    engine, on = run_two_turns(model, hf_ids, store)
    per_block = bytes_per_block(model.config, BS, model.dtype)
    assert on["tokens_loaded"] > 0 and on["tokens_loaded"] == on["blocks_loaded"] * BS
    # the tier changes nothing on the device: every token it loads is one the run without it computed
    assert off["prefill_tokens_computed"] - on["prefill_tokens_computed"] == on["tokens_loaded"]
    assert on["bytes_loaded"] == on["blocks_loaded"] * per_block and on["bytes_saved"] == on["blocks_saved"] * per_block


@pytest.mark.points(2)
def test_hf_ids_with_write_back_which_saves_only_what_the_pool_evicts(model, hf_ids):
    engine, s = run_two_turns(model, hf_ids, make_store(64), mode="write-back")
    assert 0 < s["blocks_saved"] <= s["cached_blocks_evicted"] and s["tokens_loaded"] > 0


def test_every_loaded_block_equals_the_stored_one_bit_for_bit(model, hf_ids, tier_dir):
    store = make_store(3, 64, tier_dir / "files")
    connector = RecordingConnector(store, BS)
    engine = make_offload_engine(model, 16, BS, store=None)
    use_connector(engine, connector)
    firsts, traffic = conversations()
    engine.run([WorkItem(p, NEW, arrival_step=i) for i, p in enumerate(firsts + traffic + firsts)])
    assert connector.checked == connector.counters.blocks_loaded > 0 and connector.differed == 0


@pytest.mark.points(1)
def test_hf_ids_when_a_preempted_request_comes_back_through_the_tier(model, hf_ids):
    """Recompute preemption frees blocks; with a tier the request loads them back instead."""
    prompts = [random_prompt(40, VOCAB, seed=50 + i) for i in range(4)]
    engine = make_offload_engine(model, 16, BS, store=make_store(64), prefill_chunk=16)
    engine.run([WorkItem(p, 12) for p in prompts])
    s = engine.summary()
    for req in engine.requests.values():
        assert tuple(req.output_ids) == hf_ids(tuple(req.prompt_ids), 12)
    assert s["preempted_recompute"] > 0 and s["tokens_loaded"] > 0


def test_a_step_that_fails_after_its_loads_is_rolled_back_and_runs_again(model, hf_ids):
    engine = make_offload_engine(model, 16, BS, store=make_store(64))
    firsts, traffic = conversations()
    engine.run([WorkItem(p, NEW) for p in firsts + traffic])
    engine.add_request(WorkItem(firsts[0], NEW))
    fail_next_forward(engine)
    loaded = engine.connector.counters.tokens_loaded
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.connector.counters.tokens_loaded == loaded and not engine.connector.pending_loads
    engine.run()
    last = engine.requests[len(firsts) + len(traffic)]
    assert tuple(last.output_ids) == hf_ids(tuple(firsts[0]), NEW)
    assert engine.connector.counters.tokens_loaded > loaded
    engine.alloc.check()


# ---------------------------------------------------------------- faults: a tier block that cannot be served

def first_turns(engine) -> list[list[int]]:
    """Turn 1 of the three conversations and the traffic that evicts them from the pool; returns
    their second turns' prompts."""
    firsts, traffic = conversations()
    engine.run([WorkItem(p, NEW, arrival_step=i) for i, p in enumerate(firsts)])
    seconds = [r.tokens + random_prompt(5, VOCAB, seed=30 + r.request_id) for r in list(engine.requests.values())]
    engine.run([WorkItem(p, NEW, arrival_step=engine.now + i) for i, p in enumerate(traffic)])
    return seconds


def run_and_check(engine, hf_ids, prompts: list[list[int]]) -> None:
    start = len(engine.requests)
    engine.run([WorkItem(p, NEW, arrival_step=engine.now + 2 * i) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert tuple(engine.requests[start + i].output_ids) == hf_ids(tuple(prompt), NEW)
    engine.alloc.check()


@pytest.mark.parametrize("how", FAULTS)
def test_a_bad_tier_block_is_recomputed_and_no_other_request_notices(model, hf_ids, tmp_path, how):
    """Conversation 0's third block is damaged on disk before its second turn: that turn loads its
    first two blocks, computes from the third on, and equals HF; the other turns load as before;
    the bad block is gone from the tier; the engine goes on (a third round equals HF too)."""
    files = FileTier(64, tmp_path)
    engine = make_offload_engine(model, 16, BS, store=TieredStore([files]))
    seconds = first_turns(engine)
    bad = engine.connector.store_keys(seconds[0])[2]
    damage(files.path(bad), how, other=files.path(engine.connector.store_keys(seconds[1])[0]))
    run_and_check(engine, hf_ids, seconds)
    s = engine.summary()
    if how != "deleted":  # a deleted file is a miss when matched: never promised, nothing failed
        assert s["block_load_errors"] == 1 and s["blocks_failed"] >= 1
        assert s["tokens_recomputed_after_failed_loads"] >= BS
    assert bad not in files and s["tokens_loaded"] >= 2 * BS * len(seconds)
    run_and_check(engine, hf_ids, [p + [1, 2, 3] for p in seconds])


def test_a_block_that_vanishes_between_match_and_load_is_recomputed(model, hf_ids, tmp_path):
    """Matched (and promised) while its file was there, deleted before the step's load: the
    request computes from that block in the same step."""
    files = FileTier(64, tmp_path)
    engine = make_offload_engine(model, 16, BS, store=TieredStore([files]))
    seconds = first_turns(engine)
    engine.add_request(WorkItem(seconds[1], NEW))
    real = engine.connector.start_load_kv

    def delete_then_load(meta, pool):
        for job in meta.loads:
            files.path(job.keys[1]).unlink()
        real(meta, pool)

    engine.connector.start_load_kv = delete_then_load
    engine.step()
    del engine.connector.start_load_kv
    engine.run()
    assert tuple(engine.requests[len(engine.requests) - 1].output_ids) == hf_ids(tuple(seconds[1]), NEW)
    s = engine.summary()
    assert s["blocks_failed"] >= 1 and s["tokens_recomputed_after_failed_loads"] >= BS


def test_a_second_run_on_a_persistent_folder_loads_the_first_runs_blocks(model, hf_ids, tmp_path):
    first = make_offload_engine(model, 16, BS, store=TieredStore([FileTier(64, tmp_path)]))
    seconds = first_turns(first)
    files = FileTier(64, tmp_path)  # a new process would open the folder like this
    assert files.indexed_at_open == len(list(tmp_path.glob("*.kv"))) > 0
    second = make_offload_engine(model, 16, BS, store=TieredStore([files]))
    run_and_check(second, hf_ids, seconds)
    assert second.summary()["tokens_loaded"] >= 2 * BS * len(seconds)


def test_blocks_of_another_dtype_or_block_size_in_a_shared_folder_are_never_served(model, tiny_model_dir, tmp_path):
    """float32 blocks in the folder; a bfloat16 pool and a pool of blocks of 8 find none of them
    (their keys are inside another identity), and compute everything."""
    first = make_offload_engine(model, 16, BS, store=TieredStore([FileTier(64, tmp_path)]))
    seconds = first_turns(first)
    bf16 = load_engine_model(tiny_model_dir, dtype=torch.bfloat16)
    for other_model, block_size in ((bf16, BS), (model, 2 * BS)):
        engine = make_offload_engine(other_model, 16, block_size, store=TieredStore([FileTier(64, tmp_path)]))
        engine.run([WorkItem(p, NEW) for p in seconds])
        assert engine.summary()["tokens_loaded"] == 0


def test_a_tier_needs_prefix_keys_and_a_known_mode(model):
    with pytest.raises(InputError, match="prefix sharing"):
        make_offload_engine(model, 8, BS, store=make_store(4), prefix_sharing=False)
    with pytest.raises(InputError, match="write-through or write-back"):
        make_offload_engine(model, 8, BS, store=make_store(4), mode="lazy")


def test_without_a_tier_it_is_l8s_engine(model):
    prompts = [random_prompt(30, VOCAB, seed=60 + i) for i in range(3)]
    ours = make_offload_engine(model, 10, BS).run([WorkItem(p, NEW, i) for i, p in enumerate(prompts)])
    l8 = make_prefix_engine(model, 10, BS).run([WorkItem(p, NEW, i) for i, p in enumerate(prompts)])
    assert [r.output_ids for r in ours.values()] == [r.output_ids for r in l8.values()]


def test_l12s_cache_tag_in_the_identity_keeps_blocks_written_under_other_scales_apart(model):
    """L12 composed with L14: a quantized pool's blocks are codes that mean something only under
    their scales. Two pools of one model, dtype and block size whose cache tags differ (L12's
    cache_tag: 16 bytes naming the format and every scale) have different identities, so one never
    loads what the other stored."""
    tags = [bytes([1]) * 16, bytes([1]) * 15 + bytes([2])]  # two tags one bit apart
    ids = [kv_identity(model, BS, torch.int8, tag) for tag in tags]
    assert ids[0] != ids[1] and ids[0] == kv_identity(model, BS, torch.int8, bytes(tags[0]))
    tokens = random_prompt(4 * BS + 1, VOCAB, seed=9)
    writer = OffloadConnector(dummy_store([]), BS, identity=ids[0])
    store = dummy_store(writer.store_keys(tokens))
    assert OffloadConnector(store, BS, identity=ids[0]).get_num_new_matched_tokens(fake_request(tokens), 0) == 4 * BS
    assert OffloadConnector(store, BS, identity=ids[1]).get_num_new_matched_tokens(fake_request(tokens), 0) == 0
