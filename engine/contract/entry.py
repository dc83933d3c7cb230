"""The engine process's entry point: the spawn target the gateway names. It lives in the contract because both
processes import it: the gateway to name it (torch-free: the engine's modules are imported inside), the engine to run."""

from __future__ import annotations

import logging
import os

from engine.contract import records as m
from engine.contract.errors import EngineError as E
from engine.contract.lifeline import Lifeline, watch_parent
from engine.contract.rings import RingSpec, ShmRing
from engine.contract.segments import unlink_segment
from engine.contract.settings import EngineSettings, WeightSources

log = logging.getLogger("engine")


def engine_main(src: WeightSources, settings: EngineSettings, inbox_spec: RingSpec, outbox_spec: RingSpec,
                log_level: str = "INFO", lifeline: Lifeline | None = None) -> None:
    """Entry point of the engine process (multiprocessing 'spawn' target). When the gateway that
    started it dies (`lifeline`, engine/contract/lifeline.py), the engine unlinks both rings and exits."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    watch_parent(lifeline, lambda: [unlink_segment(s.name) for s in (inbox_spec, outbox_spec)])
    import torch  # here, in the spawned process: the gateway imports this module without torch

    from engine.runtime.engine import Engine
    from engine.runtime.scheduler import Scheduler

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    inbox, out_ring = ShmRing.attach(inbox_spec), ShmRing.attach(outbox_spec)
    try:
        engine = Engine(src, settings)
        warmup_s = engine.warmup()
        scheduler = Scheduler(engine, inbox, out_ring)
    except Exception as e:
        log.exception("engine failed to start")
        out_ring.try_put(*m.Error(None, E.ENGINE_START_FAILED, str(e)).encode())
        raise SystemExit(1) from e
    ready = m.Ready(**engine.describe(), warmup_s=round(warmup_s, 3))
    log.info("engine ready: %s", ready.info())
    scheduler.outbox.send("ready", ready, force=True)
    scheduler.outbox.flush()
    scheduler.run()
    scheduler.outbox.flush()
    log.info("engine stopped")
