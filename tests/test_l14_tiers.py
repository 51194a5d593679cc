"""L14's tiers against a model of LRU written here (a list, most recent last), on random sequences of
gets and puts, for the CPU tier and the file tier alike; bit-exact round trips in every dtype the
pools use; the store's spill chain and its side-effect-free `match`; the file tier's crash rules."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from l1_contiguous import InputError
from l14_kv_transfer import BlockLoadError, CpuTier, FileTier, TieredStore
from probes_l14 import file_exists, scratch_folder, write_file

pytestmark = [pytest.mark.l14]

SHAPE = (2, 3, 4, 2, 8)  # [K/V, layers, block_size, H_kv, D]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1000 * i).to(dtype)


@pytest.fixture
def tier_dir() -> Path:
    """A folder the tiers under test may write: made where the student's code runs (under the
    judge, by the worker as its user; pytest's tmp_path is the grader's)."""
    return Path(scratch_folder())


def make_tier(kind: str, capacity: int, folder: Path) -> CpuTier | FileTier:
    return CpuTier(capacity) if kind == "cpu" else FileTier(capacity, folder / f"tier-{random.random()}")


KINDS = ["cpu", "file"]


@pytest.mark.points(2)
@pytest.mark.parametrize("kind", KINDS)
def test_lru_tier_evicts_what_a_plain_lru_model_evicts_on_random_gets_and_puts(kind, tier_dir):
    for seed in range(6):
        rng = random.Random(seed)
        capacity = rng.randint(1, 5)
        tier, model = make_tier(kind, capacity, tier_dir), []  # model: keys, least recently used first
        gets = puts = 0
        for _ in range(60):
            i = rng.randrange(9)
            if rng.random() < 0.4 and i in model:
                assert torch.equal(tier.get(key(i)), block(i))
                model.remove(i)
                model.append(i)
                gets += 1
                continue
            evicted = tier.put(key(i), block(i))
            if i in model:
                model.remove(i)
                model.append(i)
                assert evicted == []
                continue
            puts += 1
            expected = []
            while len(model) >= capacity:
                expected.append(model.pop(0))
            model.append(i)
            assert [k for k, _ in evicted] == [key(e) for e in expected], (
                f"seed {seed}: a put of a key the tier lacks evicts only when the tier is full (capacity "
                f"{capacity}), and then the least recently used keys (a get and a put both count as a use), "
                f"oldest first: expected {expected}; the tier now holds (least recent first) {model}")
            assert all(torch.equal(kv, block(e)) for (_, kv), e in zip(evicted, expected)), (
                f"seed {seed}: put returns each evicted key with the very block that was stored under it")
            assert list(tier.order) == [key(m) for m in model] and len(tier) == len(model), (
                f"seed {seed}: after each put the tier's order (least recent first) must be {model}")
        nbytes = block(0).numel() * 4
        assert (tier.bytes_read, tier.bytes_written) == (gets * nbytes, puts * nbytes), (
            f"seed {seed}: bytes_read counts a block's bytes per get ({gets} gets) and bytes_written per put "
            f"of a key not held ({puts}; a put of a held key writes nothing): expected {gets * nbytes} read, "
            f"{puts * nbytes} written, got {tier.bytes_read} and {tier.bytes_written}")


@pytest.mark.points(1)
@pytest.mark.parametrize("kind", KINDS)
def test_lru_tier_get_refreshes_and_counts_bytes(kind, tier_dir):
    tier = make_tier(kind, 2, tier_dir)
    nbytes = block(0).numel() * 4
    tier.put(key(0), block(0))
    tier.put(key(1), block(1))
    assert torch.equal(tier.get(key(0)), block(0))  # 0 is now the most recent: 1 goes first
    evicted = tier.put(key(2), block(2))
    assert [k for k, _ in evicted] == [key(1)] and key(0) in tier and key(1) not in tier
    assert tier.bytes_written == 3 * nbytes and tier.bytes_read == nbytes and tier.evictions == 1
    tier.put(key(2), block(2))  # already held: touched, not written again
    assert tier.bytes_written == 3 * nbytes
    with pytest.raises(KeyError):
        tier.get(key(7))
    assert tier.bytes_read == nbytes and list(tier.order) == [key(0), key(2)]


@pytest.mark.points(1)
def test_lru_tier_of_capacity_0_hands_every_block_back(tier_dir):
    for kind in KINDS:
        tier = make_tier(kind, 0, tier_dir)
        evicted = tier.put(key(3), block(3))
        assert [k for k, _ in evicted] == [key(3)] and torch.equal(evicted[0][1], block(3)) and len(tier) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8])
def test_the_file_tier_gives_back_the_stored_bits(dtype, tier_dir):
    raw = torch.randint(-128, 127, SHAPE, dtype=torch.int8) if dtype is torch.int8 else \
        torch.randn(SHAPE).to(dtype)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        raw.view(-1)[0] = float("nan")
    tier = FileTier(4, tier_dir / "files")
    tier.put(key(1), raw)
    back = tier.get(key(1))
    assert back.dtype == dtype and back.shape == raw.shape
    assert torch.equal(back.view(torch.uint8), raw.view(torch.uint8))  # bit for bit, NaN included
    assert tier.path(key(1)).exists() and tier.path(key(1)).name == key(1).hex() + ".kv"


def test_the_cpu_tier_keeps_a_copy_not_the_pools_tensor():
    tier, kv = CpuTier(2), block(0)
    tier.put(key(0), kv)
    kv.zero_()  # the pool reuses its block
    assert torch.equal(tier.get(key(0)), block(0))


def test_a_temporary_file_is_no_block_and_clear_deletes_every_block(tier_dir):
    tier = FileTier(4, tier_dir / "files")
    tier.put(key(0), block(0))
    write_file(tier_dir / "files" / (key(1).hex() + ".tmp"), b"half")
    assert key(1) not in tier
    tier.clear()
    assert not file_exists(tier.path(key(0))) and len(tier) == 0


def damage(path: Path, how: str, other: Path | None = None) -> None:
    """One way a block file goes bad on disk (or at another process's hands); `other` is another
    block's file (default: key 2's, beside it)."""
    data = path.read_bytes()
    line, _, payload = data.partition(b"\n")
    if how == "deleted":
        path.unlink()
        return
    if how == "another key's file":
        path.write_bytes((other or path.parent / (key(2).hex() + ".kv")).read_bytes())
        return
    damaged = {"cut": data[:-5], "emptied": b"", "garbled header": b"kvblock/2 ??? \n" + payload,
               "zeroed payload": line + b"\n" + bytes(len(payload)),
               "one bit flipped": line + b"\n" + payload[:9] + bytes([payload[9] ^ 4]) + payload[10:],
               "NaN payload": line + b"\n" + torch.full((len(payload) // 4,), float("nan")).numpy().tobytes()}[how]
    path.write_bytes(damaged)


FAULTS = ["cut", "emptied", "deleted", "garbled header", "zeroed payload", "one bit flipped", "NaN payload",
          "another key's file"]


@pytest.mark.parametrize("how", FAULTS)
def test_a_damaged_block_file_is_an_error_never_data_and_the_store_drops_it(how, tmp_path):
    files = FileTier(4, tmp_path)
    store = TieredStore([CpuTier(0), files])  # every block goes straight to the files
    for i in range(3):
        store.save(key(i), block(i))
    damage(files.path(key(1)), how)
    if how != "deleted":  # a deleted file is a miss before any read
        with pytest.raises(BlockLoadError):
            files.get(key(1))
        assert key(1) in store
        with pytest.raises(BlockLoadError):
            store.load(key(1))
    assert key(1) not in store and store.match([key(0), key(1), key(2)]) == [1]
    assert store.load_errors == (how != "deleted") and torch.equal(store.load(key(2)), block(2))


def test_a_bad_copy_in_one_tier_is_served_from_the_next_that_holds_it(tmp_path):
    near, far = FileTier(4, tmp_path / "near"), FileTier(4, tmp_path / "far")
    store = TieredStore([near, far])
    far.put(key(5), block(5))
    store.load(key(5))  # promoted: now in both
    damage(near.path(key(5)), "one bit flipped")
    assert torch.equal(store.load(key(5)), block(5)) and store.load_errors == 1
    assert torch.equal(near.get(key(5)), block(5))  # promoted again: a good copy replaced the bad one


def test_a_file_tier_opened_on_a_folder_indexes_the_blocks_there_most_recent_first(tmp_path):
    first = FileTier(8, tmp_path)
    for i in range(5):
        first.put(key(i), block(i))
        os.utime(first.path(key(i)), ns=(i * 10**9, i * 10**9))  # written in key order
    (tmp_path / "notes.txt").write_text("not a block")
    (tmp_path / (key(9).hex() + ".kv")).write_bytes(b"junk\n")
    (tmp_path / "zz.kv").write_bytes(first.path(key(0)).read_bytes())  # a header not named by its file
    again = FileTier(8, tmp_path)
    assert again.indexed_at_open == 5 and list(again.order) == [key(i) for i in range(5)]
    assert all(torch.equal(again.get(key(i)), block(i)) for i in range(5))
    small = FileTier(2, tmp_path)  # keeps the two most recently written; the rest stay on disk
    assert list(small.order) == [key(3), key(4)]


def test_a_write_that_fails_leaves_no_partial_file(tmp_path):
    """A full disk, as a file-size limit in a child process: the write fails with OSError and
    neither a block file nor a temporary file stays."""
    code = f"""
import resource, signal, sys, torch
sys.path[:0] = {[str(Path(__file__).resolve().parent.parent)]!r}
from l14_kv_transfer import FileTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
tier = FileTier(4, {str(tmp_path)!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
try:
    tier.put(bytes(16), torch.zeros(4096))
except OSError as exc:
    print("OSError", exc.errno)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("OSError"), done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


SHARER = """
import random, sys, torch
sys.path[:0] = {path!r}
from l14_kv_transfer import BlockLoadError, CpuTier, FileTier, TieredStore
from test_l14_tiers import block, key
rng, served = random.Random({seed}), 0
for step in range(300):
    if step % 50 == 0:  # a new run on the folder: it indexes what the others wrote, and loads it
        store = TieredStore([CpuTier(1), FileTier(3, {folder!r})])
    i = rng.randrange(8)
    try:
        kv = store.load(key(i))
    except (KeyError, BlockLoadError):
        try:
            store.save(key(i), block(i))
        except BlockLoadError:  # a block this save evicted was deleted by another process meanwhile
            pass
        continue
    assert torch.equal(kv, block(i)), f"key {{i}} served other bytes"
    served += 1
print(served, store.load_errors)
"""


def test_three_processes_share_one_folder_and_never_serve_a_wrong_block(tmp_path):
    """Each keeps 3 of 8 blocks in the shared folder and evicts, so they delete each other's files
    under one another's reads, and every 50 operations reopens the folder (a new run), indexing and
    loading what the others wrote: a vanished block is a miss, never an error or wrong data."""
    paths = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
    runs = [subprocess.Popen([sys.executable, "-c", SHARER.format(path=paths, folder=str(tmp_path), seed=seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(3)]
    outs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outs]
    assert sum(int(out.split()[0]) for out, _ in outs) > 0
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "4"])
def test_a_bad_capacity_or_folder_is_one_clear_error(capacity, tier_dir):
    with pytest.raises(InputError, match="capacity"):
        CpuTier(capacity)
    write_file(tier_dir / "afile", b"x")
    with pytest.raises(InputError, match="is a file"):
        FileTier(2, tier_dir / "afile")


@pytest.mark.points(3)
def test_store_match_is_the_nearest_tier_of_the_longest_leading_run_and_changes_nothing(tier_dir):
    cpu, files = CpuTier(2), FileTier(8, tier_dir / "files")
    store = TieredStore([cpu, files])
    for i in range(5):
        store.save(key(i), block(i))  # 0, 1, 2 spill to files; 3, 4 stay in memory
    store.load(key(1))  # promoted: now in memory and still in the files; 3 went down
    before = (list(cpu.order), list(files.order), cpu.bytes_read, files.bytes_read, list(store.loads_by_tier))
    assert store.match([key(1), key(0), key(4), key(2)]) == [0, 1, 0, 1]  # the nearest copy of key 1
    assert store.match([key(3), key(4)]) == [1, 0]
    assert store.match([key(2), key(9), key(3)]) == [1]  # stops at the first miss
    assert store.match([key(9), key(0)]) == [] and store.match([]) == []
    after = (list(cpu.order), list(files.order), cpu.bytes_read, files.bytes_read, list(store.loads_by_tier))
    assert after == before, ("match must change nothing: no tier's order (recency), bytes_read or loads_by_tier "
                             "may move, since the scheduler asks again every step a request waits "
                             f"(before: {before}, after: {after})")


@pytest.mark.points(4)
def test_store_save_spills_each_tiers_evictions_one_tier_down_and_drops_from_the_last(tier_dir):
    for seed in range(4):
        rng = random.Random(seed)
        caps = [rng.randint(1, 3), rng.randint(0, 3)]
        store = TieredStore([CpuTier(caps[0]), FileTier(caps[1], tier_dir / f"f{seed}")])
        model: list[list[int]] = [[], []]  # per tier, least recently used first
        dropped = 0
        for _ in range(25):
            i = rng.randrange(12)
            store.save(key(i), block(i))
            moving = [i]
            for t in range(2):
                out = []
                for m in moving:
                    if m in model[t]:
                        model[t].remove(m)
                        model[t].append(m)
                        continue
                    if caps[t] == 0:
                        out.append(m)
                        continue
                    while len(model[t]) >= caps[t]:
                        out.append(model[t].pop(0))
                    model[t].append(m)
                moving = out
            dropped += len(moving)
            for t, tier in enumerate(store.tiers):
                assert list(tier.order) == [key(m) for m in model[t]], (
                    f"seed {seed}, tier {t}: a save puts the block in tier 0, each tier's evictions (least "
                    f"recently used first) go one tier down, and a key a tier holds is only touched; tier {t} "
                    f"must hold {model[t]} (least recent first)")
            assert store.dropped == dropped, (
                f"seed {seed}: what the last tier evicts is dropped and counted in `dropped`: expected {dropped}, "
                f"got {store.dropped}")
        for t, tier in enumerate(store.tiers):  # what spilled is the bytes that were saved
            assert all(torch.equal(tier.get(key(m)), block(m)) for m in model[t])


def test_store_load_takes_the_nearest_copy_and_promotes_it(tier_dir):
    cpu, files = CpuTier(1), FileTier(4, tier_dir / "files")
    store = TieredStore([cpu, files])
    store.save(key(0), block(0))
    store.save(key(1), block(1))  # 0 spills to files
    assert torch.equal(store.load(key(0)), block(0))
    assert store.loads_by_tier == [0, 1] and list(cpu.order) == [key(0)] and key(1) in files
    assert torch.equal(store.load(key(0)), block(0)) and store.loads_by_tier == [1, 1]
    with pytest.raises(KeyError):
        store.load(key(5))
    with pytest.raises(InputError):
        TieredStore([])
