"""Text normalization off the event loop and out of the gateway process: a pool of worker processes.

NeMo's grammars normalize one text per process at a time, at up to ~1 s of CPU for 300 bytes of
digits, and hold a few hundred MB per loaded language. In the gateway's own process that serialized
every session behind one lock and grew its memory for good. Here:

* Each worker process (`workers`, default: the CPUs this process may use, at most 16) holds its own grammars (the
  warm languages are loaded when it starts, others on first use) and normalizes one text at a time, so
  texts normalize in parallel up to the cores given.
* One text may take `cpu_limit_s` of CPU in its worker (loading the grammar excluded). Past it the
  kernel ends the worker (a CPU-time interval timer whose signal keeps its default action, which needs
  no Python, so it ends a worker stuck inside pynini's C code too), pebble starts another, and the
  request gets `normalization_timeout`. CPU time rather than wall time: a busy machine does not fail
  texts that merely wait for a core.
* The workers are replaced after `max_tasks` texts each (on average), so whatever their grammars accumulate is
  given back: a successor pool starts and loads the warm grammars (seconds) while the old one serves, takes over
  once it is ready, and the old workers finish what they hold and exit. Replaced by pebble one by one instead,
  every worker reached its count within a few texts of the others and reloaded at the same moment: no text was
  normalized, and no session spoke, for the grammars' load (de ~12 s), every `max_tasks` texts per worker.
* Waiting texts go to the workers fairly (FairTurns): the owner (a session, an HTTP request) that has
  used the workers least goes first, so a new session's first sentence is next whatever others have
  queued; and with two workers or more, texts longer than SHORT_TEXT_BYTES, and texts of a language no
  worker has loaded yet (its grammar's compile: minutes), never hold the last free worker, so a short one (a
  typical first sentence, ~30 ms) never waits behind a long one (up to ~1 s for 300 bytes of digits).
* With one worker there is no other to leave free: a text of a language it did not load at start (`warm`:
  English and `--normalization-language`) is spoken as written, since loading that grammar (up to ~12 s from
  the cache, minutes to compile) would hold every session's text behind it.

pebble (not concurrent.futures) because a worker that dies or is stopped fails only its own task and is
replaced, where ProcessPoolExecutor breaks the whole pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import pebble

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.settings import MAX_DEFAULT_NORMALIZATION_WORKERS, usable_cpus

log = logging.getLogger("gateway.textnorm")

T = TypeVar("T")

# A wall-clock bound on one task, the grammar's first compile included (de, es: up to 4 min on 2 cores):
# only a worker that hangs without using CPU ever reaches it.
TASK_WALL_LIMIT_S = 900.0
_CPU_SIGNAL = signal.SIGPROF  # ITIMER_PROF: user + system CPU time of the worker process


def default_workers() -> int:
    """The CPUs this process may run on, at most MAX_DEFAULT_NORMALIZATION_WORKERS."""
    return max(1, min(usable_cpus(), MAX_DEFAULT_NORMALIZATION_WORKERS))


def nemo_installed() -> bool:
    """Whether a worker could normalize at all, known without importing NeMo here."""
    return all(importlib.util.find_spec(m) is not None for m in ("nemo_text_processing", "pynini"))


# ---- in the worker process ----------------------------------------------------------------------------
@contextlib.contextmanager
def cpu_bound(seconds: float) -> Iterator[None]:
    """End this process (SIGPROF, default action) if the block uses more than `seconds` of CPU."""
    signal.signal(_CPU_SIGNAL, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


WORKER_NICENESS = 5  # a flood of texts must not take the CPU the event loop and the engine's loop need


def _worker_start(warm: tuple[str, ...]) -> None:
    from engine.frontend.textnorm import get_normalizer

    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)

    if warm:
        get_normalizer().warm(warm)


def normalize_in_worker(text: str, language: str, cpu_limit_s: float) -> str:
    """The worker's task: load the language's grammar (unbounded: it is the same for every text), then
    normalize within the CPU bound."""
    from engine.frontend.textnorm import get_normalizer, normalize_language

    norm = get_normalizer()
    with contextlib.suppress(ValueError):  # an unknown language: normalize() returns the text as it is
        norm.warm([normalize_language(language)])
    with cpu_bound(cpu_limit_s):
        return norm.normalize(text, language)


# ---- in the gateway -----------------------------------------------------------------------------------
SHORT_TEXT_BYTES = 100  # texts up to this size may take the last free worker


def _grammar(code: str) -> str | None:
    """The grammar a language's texts load (en_us and en_gb share one); None: no language of ours, whose text a
    worker gives back at once, as written."""
    from engine.frontend.textnorm import NEMO_LANGUAGE, normalize_language

    try:
        return NEMO_LANGUAGE[normalize_language(code)]
    except ValueError:
        return None


@dataclass(eq=False)
class _Waiter:
    owner: object
    long: bool
    seq: int
    ticket: asyncio.Future[None]


class FairTurns:
    """Who gets the next free worker. The waiting text whose owner has used the workers least (seconds of
    worker time, counted while the owner has texts waiting or running) goes first, earliest first among
    equals; with more than one worker, long texts leave one worker to short ones."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.active = 0
        self.active_long = 0
        self._waiting: list[_Waiter] = []
        self._running: dict[object, int] = {}
        self._used: dict[object, float] = {}  # owner -> worker seconds, while it has texts here
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _may_run(self, long: bool) -> bool:
        if self.active >= self.workers:
            return False
        return not long or self.workers == 1 or self.active_long < self.workers - 1

    @contextlib.asynccontextmanager
    async def turn(self, owner: object, long: bool) -> AsyncIterator[None]:
        """Hold a worker for the block (after waiting for it)."""
        w = _Waiter(owner, long, next(self._seq), asyncio.get_running_loop().create_future())
        self._waiting.append(w)
        self._dispatch()
        try:
            await w.ticket
        except asyncio.CancelledError:
            if w.ticket.done() and not w.ticket.cancelled():  # given just now: give it back
                self._release(owner, long, 0.0)
            else:
                self._waiting.remove(w)
                self._forget(owner)
            raise
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._release(owner, long, time.monotonic() - t0)

    def _take(self, owner: object, long: bool) -> None:
        self.active += 1
        self.active_long += long
        self._running[owner] = self._running.get(owner, 0) + 1
        self._used.setdefault(owner, 0.0)

    def _release(self, owner: object, long: bool, seconds: float) -> None:
        self.active -= 1
        self.active_long -= long
        self._running[owner] -= 1
        if not self._running[owner]:
            del self._running[owner]
        self._used[owner] = self._used.get(owner, 0.0) + seconds
        self._forget(owner)
        self._dispatch()

    def _forget(self, owner: object) -> None:
        if owner not in self._running and not any(w.owner is owner for w in self._waiting):
            self._used.pop(owner, None)

    def _dispatch(self) -> None:
        while self._waiting:
            # (a waiter cancelled a moment ago leaves the list itself, in turn()'s handler)
            runnable = [w for w in self._waiting if not w.ticket.done() and self._may_run(w.long)]
            if not runnable:
                return
            w = min(runnable, key=lambda w: (self._used.get(w.owner, 0.0), w.seq))
            self._waiting.remove(w)
            self._take(w.owner, w.long)
            w.ticket.set_result(None)


class NormalizationPool:
    """Worker processes that normalize text; `normalize` is what the gateway awaits."""

    def __init__(
        self,
        workers: int,
        cpu_limit_s: float,
        max_tasks: int,
        warm: tuple[str, ...] = ("en_us",),
        available: bool | None = None,
        start_worker: Callable[[tuple[str, ...]], None] = _worker_start,
    ) -> None:
        self.workers = max(1, workers)
        self.cpu_limit_s = cpu_limit_s
        self.max_tasks = max_tasks
        self.warm = warm
        self.available = nemo_installed() if available is None else available
        self.turns = FairTurns(self.workers)
        self._start_worker = start_worker  # each worker's start: its niceness, the warm grammars
        self._pool: pebble.ProcessPool | None = None
        self._handed = 0  # texts handed to the serving pool (its replacement is due at max_tasks per worker)
        # the pool that takes over once its workers have loaded the warm grammars, and its warm-up tasks
        self._successor: tuple[pebble.ProcessPool, list[Future]] | None = None
        # replaced pools, each joined by a thread of its own once its workers have finished their last texts
        self._retired: list[tuple[pebble.ProcessPool, threading.Thread]] = []
        # the grammars a worker has loaded (a text of it normalized): a text of any other may compile it first
        # (`normalize`)
        self._loaded: set[str | None] = {None, *map(_grammar, warm)}
        self._as_written: set[str] = set()  # the languages one worker speaks as written, each logged once

    def start(self) -> None:
        """Start the workers now (each loads the warm grammars), not on the first request."""
        if self._pool is None:
            self._pool, _ = self._new_pool()

    def _new_pool(self) -> tuple[pebble.ProcessPool, list[Future]]:
        """A pool of `workers` processes (spawned: the gateway's threads and event loop are not forked into them;
        never replaced by pebble after a number of tasks: `_replace` does it), and the tasks that start them."""
        pool = pebble.ProcessPool(
            self.workers,
            0,
            initializer=self._start_worker,
            initargs=(self.warm,),
            context=multiprocessing.get_context("spawn"),
        )
        return pool, [pool.submit(os.getpid, None) for _ in range(self.workers)]

    def _replace(self) -> None:
        """Past `max_tasks` texts per worker, start a successor pool; once its start-up tasks are done (its
        workers run a task only after loading the warm grammars), it serves, and the old pool's workers exit
        after the texts they hold (module docstring)."""
        self._retired = [(p, t) for p, t in self._retired if t.is_alive()]
        if self._successor is not None:
            successor, starting = self._successor
            if all(f.done() for f in starting):
                assert self._pool is not None
                self._pool.close()  # no new task; join() waits for the ones its workers hold, then ends them
                joined = threading.Thread(target=self._pool.join, name="textnorm-retired", daemon=True)
                joined.start()
                self._retired.append((self._pool, joined))
                self._pool, self._successor, self._handed = successor, None, 0
                self._loaded = {None, *map(_grammar, self.warm)}  # what the new workers have loaded
        elif self.max_tasks and self._handed >= self.max_tasks * self.workers:
            self._successor = self._new_pool()

    def close(self) -> None:
        for pool, joined in self._retired:
            pool.stop()
            joined.join(timeout=10)
        for pool in filter(None, (self._successor[0] if self._successor else None, self._pool)):
            pool.stop()
            pool.join(timeout=10)
        self._pool, self._successor, self._retired = None, None, []

    async def normalize(self, text: str, language: str, owner: object = None) -> str:
        """`text` in its spoken form; the text itself when NeMo is not installed or the worker fails (it is
        logged); RequestError `normalization_timeout` past the CPU bound."""
        if not self.available or not text.strip():
            return text
        grammar = _grammar(language)
        # a language no worker has loaded yet may compile its grammar first (fr 67 s, es 241 s on 2 cores, not
        # counted in the CPU bound): such a text is long too, so that it never takes the last free worker (one
        # client's params naming two such languages held both workers, and every session's first audio, for minutes)
        cold = grammar not in self._loaded
        if cold and self.workers == 1:  # no other worker to leave free (module docstring)
            if language not in self._as_written:
                self._as_written.add(language)
                log.warning(
                    "text normalization has one worker and %s is not among the languages it loads at start: its "
                    "texts are spoken as written (--normalization-language %s loads it, or more workers: "
                    "--normalization-workers)",
                    language,
                    language,
                )
            return text
        try:
            spoken = await self.run(
                owner,
                cold or len(text.encode("utf-8", "surrogatepass")) > SHORT_TEXT_BYTES,
                normalize_in_worker,
                text,
                language,
                self.cpu_limit_s,
            )
            self._loaded.add(grammar)
            return spoken
        except pebble.ProcessExpired as e:
            if e.exitcode == -_CPU_SIGNAL:
                raise RequestError(
                    G.NORMALIZATION_TIMEOUT,
                    f"normalizing this text took more than {self.cpu_limit_s:g} s of CPU: "
                    "send shorter sentences, or turn text_normalization off for it",
                ) from None
            log.warning("a text-normalization worker died (exit code %s); this text is spoken as written", e.exitcode)
            return text
        except TimeoutError:
            log.warning(
                "a text-normalization worker hung for %g s and was replaced; this text is spoken as written",
                TASK_WALL_LIMIT_S,
            )
            return text

    async def run(self, owner: object, long: bool, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker, in this owner's turn (`long`: a text over SHORT_TEXT_BYTES)."""
        self.start()
        async with self.turns.turn(owner, long):
            self._replace()
            assert self._pool is not None
            self._handed += 1
            future = self._pool.submit(fn, TASK_WALL_LIMIT_S, *args)
            waiter = asyncio.wrap_future(future)
            try:
                return await asyncio.shield(waiter)  # (a cancelled wrap_future would cancel, so kill, the task)
            except asyncio.CancelledError:
                # The caller is gone (a session closed, an utterance cancelled). The task finishes, within its CPU
                # bound, holding its turn until then: ending its worker would cost a grammar reload, and a client
                # could make that happen at will. It is never cancelled: pebble ends the worker of a cancelled task
                # that has started, and a task reports running only once its worker has acknowledged it, so a task
                # cancelled just after it was handed out (a text dropped by a cancel at once: a Speak and Clear
                # storm) ended its worker all the same, and every other session's texts waited for the grammar to
                # load again (66 s to a new session's first audio, measured on 2 cores).
                with contextlib.suppress(BaseException):
                    await waiter
                raise
