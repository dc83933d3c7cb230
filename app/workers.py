"""Several gateway processes in front of the engines (`--workers N`, docs/architecture.md "Gateway
processes"): one event loop is a core, and a storm of clients (their clips to decode, their audio to encode)
needs more than one.

With N > 1 the process started by `python -m app` becomes the supervisor. It owns the engine processes (one per
device) and their rings, one channel (a requests ring and an events ring) per gateway process, and it runs
the N gateway processes, each a full gateway (uvicorn + the app) accepting on one listening socket that the
supervisor opens and hands to each (`listening_socket`). Each gateway process numbers its requests in
its own residue class (rid % N), so the engine routes every event to the right channel without a table.

What they share: the session limit and the door's counts (app/core/shared.py: each process's open sessions,
held conversations and open requests per engine, in shared memory), the voice library (the folder, in its
shared mode), the requests kept for request stitching (files in the data dir), API keys and settings (the same
flags), the metrics (prometheus_client's multiprocess files: any process answers /metrics for all), and the
engines' admission (the engine decides for every channel).

Failures stay local. An engine that dies is restarted by the supervisor, which tells every gateway process
(`down`, then `attach` with the new rings, app/core/engine_client.py ControlLink). A gateway process that
dies takes only its own sessions: the supervisor zeroes its row of the shared counts, writes a `reset` on its
channel (the engine cancels its requests and frees their slots) and starts a new one in its place, whose
request ids are a fresh range.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from app.core.engine_client import RING_BYTES, spawn_engine
from app.core.gateway import engine_settings
from app.core.shared import SharedCounts
from app.settings import GatewaySettings, usable_cpus
from engine.contract import records as m
from engine.contract.cpus import gateway_cpus, pin
from engine.contract.lifeline import Lifeline, close_quietly, open_lifeline, watch_parent
from engine.contract.rings import ShmRing
from engine.contract.segments import remove_stale_segments

log = logging.getLogger("gateway.supervisor")

RESTART_BACKOFF_S = (0.5, 5.0)  # a process that keeps dying is restarted after 0.5 s, 1 s, ... at most 5 s
STABLE_S = 60.0  # a process that ran this long before it died is restarted as if it had never died before


def restart_delay(restarts: int) -> float:
    """How long after its `restarts`-th death in a row a process is started again."""
    return min(RESTART_BACKOFF_S[0] * restarts, RESTART_BACKOFF_S[1])


def default_workers() -> int:
    """Gateway processes by default: one per four CPUs this process may run on (its affinity: a container's
    or taskset's CPUs, not the host's; the engine's loop, the normalization workers and the kernel's network
    work need the rest), at least one, at most eight."""
    return max(1, min(8, usable_cpus() // 4))


LISTEN_BACKLOG = 2048  # uvicorn's own default: connections the kernel queues until a process accepts them


def listening_socket(host: str, port: int) -> socket.socket:
    """The one listening socket of every gateway process. A connection waits in its queue until a process
    accepts it, so the first process free to do so takes it: one that is busy (a collector pass, a burst of
    audio to send), stopped or dead holds no connection back, as it would with a socket of its own per process
    (SO_REUSEPORT spreads connections by their addresses, whatever each process is doing, and a dead process's
    socket resets the connections in its queue); a process started in a dead one's place accepts at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


class EngineProcess:
    """The supervisor's side of one engine process: its channels (one per gateway process) and restarts."""

    def __init__(self, settings: GatewaySettings, index: int, channels: int) -> None:
        self.settings = settings
        self.index = index
        self.device, self.engine, self.env = engine_settings(settings)[index]
        self.channels = channels
        self.rings: list[tuple[ShmRing, ShmRing]] = []
        self.proc: mp.process.BaseProcess | None = None
        self.restarts = 0
        self.started = 0.0  # time.monotonic() of its last spawn
        self._lifeline_w: int | None = None

    def spawn(self) -> None:
        self.started = time.monotonic()
        self.rings = [(ShmRing.create(RING_BYTES), ShmRing.create(RING_BYTES)) for _ in range(self.channels)]
        specs = [(inbox.spec(), events.spec()) for inbox, events in self.rings]
        self.proc, self._lifeline_w = spawn_engine(
            self.settings.weights, self.engine, specs, self.settings.log_level, f"zonos-engine-{self.index}", self.env
        )
        log.info(
            "engine %d (%s): process %s started with %d channels", self.index, self.device, self.proc.pid, self.channels
        )

    def attach_message(self, channel: int) -> tuple[Any, ...]:
        assert self.proc is not None
        inbox, events = self.rings[channel]
        return ("attach", self.index, inbox.spec(), events.spec(), self.proc.pid)

    def reset(self, channel: int) -> None:
        """A gateway process on `channel` died: the engine cancels its requests. The supervisor writes in its
        place (the ring has one writer at a time: the dead process wrote last)."""
        if self.rings and self.alive:
            self.rings[channel][0].try_put(*m.Reset().encode())

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def stop(self, timeout: float) -> None:
        """Every gateway process is gone: ask the engine to stop, then make sure it has."""
        if self.alive and self.rings:
            self.rings[0][0].try_put(*m.Shutdown().encode())
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.teardown()

    def teardown(self) -> None:
        close_quietly(self._lifeline_w)
        self._lifeline_w = None
        for pair in self.rings:
            for ring in pair:
                with contextlib.suppress(Exception):
                    ring.close()
                    ring.unlink()
        self.rings = []


class GatewayProcess:
    """One gateway process (channel `index` of every engine) and its control line."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnation = 0
        self.proc: mp.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.restarts = 0
        self.started = 0.0  # time.monotonic() of its last spawn
        self._lifeline_w: int | None = None

    def spawn(self, settings: GatewaySettings, workers: int, counts: SharedCounts, listener: socket.socket) -> None:
        self.started = time.monotonic()
        ctx = mp.get_context("spawn")
        child, self.conn = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        lifeline, lifeline_w = open_lifeline()
        self.proc = ctx.Process(
            target=gateway_process_main,
            args=(settings, listener, self.index, workers, self.incarnation, child, counts, lifeline),
            name=f"zonos-gateway-{self.index}",
            daemon=False,
        )
        self.proc.start()
        child.close()
        close_quietly(lifeline.fd)
        self._lifeline_w = lifeline_w
        log.info("gateway process %d: pid %s (incarnation %d)", self.index, self.proc.pid, self.incarnation)

    def tell(self, message: tuple[Any, ...]) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(message)

    def reaped(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        close_quietly(self._lifeline_w)
        self.incarnation += 1


def serve_workers(settings: GatewaySettings, workers: int) -> int:
    """The supervisor: start the engines and `workers` gateway processes, keep them running until SIGTERM or
    SIGINT, then stop them all. Returns the exit code."""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stale = remove_stale_segments()
    if stale:
        log.warning("removed %d shared-memory rings left by dead gateways", len(stale))
    # one listening socket for all, opened here (a port in use fails now, with one message)
    try:
        listener = listening_socket(settings.host, settings.port)
    except OSError as e:
        log.error("cannot bind %s:%s: %s", settings.host, settings.port, e)
        return 3
    port = listener.getsockname()[1]
    # the processes' metrics in files that any of them reads for /metrics (prometheus_client multiprocess)
    metrics_dir = tempfile.mkdtemp(prefix="zonos-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    engines = [EngineProcess(settings, i, workers) for i in range(len(engine_settings(settings)))]
    counts = SharedCounts(workers, len(engines), len(settings.api_keys))  # (a column per key: --max-sessions-per-key)
    gateways = [GatewayProcess(i) for i in range(workers)]
    print(
        f"zonos-gateway: serving on http://{settings.host}:{port} with {workers} gateway processes (demo page at /)",
        flush=True,
    )
    try:
        for engine in engines:
            engine.spawn()
        for g in gateways:
            if stopping:  # a SIGTERM while they start: start no more
                break
            g.spawn(settings, workers, counts, listener)
            for engine in engines:
                g.tell(engine.attach_message(g.index))
        # a dead process is started again once its delay has passed (`restart_delay`); meanwhile the supervisor
        # keeps watching the others, so a second death is handled at once, not after the first one's delay
        due: dict[EngineProcess | GatewayProcess, float] = {}
        while not stopping:
            now = time.monotonic()
            for who, at in list(due.items()):
                if at <= now:
                    del due[who]
                    if isinstance(who, EngineProcess):
                        _start_engine(who, gateways)
                    else:
                        _start_gateway(who, engines, settings, workers, counts, listener)
            watched: list[EngineProcess | GatewayProcess] = [*engines, *gateways]
            sentinels = {w.proc.sentinel: w for w in watched if w.proc is not None and w not in due}
            timeout = min([0.5, *(at - now for at in due.values())])
            for s in wait(list(sentinels), timeout=max(0.0, timeout)):
                if stopping:
                    break
                who = sentinels[s]  # type: ignore[index]  # wait() returns the sentinels it was given
                if isinstance(who, EngineProcess):
                    due[who] = time.monotonic() + _engine_died(who, gateways)
                else:
                    due[who] = time.monotonic() + _gateway_died(who, engines, counts, metrics_dir)
    finally:
        for g in gateways:
            if g.proc is not None and g.proc.is_alive():
                g.proc.terminate()  # it drains, then its sessions end and its engine work is cancelled
        deadline = time.monotonic() + settings.limits.drain_timeout_s + 15  # each drains (app/server.py), then stops
        for g in gateways:
            if g.proc is not None:
                g.proc.join(max(0.1, deadline - time.monotonic()))
                if g.proc.is_alive():
                    g.proc.kill()
                    g.proc.join(5)
        for engine in engines:
            engine.stop(timeout=10)
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _died(who: EngineProcess | GatewayProcess) -> float:
    """Count a death in a row (none before it if the process had run STABLE_S): the delay before its restart."""
    who.restarts = 1 if time.monotonic() - who.started >= STABLE_S else who.restarts + 1
    return restart_delay(who.restarts)


def _engine_died(engine: EngineProcess, gateways: list[GatewayProcess]) -> float:
    """Tell every gateway process the engine is down and free its rings; the delay before its restart."""
    assert engine.proc is not None
    engine.proc.join(1)
    code = engine.proc.exitcode
    log.error("engine %d process exited with code %s; restarting it", engine.index, code)
    for g in gateways:
        g.tell(("down", engine.index, f"engine {engine.index} process stopped (exit code {code}); it is restarting"))
    engine.teardown()
    return _died(engine)


def _start_engine(engine: EngineProcess, gateways: list[GatewayProcess]) -> None:
    engine.spawn()
    for g in gateways:
        g.tell(engine.attach_message(g.index))


def _gateway_died(g: GatewayProcess, engines: list[EngineProcess], counts: SharedCounts, metrics_dir: str) -> float:
    """End what the dead gateway process held (its counts, its engine requests, its metrics); the delay before
    its restart."""
    assert g.proc is not None
    g.proc.join(1)
    pid, code = g.proc.pid, g.proc.exitcode
    log.error(
        "gateway process %d (pid %s) exited with code %s; its sessions ended, starting another", g.index, pid, code
    )
    counts.clear(g.index)  # its sessions, holds and requests ended with it: no other process counts them now
    for engine in engines:
        engine.reset(g.index)
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)
    g.reaped()
    return _died(g)


def _start_gateway(
    g: GatewayProcess,
    engines: list[EngineProcess],
    settings: GatewaySettings,
    workers: int,
    counts: SharedCounts,
    listener: socket.socket,
) -> None:
    g.spawn(settings, workers, counts, listener)
    for engine in engines:
        if engine.alive:
            g.tell(engine.attach_message(g.index))


def gateway_process_main(
    settings: GatewaySettings,
    listener: socket.socket,
    channel: int,
    channels: int,
    incarnation: int,
    conn: Connection,
    counts: SharedCounts,
    lifeline: Lifeline,
) -> None:
    """One gateway process (multiprocessing's spawn target): the app on the supervisor's listening socket (a
    copy of its descriptor, `listening_socket`), its engines attached through `conn`. It exits when the
    supervisor is gone."""
    if settings.engine.cpu_set is not None:  # --engine-cpus: off the engines' CPUs, before any thread or pool starts
        pin(gateway_cpus(settings.engine.cpu_set))
    logging.basicConfig(
        level=settings.log_level, format=f"%(asctime)s gateway-{channel} %(name)s %(levelname)s %(message)s"
    )
    watch_parent(lifeline, lambda: None)
    from app.core.engine_client import ControlLink
    from app.server import create_app, run_server

    counts.clear(channel)  # a process in a dead one's place starts from zero, whatever that one left
    link = ControlLink(conn, channel, channels, incarnation, counts)
    app = create_app(settings, link)
    run_server(app, settings, listener)
