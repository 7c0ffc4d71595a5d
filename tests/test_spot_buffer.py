"""spot.buffer.ring: the shared-memory DataBuffer under several producer and reader processes.

Entries carry content derived from their key (`_entry`), so a reader can tell a torn copy from a
whole one (`_intact`). Child processes come from a forkserver that preloads spot.buffer.ring (fast to
start, and no fork of a parent whose OpenMP pool is running); each test uses its own segment name
and the `seg` fixture removes it whatever happens.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path

import pytest
import torch

from spot.buffer import ring as sb
from spot.buffer.ring import BufferEntry, DataBuffer
from spot.buffer.segment import reclaim_stale, segment_name

F = 32
TIMEOUT = 30.0


def _entry(key: str, T: int, *, step: int = 0, finished: bool = True, prompt_len: int = 1,
           dtype: torch.dtype = torch.float32) -> BufferEntry:
    base = zlib.crc32(key.encode()) % 1000
    feats = (base + torch.arange(T * F) % 997).float().view(T, F)  # exact in fp32 and (mostly) distinct
    return BufferEntry(key=key, step=step, policy_version=step, finished=finished, prompt_len=prompt_len,
                       tokens=base + torch.arange(T), features=feats.to(dtype))


def _intact(e: BufferEntry) -> bool:
    want = _entry(e.key, e.length, dtype=e.features.dtype)
    return torch.equal(e.tokens, want.tokens) and torch.equal(e.features, want.features)


@pytest.fixture
def seg():
    name = segment_name(f"test-{uuid.uuid4().hex[:12]}", "node")
    yield name
    for path in (sb.SHM / name, *sb.SHM.glob(f".{name}.*")):
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["spot.buffer.ring", "tests.test_spot_buffer"])
    return ctx


def _start(ctx, target, *args):
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)


# -- child processes ----------------------------------------------------------------------------------


def _produce(name: str, tag: int, stop, out) -> None:
    buf = DataBuffer.attach(name)
    g = torch.Generator().manual_seed(tag)
    seqs, i = [], 0
    while not stop.is_set():
        T = int(torch.randint(16, 257, (1,), generator=g))
        seqs.append(buf.put(_entry(f"p{tag}/{i}", T)))
        i += 1
    buf.close()
    out.put(("producer", seqs))


def _consume(name: str, capacity: int, stop, out) -> None:
    buf = DataBuffer.attach(name)
    ok = gone = torn = over = 0
    while not stop.is_set():
        infos = buf.infos()
        over += sum(i.nbytes for i in infos) > capacity
        for info in infos:
            e = buf.read(info)
            if e is None:
                gone += 1
            elif _intact(e) and e.key == info.key:
                ok += 1
            else:
                torn += 1
    buf.close()
    out.put(("reader", (ok, gone, torn, over)))


def _put_then_die_mid_write(name: str, ready) -> None:
    buf = DataBuffer.attach(name)
    for i in range(3):
        buf.put(_entry(f"whole/{i}", 64))
    sb._MID_WRITE_HOOK = lambda: (ready.set(), time.sleep(TIMEOUT))
    buf.put(_entry("dying/0", 128))


def _create_and_hang(name: str, ready) -> None:
    buf = DataBuffer.create(name, capacity_bytes=1 << 16, feature_size=F)
    buf.put(_entry("old/0", 8))
    ready.set()
    time.sleep(TIMEOUT)


def _kill(ctx, target, name: str) -> None:
    ready = ctx.Event()
    p = _start(ctx, target, name, ready)
    try:
        assert ready.wait(TIMEOUT), "the child never reached the point to kill it at"
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        assert p.exitcode == -signal.SIGKILL
    finally:
        _reap([p])


# -- tests --------------------------------------------------------------------------------------------


def test_concurrent_producers_and_readers_never_see_torn_entries_and_stay_within_bytes(seg, ctx):
    capacity = 1 << 19  # ~15-60 live entries of up to 34 KB: the ring wraps many times a second
    buf = DataBuffer.create(seg, capacity_bytes=capacity, feature_size=F, max_entries=48)
    stop, out = ctx.Event(), ctx.Queue()
    procs = [_start(ctx, _produce, seg, tag, stop, out) for tag in range(3)]
    procs += [_start(ctx, _consume, seg, capacity, stop, out) for _ in range(2)]
    try:
        time.sleep(1.5)  # the load's duration, not a synchronisation
        stop.set()
        results = [out.get(timeout=TIMEOUT) for _ in procs]
    finally:
        stop.set()
        _reap(procs)
    seqs = sorted(s for kind, r in results if kind == "producer" for s in r)
    reads = [r for kind, r in results if kind == "reader"]
    assert all(len(r) > 0 for kind, r in results if kind == "producer")
    assert seqs == list(range(len(seqs)))  # writers serialised: every sequence number once
    assert all(ok > 0 for ok, *_ in reads)
    assert sum(torn for _, _, torn, _ in reads) == 0
    assert sum(over for *_, over in reads) == 0
    final = buf.infos()
    assert [i.seq for i in final] == list(range(len(seqs) - len(final), len(seqs)))  # the newest, in order
    assert all(_intact(buf.read(i)) for i in final)
    buf.unlink()


def test_byte_and_entry_bounds_hold_and_the_oldest_are_evicted_first(seg):
    capacity, max_entries = 100_000, 20
    g = torch.Generator().manual_seed(0)
    with DataBuffer.create(seg, capacity_bytes=capacity, feature_size=F, max_entries=max_entries) as buf:
        for i in range(300):
            T = int(torch.randint(1, 200, (1,), generator=g))
            seq = buf.put(_entry(f"k{i}/0", T))
            infos = buf.infos()
            stats = buf.stats()
            assert seq == i and infos[-1].seq == i
            assert sum(x.nbytes for x in infos) == stats["buffer/bytes"] <= capacity
            assert len(infos) == stats["buffer/entries"] <= max_entries
            assert [x.seq for x in infos] == list(range(i + 1 - len(infos), i + 1))
        assert 0.3 < stats["buffer/fill"] <= 1.0  # the ring is used, not just its last entry
        assert all(_intact(buf.read(x)) for x in infos)


def test_an_entry_larger_than_the_capacity_is_refused(seg):
    with DataBuffer.create(seg, capacity_bytes=10_000, feature_size=F) as buf:
        with pytest.raises(ValueError, match="more than the buffer's capacity"):
            buf.put(_entry("big/0", 100))
        with pytest.raises(ValueError, match="feature size"):
            buf.put(BufferEntry(key="f/0", step=0, policy_version=0, finished=True, prompt_len=1,
                                tokens=torch.arange(4), features=torch.zeros(4, F + 1)))


def test_put_many_writes_in_order_as_single_puts_do_and_checks_every_entry_before_writing(seg):
    with DataBuffer.create(seg, capacity_bytes=100_000, feature_size=F, max_entries=8) as buf:
        seqs = buf.put_many([_entry(f"m{i}/0", 10 + i) for i in range(12)])  # more than max_entries: evicts
        assert seqs == list(range(12))
        infos = buf.infos()
        assert [x.seq for x in infos] == list(range(4, 12)) and all(_intact(buf.read(x)) for x in infos)
        with pytest.raises(ValueError, match="more than the buffer's capacity"):
            buf.put_many([_entry("ok/0", 4), _entry("big/0", 1000)])
        assert [x.seq for x in buf.infos()] == list(range(4, 12))  # nothing of the refused batch was written
        assert buf.put(_entry("after/0", 4)) == 12


def test_an_entry_given_in_feature_parts_reads_back_as_the_whole(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F) as buf:
        whole = _entry("w/0", 9, prompt_len=3)
        parts = BufferEntry(key="p/0", step=0, policy_version=0, finished=True, prompt_len=3, tokens=whole.tokens,
                            features=(whole.features[:3], whole.features[3:]))  # a prompt's, then a response view's
        buf.put_many([parts])
        (info,) = buf.infos()
        e = buf.read(info)
        assert torch.equal(e.tokens, whole.tokens) and torch.equal(e.features, whole.features)
        assert torch.equal(parts.to_row().features, whole.features)
        with pytest.raises(ValueError, match="must agree"):
            BufferEntry(key="x/0", step=0, policy_version=0, finished=True, prompt_len=3, tokens=whole.tokens,
                        features=(whole.features[:3], whole.features[4:]))  # a row short


def test_read_of_an_overwritten_entry_is_none(seg):
    with DataBuffer.create(seg, capacity_bytes=20_000, feature_size=F) as buf:
        buf.put(_entry("first/0", 64))
        first = buf.infos()[0]
        for i in range(4):
            buf.put(_entry(f"next/{i}", 64))
        assert first.seq not in [x.seq for x in buf.infos()]
        assert buf.read(first) is None


def test_bf16_buffer_round_trips_to_rows(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F, dtype=torch.bfloat16) as buf:
        buf.put(_entry("b/3", 10, step=4, prompt_len=3))  # fp32 features stored as bf16
        e = buf.read(buf.infos()[0])
        assert e.features.dtype == torch.bfloat16 and _intact(e)
        row = e.to_row()
        assert (row.prompt_id, row.step, row.prompt_len, row.length) == ("b/3", 4, 3, 10)


def _filled_for_sampling(buf: DataBuffer) -> None:
    for i in range(40):
        buf.put(_entry(f"cur/{i}", 4 + i % 5, step=5, prompt_len=2))
    for i in range(8):
        buf.put(_entry(f"cut/{i}", 30, step=5, finished=False, prompt_len=2))
    for i in range(20):
        buf.put(_entry(f"prev/{i}", 5 + i, step=4, finished=i % 3 > 0, prompt_len=2))


def test_sample_mixes_current_finished_with_the_previous_steps_longest(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 20, feature_size=F) as buf:
        _filled_for_sampling(buf)
        longest_half = {f"prev/{i}" for i in range(10, 20)}
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            keys = [e.key for e in buf.sample(10, step=5, offset_ratio=0.3, generator=g)]
            assert len(set(keys)) == 10
            assert sum(k.startswith("cur/") for k in keys) == 7  # finished entries of step 5 only
            assert {k for k in keys if not k.startswith("cur/")} <= longest_half
            assert sum(k in longest_half for k in keys) == 3


def test_sample_is_deterministic_given_the_generator(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 20, feature_size=F) as buf:
        _filled_for_sampling(buf)
        draws = [[e.key for e in buf.sample(12, step=5, offset_ratio=0.5, generator=torch.Generator().manual_seed(s))]
                 for s in (7, 7, 8)]
        assert draws[0] == draws[1] != draws[2]


def test_sample_fills_in_from_the_other_side_and_is_empty_when_nothing_fits(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 20, feature_size=F) as buf:
        g = torch.Generator().manual_seed(0)
        assert buf.sample(4, step=1, offset_ratio=0.5, generator=g) == []
        for i in range(2):
            buf.put(_entry(f"prev/{i}", 8, step=0))
        assert sorted(e.key for e in buf.sample(4, step=1, offset_ratio=0.25, generator=g)) == ["prev/0", "prev/1"]
        for i in range(10):
            buf.put(_entry(f"cur/{i}", 8, step=1))
        keys = [e.key for e in buf.sample(6, step=1, offset_ratio=0.5, generator=g)]
        assert sum(k.startswith("prev/") for k in keys) == 2 and len(keys) == 6
        assert buf.sample(6, step=3, offset_ratio=0.5, generator=g) == []


def test_a_producer_killed_mid_write_leaves_no_visible_partial_entry(seg, ctx):
    buf = DataBuffer.create(seg, capacity_bytes=60_000, feature_size=F)
    _kill(ctx, _put_then_die_mid_write, seg)
    assert [i.key for i in buf.infos()] == ["whole/0", "whole/1", "whole/2"]
    assert all(_intact(buf.read(i)) for i in buf.infos())
    probe = os.open(sb.SHM / seg, os.O_RDWR)  # the kernel released the dead writer's lock
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
    for i in range(12):  # wraps the ring over the dead entry's bytes and slot
        buf.put(_entry(f"after/{i}", 40))
        infos = buf.infos()
        assert "dying/0" not in [x.key for x in infos]
        assert all(_intact(buf.read(x)) for x in infos)
    buf.unlink()


def test_segment_of_a_killed_run_is_reclaimed_by_the_next_create(seg, ctx):
    _kill(ctx, _create_and_hang, seg)
    assert (sb.SHM / seg).exists()  # SIGKILL ran no atexit
    with DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F) as buf:
        assert buf.infos() == []


def test_reclaim_stale_unlinks_only_dead_owners_segments(seg, ctx):
    _kill(ctx, _create_and_hang, seg)
    live = DataBuffer.create(seg + "-live", capacity_bytes=1 << 16, feature_size=F)
    try:
        assert reclaim_stale(prefix=seg) == [seg]
        assert not (sb.SHM / seg).exists() and (sb.SHM / live.name).exists()
    finally:
        live.unlink()


def test_create_over_a_live_owner_names_its_pid(seg):
    with DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F):
        with pytest.raises(ValueError, match=f"live process {os.getpid()}"):
            DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F)


def test_attach_to_a_missing_segment_says_so(seg):
    with pytest.raises(FileNotFoundError, match=f"no DataBuffer segment .*{seg}.*segment_name"):
        DataBuffer.attach(seg)


def test_attached_reader_sees_the_creators_entries_and_unlink_removes_the_segment(seg):
    buf = DataBuffer.create(seg, capacity_bytes=1 << 16, feature_size=F)
    buf.put(_entry("a/0", 16))
    other = DataBuffer.attach(seg)
    assert (other.feature_size, other.dtype, other.capacity_bytes) == (F, torch.float32, 1 << 16)
    assert _intact(other.read(other.infos()[0]))
    other.close()
    buf.unlink()
    assert not (sb.SHM / seg).exists()


def test_the_creator_removes_its_segment_at_exit(seg):
    code = (f"from spot.buffer.ring import DataBuffer; DataBuffer.create({seg!r}, capacity_bytes=4096, feature_size=4); "
            f"import os; assert os.path.exists('/dev/shm/{seg}')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert not (sb.SHM / seg).exists()


def test_segment_names_are_per_run_and_node_with_safe_characters():
    assert segment_name("run 1/a", "node:3") == "tailspec-run_1_a-node_3"
    assert segment_name("r").startswith("tailspec-r-")
