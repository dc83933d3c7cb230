"""Tests for engine.contract.rings: the shared-memory rings between the gateway and the engine."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from engine.contract import rings as ipc
from engine.contract import segments
from engine.contract.rings import AsyncRingReader, RecordTooLarge, RingClosed, RingSpec, ShmRing
from engine.runtime.outbox import Outbox

REPO = Path(__file__).resolve().parents[2]
SPAWN = mp.get_context("spawn")
CHUNK_SAMPLES = 8192  # int16 PCM chunk = 16 KiB


@pytest.fixture
def ring():
    r = ShmRing.create(4096)
    yield r
    r.close()
    r.unlink()


def _tail(ring: ShmRing) -> int:
    return ring._ctl[ipc._W_TAIL]  # the producer's monotonically increasing write position


def _shm_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


# --------------------------------------------------------------------------- same process


def test_roundtrip_header_and_payloads(ring: ShmRing) -> None:
    pcm = np.arange(-500, 500, dtype=np.int16)
    cases = [
        ({"type": "chunk", "req": "r1", "seq": 0, "sr": 44100}, pcm),
        ({"type": "started", "req": "r1", "meta": {"voice": "v", "ids": [1, 2]}}, None),
        ({"type": "empty"}, b""),
        ({"type": "bytes", "blob": b"\x00\xff"}, bytearray(b"abc")),
        ({"type": "view"}, memoryview(b"0123456789")[2:7]),
        ({"type": "2d"}, np.ones((3, 5), dtype=np.float32)),
    ]
    for header, payload in cases:
        assert ring.try_put(header, payload)
    for header, payload in cases:
        got_header, got_payload = ring.get()
        assert got_header == header
        if payload is None:
            assert got_payload is None
        else:
            assert isinstance(got_payload, bytes)
            assert got_payload == memoryview(payload).tobytes()
    assert ring.get() is None
    assert ring.empty() and ring.free_bytes() == ring.capacity
    got = np.frombuffer(_roundtrip(ring, {"x": 1}, pcm)[1], dtype=np.int16)
    assert np.array_equal(got, pcm)


def _roundtrip(ring: ShmRing, header: dict, payload: object) -> tuple:
    assert ring.try_put(header, payload)
    return ring.get()


def test_rejects_non_contiguous_payload(ring: ShmRing) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        ring.try_put({}, np.arange(100, dtype=np.int16)[::2])
    assert ring.empty()


def test_wraparound_many_variable_records() -> None:
    rng = random.Random(1234)
    with ShmRing.create(1000) as ring:  # 1000 is not a power of two: offsets land everywhere
        assert ring.capacity == 1000
        queue: list[tuple[int, int, bytes | None]] = []
        sent = received = split = 0
        while received < 5000:
            for _ in range(rng.randint(0, 6)):
                n = rng.choice([None, 0, rng.randint(1, 8), rng.randint(1, 400)])
                payload = None if n is None else rng.randbytes(n)
                before = _tail(ring) % ring.capacity
                if not ring.try_put({"i": sent, "crc": zlib.crc32(payload or b"")}, payload):
                    break
                after = _tail(ring) % ring.capacity
                split += after < before and after != 0  # record crossed the end of the data area
                queue.append((sent, zlib.crc32(payload or b""), payload))
                sent += 1
            for _ in range(rng.randint(0, 6)):
                rec = ring.get()
                if rec is None:
                    break
                header, payload = rec
                i, crc, expected = queue.pop(0)
                assert header == {"i": i, "crc": crc}
                assert payload == expected and zlib.crc32(payload or b"") == crc
                received += 1
        assert split > 100  # the split path was exercised many times
        assert _tail(ring) > 50 * ring.capacity  # positions went round many times


def test_full_ring_returns_false_and_recovers(ring: ShmRing) -> None:
    payload = bytes(500)
    n = 0
    while ring.try_put({"n": n}, payload):
        n += 1
    assert n == ring.capacity // ShmRing.record_size({"n": 0}, 500)
    tail = _tail(ring)
    free = ring.free_bytes()
    assert free < ShmRing.record_size({"n": n}, 500)
    assert not ring.try_put({"n": n}, payload)
    assert _tail(ring) == tail and ring.free_bytes() == free  # a refused put writes nothing
    assert ring.get()[0] == {"n": 0}
    assert ring.try_put({"n": n}, payload)  # room again after one read
    assert [ring.get()[0]["n"] for _ in range(n)] == list(range(1, n + 1))
    assert ring.get() is None


def test_record_larger_than_capacity_refused(ring: ShmRing) -> None:
    with pytest.raises(RecordTooLarge, match="exceeds ring capacity 4096"):
        ring.try_put({"type": "chunk"}, bytes(4096))
    assert ring.empty()
    # The largest record that can ever fit: exactly `capacity` bytes, also when split.
    assert ring.try_put({}, b"x" * 8)
    ring.get()
    biggest = ring.capacity - ShmRing.record_size({}, 0)
    assert ring.try_put({}, b"y" * biggest)
    assert not ring.try_put({}, None)
    assert ring.get() == ({}, b"y" * biggest)


def test_wait_timeout_and_pipe_doorbell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "eventfd")  # the fallback doorbell for platforms without eventfd
    with ShmRing.create(256) as ring:
        assert ring.spec().fds[0] != ring.spec().fds[1]
        t0 = time.monotonic()
        assert ring.wait(0.05) is False
        assert time.monotonic() - t0 >= 0.045
        for i in range(5000):  # more rings than a pipe holds: the producer must not block
            assert ring.try_put({"i": i}) or ring.get()
        assert ring.wait(0) is True


def test_outbox_keeps_order_and_bounds_backlog() -> None:
    with ShmRing.create(1024) as ring:
        box = Outbox(ring, max_bytes_per_key=2048)
        chunk = bytes(300)
        accepted = {"a": 0, "b": 0}
        for _ in range(20):
            for key in ("a", "b"):
                if box.put(key, {"req": key, "seq": accepted[key]}, chunk):
                    accepted[key] += 1
        assert 0 < box.pending_bytes("a") <= 2048 and accepted["a"] < 20  # budget hit: caller cancels
        assert box.put("a", {"req": "a", "type": "error"}, force=True)  # the final error still queues
        box.discard("b")
        got: list[dict] = []
        while box.flush() or not ring.empty():
            while (rec := ring.get()) is not None:
                got.append(rec[0])
        assert len(box) == 0 and box.pending_bytes() == 0
        a = [h for h in got if h["req"] == "a"]
        assert [h["seq"] for h in a[:-1]] == list(range(accepted["a"])) and a[-1]["type"] == "error"
        b = [h["seq"] for h in got if h["req"] == "b"]
        assert b == list(range(len(b)))  # b's records that made it kept their order


# --------------------------------------------------------------------------- asyncio


class _CountingRing(ShmRing):
    gets = 0

    def get(self):  # type: ignore[override]
        self.gets += 1
        return super().get()


def test_async_reader_wakes_on_put_without_polling() -> None:
    ring = _CountingRing.create(4096)
    try:

        async def main() -> list[float]:
            reader = AsyncRingReader(ring)
            latencies = []
            for i in range(3):
                # a producer thread puts after a pause; the reader sits in the event loop
                t = threading.Timer(0.1, ring.try_put, args=({"i": i, "t": time.perf_counter_ns()},))
                gets_before = ring.gets
                t.start()
                header, _ = await asyncio.wait_for(reader.get(), timeout=60)
                latencies.append((time.perf_counter_ns() - header["t"]) / 1e3)
                assert header["i"] == i
                assert ring.gets - gets_before <= 3  # woken by the doorbell, not by polling the ring
                t.join()
            pending = asyncio.ensure_future(reader.get())
            await asyncio.sleep(0)
            reader.close()
            with pytest.raises(RingClosed):
                await pending
            return latencies

        latencies = asyncio.run(main())
        assert len(latencies) == 3
    finally:
        ring.close()
        ring.unlink()


# --------------------------------------------------------------------------- cross process


def _echo_child(inbox: RingSpec, outbox: RingSpec) -> None:
    """Engine stand-in: echoes each record back with the payload's crc and timestamps."""
    rx, tx = ShmRing.attach(inbox), ShmRing.attach(outbox)
    try:
        while rx.wait(timeout=10):
            while (rec := rx.get()) is not None:
                header, payload = rec
                if header.get("op") == "stop":
                    return
                header["t_rx"] = time.perf_counter_ns()  # CLOCK_MONOTONIC: comparable across processes
                header["crc"] = zlib.crc32(payload) if payload is not None else None
                while True:
                    header["t_tx"] = time.perf_counter_ns()
                    if tx.try_put(header, payload):
                        break
                    time.sleep(0.0002)  # gateway behind: a real engine would use an Outbox
    finally:
        rx.close()
        tx.close()


@pytest.fixture(scope="module")
def echo():
    to_child, from_child = ShmRing.create(1 << 20), ShmRing.create(1 << 20)
    proc = SPAWN.Process(target=_echo_child, args=(to_child.spec(), from_child.spec()))
    proc.start()
    assert to_child.try_put({"op": "ping"})  # wait until the child is up: keep its startup out of timings
    assert from_child.wait(timeout=30) and from_child.get()[0]["op"] == "ping"
    yield to_child, from_child
    assert to_child.try_put({"op": "stop"})
    proc.join(10)
    assert proc.exitcode == 0
    for r in (to_child, from_child):
        r.close()
        r.unlink()
        assert not _shm_exists(r.name)


def test_spawn_echo_byte_exact_and_throughput(echo, capsys: pytest.CaptureFixture[str]) -> None:
    to_child, from_child = echo
    rng = np.random.default_rng(7)
    chunks = [rng.integers(-32768, 32767, CHUNK_SAMPLES, dtype=np.int16) for _ in range(16)]
    expected = [c.tobytes() for c in chunks]
    n = 2048  # 32 MiB each way
    sent = received = 0
    t0 = time.perf_counter()
    while received < n:
        progressed = False
        while sent < n and to_child.try_put({"seq": sent}, chunks[sent % 16], notify=False):
            sent += 1
            progressed = True
        to_child.notify()  # one doorbell per batch
        while (rec := from_child.get()) is not None:
            header, payload = rec
            assert header["seq"] == received
            assert payload == expected[received % 16]
            assert header["crc"] == zlib.crc32(expected[received % 16])
            received += 1
            progressed = True
        if not progressed:
            assert from_child.wait(timeout=60), "echo child stalled"
    elapsed = time.perf_counter() - t0
    mib = n * CHUNK_SAMPLES * 2 / (1 << 20)
    with capsys.disabled():
        print(
            f"\n[ipc] spawn echo: {n} x {CHUNK_SAMPLES}-sample int16 chunks ({mib:.0f} MiB each way) in "
            f"{elapsed * 1e3:.0f} ms: {mib / elapsed:.0f} MiB/s round trip, {n / elapsed:.0f} chunks/s"
        )


def test_spawn_wakeup_latency_with_async_reader(echo, capsys: pytest.CaptureFixture[str]) -> None:
    to_child, from_child = echo

    async def main() -> tuple[list[int], list[int], list[int]]:
        reader = AsyncRingReader(from_child)
        to_engine, to_gateway, rtt = [], [], []
        try:
            for i in range(200):
                await asyncio.sleep(0.0005)  # let the child go back to sleep on its doorbell
                t_put = time.perf_counter_ns()
                assert to_child.try_put({"seq": i, "t_put": t_put}, b"\x01" * 64)
                header, payload = await asyncio.wait_for(reader.get(), timeout=60)
                t_wake = time.perf_counter_ns()
                assert header["seq"] == i and payload == b"\x01" * 64
                to_engine.append(header["t_rx"] - t_put)
                to_gateway.append(t_wake - header["t_tx"])
                rtt.append(t_wake - t_put)
        finally:
            reader.close()
        return to_engine, to_gateway, rtt

    to_engine, to_gateway, rtt = asyncio.run(main())

    def us(xs: list[int]) -> str:
        qs = statistics.quantiles(xs, n=100)
        return f"p50 {statistics.median(xs) / 1e3:.0f} us, p99 {qs[98] / 1e3:.0f} us"

    with capsys.disabled():
        print(
            f"\n[ipc] wakeup put->reader: gateway->engine (poll wait) {us(to_engine)}; "
            f"engine->gateway (asyncio add_reader) {us(to_gateway)}; round trip {us(rtt)}"
        )


def _race_payload(i: int) -> bytes:
    return bytes([i % 251]) * (i * 7919 % 49)


def _burst_producer(spec: RingSpec, n: int, seed: int) -> None:
    """Puts n small records in bursts, each one right as the consumer heads back to sleep.

    Before each burst it waits (spinning) until the consumer has emptied the ring, then
    puts after a random few microseconds: the put lands anywhere in the consumer's
    "found it empty -> go to sleep" sequence. A lost wakeup is a deadlock here (the
    consumer sleeps, the producer waits for it), which the consumer's timeout reports.
    """
    ring = ShmRing.attach(spec)
    rng = random.Random(seed)
    i = 0
    while i < n:
        deadline = time.monotonic() + 30
        while not ring.empty() and time.monotonic() < deadline:
            pass
        for _ in range(rng.randint(0, 30)):  # jitter
            pass
        for _ in range(min(rng.choice([1, 1, 1, 2, 3, 40]), n - i)):
            while not ring.try_put({"i": i}, _race_payload(i)):
                time.sleep(0.00005)  # full: let the consumer catch up
            i += 1
    ring.close()


@pytest.mark.parametrize("mode", ["wait-eventfd", "asyncio-pipe"])
def test_no_lost_wakeup_under_race(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode.endswith("pipe"):
        monkeypatch.delattr(os, "eventfd")
    n, seed = (20000 if mode.startswith("wait") else 10000), 99
    ring = ShmRing.create(2048)  # small: the producer also hits "full" and wraps constantly
    proc = SPAWN.Process(target=_burst_producer, args=(ring.spec(), n, seed))
    proc.start()
    got: list[tuple[int, bytes]] = []
    try:
        if mode.startswith("wait"):
            while len(got) < n:
                t0, limit = time.monotonic(), (20 if got else 60)  # the first one waits for the child to start
                woke = ring.wait(timeout=limit)
                # The producer waits for us before each burst: a missed doorbell stalls for good (the
                # ceiling is generous so that a loaded machine's scheduling delay is not taken for one).
                assert woke and time.monotonic() - t0 < limit, f"lost wakeup after {len(got)} records"
                while (rec := ring.get()) is not None:
                    got.append((rec[0]["i"], rec[1]))
        else:

            async def main() -> None:
                reader = AsyncRingReader(ring)
                try:
                    while len(got) < n:
                        batch = await asyncio.wait_for(reader.get_batch(), timeout=20 if got else 60)
                        got.extend((h["i"], p) for h, p in batch)
                finally:
                    reader.close()

            asyncio.run(main())
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ring.close()
        ring.unlink()
    assert [i for i, _ in got] == list(range(n))
    assert all(p == _race_payload(i) for i, p in got)


# --------------------------------------------------------------------------- cleanup


def test_unlink_removes_segment() -> None:
    ring = ShmRing.create(4096)
    name = ring.name
    assert _shm_exists(name)
    rfd, wfd = ring.spec().fds
    dup = os.dup(rfd)
    other = ShmRing.attach(RingSpec(name, ring.capacity, (dup, dup if rfd == wfd else os.dup(wfd))))
    assert ring.try_put({"a": 1}, b"x") and other.get() == ({"a": 1}, b"x")
    other.close()  # closing an attached ring leaves the segment alone
    assert _shm_exists(name)
    ring.close()  # views released: no BufferError
    ring.close()
    ring.unlink()
    assert not _shm_exists(name)
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(ring.spec())


_SPAWN_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
import multiprocessing as mp
from engine.contract.rings import ShmRing

def child(spec):
    ring = ShmRing.attach(spec)
    assert ring.wait(60)
    assert ring.get() == ({{"hello": 1}}, b"pcm")
    ring.close()

if __name__ == "__main__":
    ring = ShmRing.create(4096)
    proc = mp.get_context("spawn").Process(target=child, args=(ring.spec(),))
    proc.start()
    ring.try_put({{"hello": 1}}, b"pcm")
    proc.join(10)
    assert proc.exitcode == 0, proc.exitcode
    # the child exited: the segment must still be there for the owner
    import os; assert os.path.exists("/dev/shm/" + ring.name.lstrip("/"))
    ring.close()
    ring.unlink()
    print("OK", ring.name)
"""


def test_spawn_child_exit_leaves_no_tracker_noise(tmp_path: Path) -> None:
    script = tmp_path / "spawn_cleanup.py"
    script.write_text(textwrap.dedent(_SPAWN_SCRIPT.format(repo=str(REPO))))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK")
    assert res.stderr == ""  # no resource_tracker "leaked" warning, no KeyError from it
    assert not _shm_exists(res.stdout.split()[1])


def test_unrelated_process_attach_does_not_unlink(ring: ShmRing) -> None:
    # A child started with subprocess has its own resource tracker. On Python < 3.13 a tracked
    # attach makes that tracker unlink the segment when the child exits (and warn of a leak).
    spec = ring.spec()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from engine.contract.rings import RingSpec, ShmRing
        ring = ShmRing.attach(RingSpec({spec.name!r}, {spec.capacity}, {spec.fds!r}))
        assert ring.try_put({{"from": "child"}}, b"abc")
        ring.close()
    """)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, pass_fds=set(spec.fds)
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert _shm_exists(ring.name)
    assert ring.wait(30) and ring.get() == ({"from": "child"}, b"abc")


# ---- the engine's lifeline: an orphan cleans up and exits (engine/contract/lifeline.py) ---------------------------
_ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
import multiprocessing as mp
from engine.contract.rings import ShmRing
from engine.contract.segments import unlink_segment
from engine.contract.lifeline import close_quietly, open_lifeline, watch_parent

def engine(lifeline, name, ready):  # what engine_main does first
    watch_parent(lifeline, lambda: unlink_segment(name))
    open(ready, "w").close()  # watching: without a lifeline the parent's pid was read just now
    time.sleep(600)

if __name__ == "__main__":
    ring = ShmRing.create(4096)
    lifeline, keep = open_lifeline()
    proc = mp.get_context("spawn").Process(target=engine, args=({use_pipe} and lifeline or None, ring.name,
                                           {ready!r}), daemon=True)
    proc.start()
    close_quietly(lifeline.fd)
    print(proc.pid, ring.name, flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # zombie: gone
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("use_pipe", [True, False], ids=["pipe", "ppid"])
def test_orphaned_engine_unlinks_its_rings_and_exits(tmp_path: Path, use_pipe: bool) -> None:
    """SIGKILL the 'gateway': its child notices (EOF on the lifeline pipe, or, without one, a new parent
    pid), unlinks the ring and exits; the ring's creator never got to clean up."""
    script = tmp_path / "orphan.py"
    ready = tmp_path / "watching"
    script.write_text(textwrap.dedent(_ORPHAN_SCRIPT.format(repo=str(REPO), use_pipe=use_pipe, ready=str(ready))))
    gw = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert gw.stdout is not None
        pid_s, name = gw.stdout.readline().split()
        child = int(pid_s)
        assert _shm_exists(name) and not _gone(child)
        # the child watches its parent once it has started (a spawned interpreter: seconds on a busy machine); a
        # parent killed before that is one the pid fallback cannot see (the lifeline pipe can: engines get one)
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and not _gone(child), "the child never started watching"
            time.sleep(0.05)
        time.sleep(0.5)
        assert not _gone(child)  # a live gateway keeps its engine
        gw.kill()
        gw.wait(10)
        deadline = time.monotonic() + 60
        while not (_gone(child) and not _shm_exists(name)):
            assert time.monotonic() < deadline, "the orphan kept running or left its ring"
            time.sleep(0.05)
    finally:
        if gw.poll() is None:
            gw.kill()
    stderr = gw.stderr.read() if gw.stderr else ""
    assert "leaked shared_memory" not in stderr, stderr  # unregistered from the tracker, not reported as leaked


def test_stale_rings_of_dead_creators_are_removed() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    pid = int(dead.stdout)  # a pid that no longer runs (reuse within the test is vanishingly unlikely)
    mine = ShmRing.create(4096)
    stale = ShmRing.create(4096, name=f"zonos-{pid}-deadbeef")
    stale.close()
    try:
        assert f"zonos-{pid}-deadbeef" not in segments.remove_stale_segments()  # too young: perhaps attaching now
        removed = segments.remove_stale_segments(min_age_s=0)
        assert f"zonos-{pid}-deadbeef" in removed and not _shm_exists(f"zonos-{pid}-deadbeef")
        assert _shm_exists(mine.name)  # a live creator's ring stays
    finally:
        mine.close()
        mine.unlink()
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def test_removing_a_dead_gateways_rings_prints_nothing() -> None:
    """A starting gateway removes what a killed one left, with one log line and no KeyError tracebacks from
    the resource tracker (which never knew those segments)."""
    from multiprocessing import resource_tracker, shared_memory

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    name = f"zonos-{int(dead.stdout)}-cafe0001"
    seg = shared_memory.SharedMemory(name, create=True, size=64)
    resource_tracker.unregister(seg._name, "shared_memory")  # left behind: no live tracker knows it
    seg.close()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import logging; logging.basicConfig(level='INFO')\n"
                "from app.core.engine_client import sweep_stale_rings\n"
                "from engine.contract import segments\n"
                "segments.remove_stale_segments.__defaults__ = (0.0,)\n"
                "sweep_stale_rings()",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert not _shm_exists(name)
        assert "Traceback" not in out.stderr and "KeyError" not in out.stderr, out.stderr
        assert out.stderr.count("removed") == 1, out.stderr
    finally:
        with contextlib.suppress(FileNotFoundError):
            _posixshmem_unlink(name)


def _posixshmem_unlink(name: str) -> None:
    import _posixshmem

    _posixshmem.shm_unlink("/" + name)
