"""The engine process's entry point (engine/contract/process.py names it for the gateway, which never
imports torch)."""

from __future__ import annotations

import logging
import os
import signal

from engine.contract import records as m
from engine.contract.cpus import pin
from engine.contract.errors import EngineError as E
from engine.contract.lifeline import Lifeline, watch_parent
from engine.contract.rings import RingSpec, ShmRing
from engine.contract.segments import unlink_segment
from engine.contract.settings import EngineSettings, WeightSources, usable_cpus

log = logging.getLogger("engine")


def engine_main(
    src: WeightSources,
    settings: EngineSettings,
    channels: list[tuple[RingSpec, RingSpec]],
    log_level: str = "INFO",
    lifeline: Lifeline | None = None,
) -> None:
    """Run the engine over its channels: one (requests, events) ring pair per gateway process. When the
    process that started it dies (`lifeline`, engine/contract/lifeline.py), the engine unlinks every ring
    and exits."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    if settings.cpu_set is not None:  # --engine-cpus: before any thread starts, so that every one runs there
        try:
            pin(settings.cpu_set)
        except OSError as e:
            log.error("engine cannot run on --engine-cpus %s: %s", settings.cpus, e)
            raise SystemExit(1) from e
    watch_parent(lifeline, lambda: [unlink_segment(s.name) for pair in channels for s in pair])
    # Before torch loads its OpenMP runtime, which reads this once: an idle OpenMP thread spins (GOMP_SPINCOUNT
    # 300000) before it sleeps, holding a core that the host's gateway processes (or, on a CPU, the thread with
    # the work) need; passive threads sleep at once (tests/conftest.py measured the same speed on idle cores)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # here, in the spawned process: the gateway imports this module without torch

    from engine.runtime.engine import Engine
    from engine.runtime.scheduler import Scheduler

    torch.set_num_threads(max(1, usable_cpus() // 2))
    inboxes = [ShmRing.attach(spec) for spec, _ in channels]
    out_rings = [ShmRing.attach(spec) for _, spec in channels]
    try:
        engine = Engine(src, settings)
        warmup_s = engine.warmup()
        scheduler = Scheduler(engine, inboxes, out_rings)
    except Exception as e:
        log.exception("engine failed to start")
        for ring in out_rings:
            ring.try_put(*m.Error(None, E.ENGINE_START_FAILED, str(e)).encode())
        raise SystemExit(1) from e
    ready = m.Ready(**engine.describe(), warmup_s=round(warmup_s, 3))
    log.info("engine ready: %s", ready.info())
    scheduler.intake.ready = ready  # said again to a gateway process that resets its channel
    scheduler.outbox.send("ready", ready, force=True)
    scheduler.outbox.flush()
    # Ready, it is stopped by its gateway (a Shutdown record) or with it (the lifeline): a SIGTERM sent to the whole
    # process group (systemd, a terminal) must leave it serving while the gateway drains (app/server.py)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    scheduler.run()
    scheduler.outbox.flush()
    log.info("engine stopped")
