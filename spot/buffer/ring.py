"""DataBuffer: a ring of hidden-state entries in one shared-memory segment per node.

An *entry* is one rollout as the target saw it: its key ("<prompt_id>/<sample>"), the RL step and
policy version that produced it, whether the response finished (ended with a stop token), the
prompt length, token ids [T] and the target's features [T, F] (the buffer's dtype, fp32 or bf16).
Producers (every rank's feature sink, the actor's log-prob forward) `put` entries; any number of
readers (spot trainers) on the node `infos` / `read` / `sample` them. The oldest entries are evicted
to make room: the live payload bytes never exceed `capacity_bytes`, and at most `max_entries` live.

Layout of the segment, a plain file /dev/shm/<name> mapped by every process (not
multiprocessing.shared_memory: its resource tracker unlinks a segment when any attached process
exits): a header page (magic, owner pid + start time, geometry, and the writers' ring state: next
sequence number `head`, oldest live `tail`, byte write position `wp`), a table of `max_entries`
slots (entry `seq` lives in slot seq % max_entries: a seqlock counter `lock`, a `valid` flag and the
entry's header fields), then `capacity_bytes` of payload (tokens int64 then features) laid out as a
byte ring, each entry contiguous (an entry that does not fit before the end starts again at 0).

Consistency scheme: writers serialise on an fcntl.flock of the segment (exclusive); readers take no
lock and use the per-slot seqlock. A writer, before touching a payload byte, invalidates every slot
whose bytes it will overwrite and the slot it will reuse (`lock` made odd, `valid` cleared, `lock`
made even again); it then makes its own slot's `lock` odd, writes the header fields and the payload,
and only then makes `lock` even with `valid` set. A reader loads `lock` (v1), skips the slot if v1 is
odd or `valid` is clear, copies the header and payload, and loads `lock` again (v2): the copy is
returned only if v2 == v1. Why it is never torn: a payload byte changes only after the slot owning it
was made odd, so a copy that saw any changed byte loads a `lock` that changed too (on x86-64, TSO
keeps a writer's stores and a reader's loads in program order; elsewhere readers also take a shared
flock, see `_ORDERED`). A writer killed mid-write leaves its slot odd, so invisible, for good: the
ring state in the header (`head`, `wp`) is advanced once the slot's header fields are written and
before its payload, so the dead entry's bytes stay claimed by its slot, and a later writer evicts it
like any other entry, moving the counter to the next odd value (never to an even one on a torn
entry) before it clears `valid`. A writer dying before it advanced `head` left at most invalidated
slots and a half-written odd slot at `head`, which the next writer reuses the same way. The kernel
releases a dead process's flock, so the next writer does not wait for it.

Lifetime: `create` writes a fresh segment under a temporary name and links it into place (a segment
appears initialised or not at all), registers an atexit `unlink`, and reclaims a segment of the same
name whose owner is dead (a crashed run); `spot.buffer.segment.reclaim_stale` does so for every tailspec segment.
Payload memory is reserved at create (posix_fallocate), so a full /dev/shm fails there, not later,
and every process maps it populated (MAP_POPULATE, where the platform has it): a flush then writes
into mapped pages instead of faulting them in one by one on the producer's critical path;
`put_many` holds the writers' lock once for a whole step's entries.

Sampling (`sample`) mixes step s's finished entries with step s-1's longest ones (TLT's one-step
offset): the responses that finish early in a step are the short ones, so training only on them
would teach the drafter short answers. The header page also holds the node gate (spot.buffer.gate), which a
separated run's rollout ranks set and its spot-pool members read. This module knows nothing about
drafters or training.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import math
import mmap
import os
import platform
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from spot.buffer.gate import GATE, GATE_OFFSET, initial_gate
from spot.buffer.entries import BufferEntry, EntryInfo
from spot.buffer.segment import _HEADER, _MAGIC, SHM, _alive, _reclaim_if_dead, _start_time

_VERSION = 1
_PAGE = 4096
_ALIGN = 64
_KEY_BYTES = 128
_DTYPES = {torch.float32: 1, torch.bfloat16: 2}
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
# x86-64 keeps stores and loads in program order (TSO), which the lock-free seqlock read relies on;
# on weakly ordered CPUs (arm64) readers take a shared flock around each copy instead.
_ORDERED = platform.machine() in ("x86_64", "AMD64", "i386", "i686")
# Test-only: when set, put() calls it after the header and tokens are written, before the features
# (tests SIGKILL a producer there to check that a half-written entry stays invisible).
_MID_WRITE_HOOK = None

_SLOT = np.dtype({
    "names": ["lock", "valid", "seq", "offset", "nbytes", "length", "step", "policy_version",
              "finished", "prompt_len", "key_len", "key"],
    "formats": ["<u8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", f"S{_KEY_BYTES}"],
    "itemsize": 256,
})


class DataBuffer:
    """The node's ring of entries; `create` it once per run (the owner), `attach` from other processes."""

    def __init__(self, path: Path, fd: int, *, owner: bool) -> None:
        self.name = path.name
        self._path, self._fd, self._owner = path, fd, owner
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing this fd
        st = os.fstat(fd)
        size, self._file_id = st.st_size, (st.st_dev, st.st_ino)
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self._header = np.ndarray((), _HEADER, buffer=self._mm)
        self._gate = np.ndarray((), GATE, buffer=self._mm, offset=GATE_OFFSET)  # spot.buffer.gate's record
        h = self._header
        if size < _PAGE or int(h["magic"]) != _MAGIC or int(h["version"]) != _VERSION:
            self.close()
            raise ValueError(f"{path} is not a tailspec DataBuffer segment (version {_VERSION}); remove it if "
                             "nothing uses it")
        self.capacity_bytes = int(h["capacity"])
        self.feature_size = int(h["feature_size"])
        self.dtype = {v: k for k, v in _DTYPES.items()}[int(h["dtype"])]
        self.max_entries = int(h["max_entries"])
        data_offset = int(h["data_offset"])
        self._slots = np.ndarray((self.max_entries,), _SLOT, buffer=self._mm, offset=_PAGE)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=data_offset,
                                      count=self.capacity_bytes)  # [capacity] bytes

    @classmethod
    def create(cls, name: str, *, capacity_bytes: int, feature_size: int, dtype: torch.dtype = torch.float32,
               max_entries: int = 4096, gate_ranks: int = 0) -> DataBuffer:
        """A new segment `name` (see the module docstring); `gate_ranks`: the rollout ranks of the
        node that gate its spot-pool members (spot.buffer.gate; 0: ungated)."""
        if not _NAME_OK.match(name):
            raise ValueError(f"segment name {name!r} may only use [A-Za-z0-9_.-]; build it with segment_name(run)")
        if dtype not in _DTYPES:
            raise ValueError(f"buffer dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        if capacity_bytes <= 0 or feature_size <= 0 or max_entries <= 0:
            raise ValueError(f"capacity_bytes ({capacity_bytes}), feature_size ({feature_size}) and max_entries "
                             f"({max_entries}) must be positive")
        path = SHM / name
        _reclaim_if_dead(path)
        data_offset = _round_up(_PAGE + max_entries * _SLOT.itemsize, _PAGE)
        tmp = SHM / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, data_offset + capacity_bytes)
            except OSError as e:
                raise ValueError(f"cannot reserve {data_offset + capacity_bytes} bytes in {SHM} ({e.strerror}): "
                                 "lower spot buffer capacity_bytes or free /dev/shm") from e
            head = np.zeros((), _HEADER)
            head["magic"], head["version"] = _MAGIC, _VERSION
            head["owner_pid"], head["owner_start"] = os.getpid(), _start_time(os.getpid())
            head["capacity"], head["feature_size"], head["dtype"] = capacity_bytes, feature_size, _DTYPES[dtype]
            head["max_entries"], head["data_offset"] = max_entries, data_offset
            os.pwrite(fd, head.tobytes(), 0)
            os.pwrite(fd, initial_gate(gate_ranks, time.time()).tobytes(), GATE_OFFSET)
            try:
                os.link(tmp, path)  # exclusive: fails if another creator got there first
            except FileExistsError:
                raise ValueError(f"segment {path} appeared while creating it: another process creates the same "
                                 "run's buffer; give each run its own name (segment_name(run))") from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink()
        buf = cls(path, fd, owner=True)
        atexit.register(buf.unlink)
        return buf

    @classmethod
    def attach(cls, name: str) -> DataBuffer:
        path = SHM / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no DataBuffer segment {path}: the run's creator (DataBuffer.create) has not "
                                    "started yet or has exited; check the run and node in segment_name(run, node)"
                                    ) from None
        try:
            return cls(path, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    # -- writers -------------------------------------------------------------------------------------

    def put(self, entry: BufferEntry) -> int:
        """Appends an entry (evicting the oldest to make room); -> its sequence number."""
        return self.put_many([entry])[0]

    def put_many(self, entries: list[BufferEntry]) -> list[int]:
        """Appends entries in order under one hold of the writers' lock (a flush of a step's
        rollouts); -> their sequence numbers. Each entry becomes visible as it is written."""
        for entry in entries:
            self._check(entry)
        with self._write_lock():
            return [self._write(entry) for entry in entries]

    def _check(self, entry: BufferEntry) -> None:
        T = entry.length
        F = entry.feature_parts()[0].shape[1]
        if F != self.feature_size:
            raise ValueError(f"entry {entry.key!r} has feature size {F}, the buffer holds {self.feature_size}")
        if entry.tokens.is_floating_point() or entry.tokens.is_complex():
            raise ValueError(f"entry {entry.key!r}: tokens must be integer ids, got {entry.tokens.dtype}")
        key = entry.key.encode()
        if not 0 < len(key) <= _KEY_BYTES or b"\0" in key:
            raise ValueError(f"entry key {entry.key!r} must be 1..{_KEY_BYTES} UTF-8 bytes without NUL")
        _, nbytes = self._payload_bytes(T)
        if nbytes > self.capacity_bytes:
            raise ValueError(f"entry {entry.key!r} needs {nbytes} bytes, more than the buffer's capacity "
                             f"{self.capacity_bytes}; raise capacity_bytes or shorten rollouts")

    def _payload_bytes(self, T: int) -> tuple[int, int]:
        """(token bytes, payload bytes) of an entry of T tokens: int64 ids, then [T, F] features."""
        return T * 8, T * 8 + T * self.feature_size * self.dtype.itemsize

    def _write(self, entry: BufferEntry) -> int:
        """One checked entry into the ring, the writers' lock held; -> its sequence number."""
        T, key = entry.length, entry.key.encode()
        tok_bytes, nbytes = self._payload_bytes(T)
        span = _round_up(nbytes, _ALIGN)
        h = self._header
        head, wp = int(h["head"]), int(h["wp"])
        pos = wp if wp + nbytes <= self.capacity_bytes else 0
        # the bytes this write claims: when it wraps, [wp, capacity) too (the oldest entries lie there)
        claimed = [(pos, pos + nbytes)] if pos == wp else [(wp, self.capacity_bytes), (0, nbytes)]
        self._evict(head, claimed)
        s = self._slots[head % self.max_entries]
        _make_odd(s)
        s["seq"], s["offset"], s["nbytes"], s["length"] = head, pos, nbytes, T
        s["step"], s["policy_version"], s["finished"] = entry.step, entry.policy_version, int(entry.finished)
        s["prompt_len"], s["key_len"], s["key"] = entry.prompt_len, len(key), key
        s["valid"] = 1
        # the ring state moves before the payload: a writer dying below leaves an odd slot that
        # the ring owns, and the next writers evict it like any other (no sequence number reused)
        h["wp"], h["head"] = min(pos + span, self.capacity_bytes), head + 1
        self._data[pos:pos + tok_bytes].view(torch.int64).copy_(entry.tokens)
        if _MID_WRITE_HOOK is not None:
            _MID_WRITE_HOOK()
        dest, at = self._data[pos + tok_bytes:pos + nbytes].view(self.dtype).view(T, self.feature_size), 0
        for part in entry.feature_parts():  # [T_i, F] each, straight into the ring
            dest[at:at + part.shape[0]].copy_(part.detach())
            at += part.shape[0]
        s["lock"] = int(s["lock"]) + 1  # even: complete
        return head

    def _evict(self, head: int, claimed: list[tuple[int, int]]) -> None:
        """Invalidates the oldest entries until a slot is free and none overlaps the claimed byte ranges.

        Entries lie in the byte ring in sequence order, so the ones overlapping the next write are a
        prefix of the oldest: stopping at the first that does not overlap is exact.
        """
        h = self._header
        tail = int(h["tail"])
        while tail < head:
            s = self._slots[tail % self.max_entries]
            lo, hi = int(s["offset"]), int(s["offset"]) + int(s["nbytes"])
            if head - tail < self.max_entries and not any(lo < b and a < hi for a, b in claimed):
                break
            _make_odd(s)
            s["valid"] = 0
            s["lock"] = int(s["lock"]) + 1
            tail += 1
            h["tail"] = tail

    def writers_lock(self) -> contextlib.AbstractContextManager[None]:
        """The writers' lock (exclusive, across the node's processes): spot.buffer.gate's read-modify-writes take it too."""
        return self._write_lock()

    @property
    def gate_fields(self) -> np.ndarray:
        """The header's gate record (spot.buffer.gate.NodeGate reads and writes it)."""
        return self._gate

    def owner_alive(self) -> bool:
        """The process that created the segment is alive (a crashed run's segment outlives it)."""
        return _alive(int(self._header["owner_pid"]), int(self._header["owner_start"]))

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _read_lock(self) -> Iterator[None]:
        if _ORDERED:
            yield
            return
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- readers -------------------------------------------------------------------------------------

    def _visible(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot indices, slot-table rows) of the visible (completely written) entries, oldest first."""
        with self._read_lock():
            v1 = self._slots["lock"].copy()
            table = self._slots.copy()
            v2 = self._slots["lock"].copy()
        ok = (v1 == v2) & (v1 % 2 == 0) & (table["valid"] == 1)
        order = np.argsort(table["seq"][ok], kind="stable")
        return np.nonzero(ok)[0][order], table[ok][order]

    @staticmethod
    def _infos_of(slots: np.ndarray, rows: np.ndarray) -> list[EntryInfo]:
        return [EntryInfo(slot=int(i), seq=int(r["seq"]), key=bytes(r["key"][:r["key_len"]]).decode(),
                          step=int(r["step"]), policy_version=int(r["policy_version"]), finished=bool(r["finished"]),
                          prompt_len=int(r["prompt_len"]), length=int(r["length"]), nbytes=int(r["nbytes"]))
                for i, r in zip(slots, rows, strict=True)]

    def infos(self) -> list[EntryInfo]:
        """The visible (completely written) entries, oldest first."""
        return self._infos_of(*self._visible())

    def read(self, info: EntryInfo) -> BufferEntry | None:
        """A copy of the entry, or None when it was overwritten meanwhile (never a torn copy)."""
        s = self._slots[info.slot]
        with self._read_lock():
            v1 = int(s["lock"])
            row = s.copy()
            if v1 % 2 or int(row["valid"]) != 1 or int(row["seq"]) != info.seq:
                return None
            pos, nbytes, T = int(row["offset"]), int(row["nbytes"]), int(row["length"])
            tok_bytes, want = self._payload_bytes(T)
            if not (0 <= pos and pos + nbytes <= self.capacity_bytes and nbytes == want):
                return None  # header fields changed under us; the lock re-check would fail too
            tokens = self._data[pos:pos + tok_bytes].view(torch.int64).clone()
            features = self._data[pos + tok_bytes:pos + nbytes].view(self.dtype).view(T, self.feature_size).clone()
            if int(s["lock"]) != v1:
                return None
        return BufferEntry(key=bytes(row["key"][:row["key_len"]]).decode(), step=int(row["step"]),
                           policy_version=int(row["policy_version"]), finished=bool(row["finished"]),
                           prompt_len=int(row["prompt_len"]), tokens=tokens, features=features)

    def sample(self, n: int, *, step: int, offset_ratio: float, generator: torch.Generator) -> list[BufferEntry]:
        """Up to n entries: about (1 - offset_ratio) of step `step`'s finished ones, offset_ratio of step - 1's.

        The step - 1 share is drawn from its longest half by response length (at least as many as are
        needed), so repeated calls vary while staying long. When one side has too few, the other fills
        in; entries overwritten between listing and copying are dropped, so fewer may come back.
        Deterministic given the generator's state and the buffer's contents.
        """
        if n < 0 or not 0.0 <= offset_ratio <= 1.0:
            raise ValueError(f"sample needs n >= 0 and offset_ratio in [0, 1], got n={n}, offset_ratio={offset_ratio}")
        slots, rows = self._visible()  # filtered as arrays: only the candidates become EntryInfo objects
        cur, prev = (rows["step"] == step) & (rows["finished"] != 0), rows["step"] == step - 1
        current = self._infos_of(slots[cur], rows[cur])
        previous = sorted(self._infos_of(slots[prev], rows[prev]), key=lambda i: (-i.response_len, i.seq))
        n_prev = min(round(n * offset_ratio), len(previous))
        n_cur = min(n - n_prev, len(current))
        n_prev = min(n - n_cur, len(previous))
        pool = previous[:max(n_prev, math.ceil(len(previous) / 2))]
        picks = _choose(current, n_cur, generator) + _choose(pool, n_prev, generator)
        return [e for e in map(self.read, picks) if e is not None]

    def stats(self) -> dict[str, float]:
        _, rows = self._visible()
        used = int(rows["nbytes"].sum())
        return {"buffer/entries": float(len(rows)), "buffer/bytes": float(used),
                "buffer/fill": used / self.capacity_bytes, "buffer/capacity_bytes": float(self.capacity_bytes)}

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Detaches this process (the segment stays for the others)."""
        if self._fd < 0:
            return
        for attr in ("_data", "_slots", "_header", "_gate"):  # views export the mmap's buffer; drop them first
            self.__dict__.pop(attr, None)
        self._mm.close()
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        """Removes the segment (the creator, at exit) and detaches."""
        atexit.unregister(self.unlink)
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(self._path)
            if (st.st_dev, st.st_ino) == self._file_id:  # not a newer segment that reclaimed the name
                self._path.unlink()
        self.close()

    def __enter__(self) -> DataBuffer:
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self.unlink()
        else:
            self.close()


def _choose(items: list, k: int, generator: torch.Generator) -> list:
    perm = torch.randperm(len(items), generator=generator)[:k].tolist()
    return [items[i] for i in sorted(perm)]


def _make_odd(s: np.void) -> None:
    """Marks a slot as being written: the next odd value of its counter (a dead writer may have left it odd)."""
    v = int(s["lock"])
    s["lock"] = v + 1 if v % 2 == 0 else v + 2


def _round_up(x: int, k: int) -> int:
    return (x + k - 1) // k * k
