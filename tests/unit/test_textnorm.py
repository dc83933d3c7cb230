"""Text normalization: language codes, pre/post punctuation rules, fallbacks, caching, locking, and (slow,
only with nemo-text-processing installed) real English normalization."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from typing import ClassVar

import pytest

import engine.frontend.textnorm as tn
from engine.frontend.textnorm import (
    SUPPORTED_LANGUAGES,
    TextNormalizer,
    normalize_language,
    post_process,
    pre_process,
)

ALL_CODES = ["en_us", "en_gb", "fr_fr", "de", "es", "it", "pt_br", "ja", "cmn", "ko"]


@pytest.fixture(autouse=True)
def _norm_enabled(monkeypatch):
    monkeypatch.delenv("ZONOS2_TTS_NORM", raising=False)


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "engine.frontend.textnorm" and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- a stand-in for NeMo's Normalizer


class FakeVerbalizer:
    fst = "verbalizer-fst"


class FakeNormalizer:
    """Records how it was built and called; output is a tagged echo of its input."""

    # per-test state: the `fake` fixture gives every test a fresh subclass
    builds: ClassVar[list[dict]]
    calls: ClassVar[list[tuple[str, bool]]]
    build_error: ClassVar[Exception | None]
    fail_on_cached: ClassVar[bool]
    delay_s: ClassVar[float]
    active: ClassVar[int]
    max_active: ClassVar[int]
    _guard: ClassVar[threading.Lock]

    def __init__(self, input_case, lang, cache_dir, overwrite_cache):
        cls = type(self)
        cls.builds.append(
            {"input_case": input_case, "lang": lang, "cache_dir": cache_dir, "overwrite": overwrite_cache}
        )
        if cls.build_error is not None:
            raise cls.build_error
        if cache_dir is not None:
            far = os.path.join(cache_dir, f"{lang}_tagger.far")
            if cls.fail_on_cached and os.path.exists(far) and not overwrite_cache:
                raise RuntimeError("corrupt .far")
            with open(far, "w") as f:
                f.write("fst")
        self.lang = lang
        self.verbalizer = FakeVerbalizer()

    def normalize(self, text, punct_post_process=False):
        cls = type(self)
        with cls._guard:
            cls.active += 1
            cls.max_active = max(cls.max_active, cls.active)
        try:
            cls.calls.append((text, punct_post_process))
            if cls.delay_s:
                time.sleep(cls.delay_s)
            if "boom" in text:
                raise RuntimeError("grammar exploded")
            if "blank" in text:
                return "   "
            return f"<{self.lang}>{text}"
        finally:
            with cls._guard:
                cls.active -= 1


def _fake_generator_main(path, graphs):
    with open(path, "w") as f:
        f.write(repr(graphs))


@pytest.fixture
def fake(monkeypatch):
    state = {"builds": [], "calls": [], "build_error": None, "fail_on_cached": False, "delay_s": 0.0}
    F = type("F", (FakeNormalizer,), {**state, "active": 0, "max_active": 0, "_guard": threading.Lock()})
    monkeypatch.setattr(tn, "_load_nemo", lambda: (F, _fake_generator_main, "fake1.0"))
    return F


# ---------------------------------------------------------------- language codes


def test_supported_languages_are_the_ten_reference_codes():
    assert list(SUPPORTED_LANGUAGES) == ALL_CODES
    assert set(tn.NEMO_LANGUAGE.values()) == {"en", "fr", "de", "es", "it", "pt", "ja", "zh", "ko"}


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("en_us", "en_us"),
        ("EN-US", "en_us"),
        ("en-gb", "en_gb"),
        (" Fr_FR ", "fr_fr"),
        ("pt-BR", "pt_br"),
        ("CMN", "cmn"),
        ("ko", "ko"),
    ],
)
def test_normalize_language_canonicalises(code, want):
    assert normalize_language(code) == want


@pytest.mark.parametrize("code", ["en", "fr", "pt", "zh", "ru", "", "en__us", "english"])
def test_normalize_language_rejects_unknown_codes_listing_the_supported_ones(code):
    with pytest.raises(ValueError) as ei:
        normalize_language(code)
    msg = str(ei.value)
    assert repr(code) in msg
    for c in ALL_CODES:
        assert c in msg


# ---------------------------------------------------------------- punctuation spacing


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Dr. Smith was born in 1990.", "Dr. Smith was born in 1990 ."),
        ("Dr. Smith has 21 cats.", "Dr. Smith has 21 cats."),
        ("I have 5, you have 6!", "I have 5 , you have 6 !"),
        ("Call 911? Now: 3; go", "Call 911 ? Now: 3 ; go"),
        ("It is 3:30 pm.", "It is 3:30 pm."),  # ':' between digits and '.' after a letter: untouched
        ("pi is 3.14 and 1,000 is big", "pi is 3.14 and 1,000 is big"),
        ("ends with 7.\nnext 8:\tthen", "ends with 7 .\nnext 8 :\tthen"),
        ("no digits here.", "no digits here."),
    ],
)
def test_pre_process_spaces_punctuation_after_digits(text, want):
    assert pre_process(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("twenty one cats .", "twenty one cats."),
        ("five , six !", "five, six!"),
        ("wait  ?", "wait?"),
        ("three :thirty", "three :thirty"),  # not followed by whitespace/end: untouched
        ("a ... b", "a ... b"),
        ("done .\nnext", "done.\nnext"),
    ],
)
def test_post_process_removes_spaces_before_punctuation(text, want):
    assert post_process(text) == want


# ---------------------------------------------------------------- fallbacks to the raw text


def test_module_import_does_not_import_nemo():
    code = (
        "import sys, engine.frontend.textnorm as t; "
        "assert 'nemo_text_processing' not in sys.modules and 'pynini' not in sys.modules; "
        "t.TextNormalizer(cache_dir='/nonexistent'); "
        "assert 'pynini' not in sys.modules"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, timeout=60)


def test_missing_package_returns_raw_text_and_warns_once(monkeypatch, tmp_path, caplog):
    # None in sys.modules makes `import nemo_text_processing...` raise ModuleNotFoundError, as if absent.
    for mod in (
        "nemo_text_processing",
        "nemo_text_processing.text_normalization",
        "nemo_text_processing.text_normalization.normalize",
        "nemo_text_processing.text_normalization.en",
        "nemo_text_processing.text_normalization.en.graph_utils",
        "pynini",
    ):
        monkeypatch.setitem(sys.modules, mod, None)
    norm = TextNormalizer(cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.textnorm"):
        assert norm.available is False
        for text in ("$5.32", "It is 3:30 pm.", "Dr. Smith has 21 cats."):
            assert norm.normalize(text) == text
        assert norm.normalize("$1", "de") == "$1"
        assert norm.warm(["en_us", "de"]) == {"en_us": False, "de": False}
    warns = _warnings(caplog)
    assert len(warns) == 1, [r.getMessage() for r in warns]
    assert "unavailable" in warns[0].getMessage()
    assert not list(tmp_path.iterdir())


def test_exception_inside_normalizer_returns_raw_text(fake, tmp_path, caplog):
    norm = TextNormalizer(cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.textnorm"):
        assert norm.normalize("boom 5.") == "boom 5."
        assert norm.normalize("blank") == "blank"  # an empty result also falls back
    assert len(_warnings(caplog)) == 1
    # one line that names the error, no traceback: the text is the client's, sent as often as it likes
    (warn,) = _warnings(caplog)
    assert "RuntimeError: grammar exploded" in warn.getMessage() and warn.exc_info is None
    assert norm.normalize("ok") == "<en>ok"  # the normalizer keeps working afterwards
    assert len(fake.builds) == 1


def test_grammar_build_failure_returns_raw_text_and_is_not_retried(fake, tmp_path, caplog):
    fake.build_error = RuntimeError("FstOpError")
    norm = TextNormalizer(cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.textnorm"):
        for _ in range(3):
            assert norm.normalize("Das kostet 5 €.", "de") == "Das kostet 5 €."
        assert norm.warm(["de"]) == {"de": False}
    assert len(fake.builds) == 1
    assert len([r for r in _warnings(caplog) if "FstOpError" in r.getMessage()]) == 1
    fake.build_error = None
    assert norm.normalize("x", "en_us") == "<en>x"  # other languages are unaffected


def test_env_zero_disables_normalization(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("ZONOS2_TTS_NORM", "0")
    norm = TextNormalizer(cache_dir=tmp_path)
    assert norm.enabled is False
    assert norm.normalize("$5.32") == "$5.32"
    assert norm.warm(["en_us"]) == {"en_us": False}
    assert fake.builds == []
    monkeypatch.setenv("ZONOS2_TTS_NORM", "1")  # read at every call
    assert norm.normalize("$5.32") == "<en>$5.32"
    assert TextNormalizer(cache_dir=tmp_path, enabled=False).normalize("$5.32") == "$5.32"


def test_unsupported_language_returns_raw_text_and_warns_once(fake, tmp_path, caplog):
    norm = TextNormalizer(cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.textnorm"):
        for _ in range(3):
            assert norm.normalize("Мне 21 год.", "ru") == "Мне 21 год."
    assert len(_warnings(caplog)) == 1
    assert fake.builds == []


def test_blank_text_is_returned_untouched(fake, tmp_path):
    norm = TextNormalizer(cache_dir=tmp_path)
    assert norm.normalize("") == ""
    assert norm.normalize("  \n") == "  \n"
    assert fake.builds == []


# ---------------------------------------------------------------- wiring, caching, locking


def test_language_mapping_case_moses_and_punctuation(fake, tmp_path):
    norm = TextNormalizer(cache_dir=tmp_path)
    assert norm.normalize("Dr. Smith was born in 1990.", "EN-GB") == "<en>Dr. Smith was born in 1990."
    assert fake.calls[-1] == ("Dr. Smith was born in 1990 .", True)
    assert norm.normalize("Es kostet 5,32.", "de") == "<de>Es kostet 5,32."
    assert fake.calls[-1] == ("Es kostet 5,32 .", False)  # no moses for de
    assert norm.normalize("價格是5.", "cmn") == "<zh>價格是5."
    assert fake.calls[-1] == ("價格是5 .", True)
    norm.normalize("5,000원입니다", "ko")
    norm.normalize("São 3.", "pt_br")
    cases = {b["lang"]: b["input_case"] for b in fake.builds}
    assert cases == {"en": "cased", "de": "cased", "zh": "cased", "ko": "lower_cased", "pt": "cased"}
    for b in fake.builds:
        assert b["cache_dir"] == os.path.join(str(tmp_path), "fake1.0", f"{b['lang']}_{b['input_case']}")
        assert b["overwrite"] is False


def test_grammar_built_once_per_language_and_shared_by_codes(fake, tmp_path):
    norm = TextNormalizer(cache_dir=tmp_path)
    for code in ("en_us", "en_gb", "en-US", "en_us"):
        norm.normalize("1", code)
    assert [b["lang"] for b in fake.builds] == ["en"]
    assert norm.loaded_languages() == ["en"]


def test_warm_builds_up_front_and_validates_codes(fake, tmp_path):
    norm = TextNormalizer(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="supported"):
        norm.warm(["en_us", "xx"])
    assert fake.builds == []
    assert norm.warm(["en_us", "en_gb", "ja", "cmn"]) == {
        "en_us": True,
        "en_gb": True,
        "ja": True,
        "cmn": True,
    }
    assert sorted(b["lang"] for b in fake.builds) == ["en", "ja", "zh"]
    norm.normalize("2", "ja")
    assert len(fake.builds) == 3
    # zh/ja verbalizers never write their own .far; the wrapper does (ja under a "jp_" name)
    assert (tmp_path / "fake1.0" / "ja_cased" / "jp_tn_True_deterministic_verbalizer.far").exists()
    assert (tmp_path / "fake1.0" / "zh_cased" / "zh_tn_True_deterministic_verbalizer.far").exists()
    assert not list((tmp_path / "fake1.0" / "en_cased").glob("*verbalizer*"))


def test_new_instance_reuses_disk_cache_and_rebuilds_a_corrupt_one(fake, tmp_path):
    TextNormalizer(cache_dir=tmp_path).warm(["en_us"])
    fake.fail_on_cached = True  # the cached .far now "fails to load"
    norm = TextNormalizer(cache_dir=tmp_path)
    assert norm.normalize("7") == "<en>7"
    assert [b["overwrite"] for b in fake.builds] == [False, False, True]


def test_unwritable_cache_dir_builds_in_memory(fake, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    norm = TextNormalizer(cache_dir=blocker)
    with caplog.at_level(logging.WARNING, logger="engine.frontend.textnorm"):
        assert norm.normalize("3") == "<en>3"
    assert [b["cache_dir"] for b in fake.builds] == [None]
    assert any("not writable" in r.getMessage() for r in _warnings(caplog))


def test_concurrent_calls_build_once_and_never_overlap_within_a_language(fake, tmp_path):
    fake.delay_s = 0.01
    norm = TextNormalizer(cache_dir=tmp_path)
    results: list[str] = []
    errors: list[BaseException] = []

    def worker(i):
        try:
            results.append(norm.normalize(f"item {i}.", "en_us" if i % 2 else "en_gb"))
        except BaseException as exc:  # pragma: no cover - would fail the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert sorted(results) == sorted(f"<en>item {i}." for i in range(16))
    assert len(fake.builds) == 1
    assert fake.max_active == 1


def test_get_normalizer_is_a_singleton():
    assert tn.get_normalizer() is tn.get_normalizer()


# ---------------------------------------------------------------- the real thing

HAVE_NEMO = (
    importlib.util.find_spec("nemo_text_processing") is not None and importlib.util.find_spec("pynini") is not None
)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NEMO, reason="nemo-text-processing/pynini not installed")
def test_real_english_normalization():
    # Shares the server's grammar cache ($ZONOS2_TTS_NORM_CACHE_DIR or ~/.cache/zonos2-tts-norm):
    # the first run compiles the English grammars (about 1 min on 2 cores), later runs load them in about 1 s.
    norm = TextNormalizer()
    assert norm.available
    assert norm.warm(["en_us"]) == {"en_us": True}
    assert norm.normalize("$5.32") == "five dollars thirty two cents"
    assert norm.normalize("It is 3:30 pm.") == "It is three thirty PM."
    assert norm.normalize("Dr. Smith has 21 cats.") == "doctor Smith has twenty one cats."
    assert norm.normalize("Dr. Smith has 21 cats.", "en_gb") == "doctor Smith has twenty one cats."
    assert norm.normalize("No numbers here.") == "No numbers here."
    assert norm.loaded_languages() == ["en"]


# ---------------------------------------------------------------- the gateway's worker pool (app/core/normalization.py)
# Real worker processes; the tasks below stand in for a text only in what they cost (CPU, or waiting).


def spin_within(cpu_s: float) -> None:
    """A task that uses CPU until its bound ends the worker (as a pathological text would)."""
    from app.core.normalization import cpu_bound

    with cpu_bound(cpu_s):
        while True:
            pass


def wait_for_file(path: str) -> int:
    """A task that holds its worker until `path` exists (a long text, as long as the test wants); it
    creates `path`.started first."""
    open(path + ".started", "a").close()
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


def _pool(**kw):
    from app.core.normalization import NormalizationPool

    return NormalizationPool(
        kw.pop("workers", 1), kw.pop("cpu_limit_s", 30.0), kw.pop("max_tasks", 0), warm=(), available=True, **kw
    )


def test_a_task_past_its_cpu_bound_ends_its_worker_and_the_next_task_runs():
    import asyncio
    import signal

    import pebble

    async def go():
        pool = _pool()
        try:
            first = await pool.run("a", False, os.getpid)
            with pytest.raises(pebble.ProcessExpired) as e:
                await pool.run("a", False, spin_within, 0.3)
            assert e.value.exitcode == -signal.SIGPROF
            second = await pool.run("b", False, os.getpid)  # a new worker took its place
            return first, second
        finally:
            pool.close()

    first, second = asyncio.run(asyncio.wait_for(go(), 120))
    assert first != second


def gated_start(warm: tuple[str, ...]) -> None:
    """A worker start (NormalizationPool's start_worker) that, after the first worker's, waits until the file
    warm[0] exists: a grammar load as long as the test wants."""
    gate = warm[0]
    with contextlib.suppress(FileExistsError):
        open(gate + ".first", "x").close()
        return
    while not os.path.exists(gate):
        time.sleep(0.01)


def test_the_workers_are_replaced_while_the_old_ones_serve(tmp_path):
    """Replacing the workers (after max_tasks texts each) never holds the texts: the successor loads its grammars
    while the old workers serve, and takes over once ready. pebble replaced each worker in place, and a worker's
    grammar load (de ~12 s) held every text, and every session's speech, behind it; with several workers they all
    reached their count within a few texts of each other and reloaded together."""
    import asyncio

    from app.core.normalization import NormalizationPool

    gate = str(tmp_path / "loaded")

    async def go():
        pool = NormalizationPool(1, 30.0, 2, warm=(gate,), available=True, start_worker=gated_start)
        try:
            old = {await pool.run(None, False, os.getpid) for _ in range(2)}
            # due for replacement: its successor's start waits at the gate, and the texts go on meanwhile
            during = {await pool.run(None, False, os.getpid) for _ in range(6)}
            open(gate, "w").close()
            for _ in range(10_000):  # until the successor has started and taken over
                new = await pool.run(None, False, os.getpid)
                if new not in old:
                    return old, during, new
                await asyncio.sleep(0.01)
            return old, during, None
        finally:
            pool.close()

    old, during, new = asyncio.run(asyncio.wait_for(go(), 120))
    assert during == old and len(old) == 1
    assert new is not None and new not in old


def test_a_text_cancelled_as_soon_as_it_is_handed_out_does_not_end_its_worker():
    """A text cancelled right after it was handed to a worker (a session's text dropped by a cancel at once: a Speak
    and Clear storm) was cancelled in pebble, which ends the worker of a cancelled task once the worker has taken it:
    a grammar reload for every such cancel, which every other session's texts waited for (66 s to a new session's
    first audio, measured). The task now finishes in its worker, and the worker stays, whenever the cancel comes."""
    import asyncio

    async def go():
        pool = _pool()
        try:
            before = await pool.run("a", False, os.getpid)
            # cancelled 1..24 steps of the event loop after it was handed out (the worker takes it meanwhile)
            for steps in range(1, 25):
                dropped = asyncio.create_task(pool.run("b", False, time.sleep, 0.1))
                for _ in range(steps):
                    await asyncio.sleep(0)
                dropped.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await dropped
            return before, await pool.run("c", False, os.getpid)
        finally:
            pool.close()

    before, after = asyncio.run(asyncio.wait_for(go(), 120))
    assert after == before


def test_a_short_text_gets_a_worker_while_long_ones_hold_the_others(tmp_path):
    """Other sessions make progress while one tenant's long texts are being normalized: its texts hold one
    worker of two (long texts leave one to short ones), whatever it has queued."""
    import asyncio

    gate = str(tmp_path / "release")

    async def go():
        pool = _pool(workers=2)
        try:
            long_ones = [asyncio.create_task(pool.run("tenant", True, wait_for_file, gate)) for _ in range(4)]
            others = [await pool.run(f"session{i}", False, os.getpid) for i in range(3)]
            held = [t.done() for t in long_ones]
            assert pool.turns.active_long == 1  # the tenant's first text still runs
            open(gate, "w").close()
            return others, held, await asyncio.gather(*long_ones)
        finally:
            pool.close()

    others, held, done = asyncio.run(asyncio.wait_for(go(), 120))
    assert held == [False] * 4 and len(done) == 4 and all(others)


def test_fair_turns_serve_the_owner_that_used_the_workers_least():
    import asyncio

    from app.core.normalization import FairTurns

    async def go():
        turns = FairTurns(1)
        order: list[str] = []
        release = asyncio.Event()

        async def job(owner: str, hold: bool = False) -> None:
            async with turns.turn(owner, False):
                order.append(owner)
                if hold:
                    await release.wait()

        first = asyncio.create_task(job("busy", hold=True))
        while not order:
            await asyncio.sleep(0)
        queued = [asyncio.create_task(job("busy")) for _ in range(3)] + [asyncio.create_task(job("new"))]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *queued)
        return order

    order = asyncio.run(asyncio.wait_for(go(), 30))
    assert order[:2] == ["busy", "new"]  # the newcomer goes before the busy owner's queued texts


def test_a_cancelled_wait_gives_its_turn_away():
    import asyncio

    from app.core.normalization import FairTurns

    async def go():
        turns = FairTurns(1)
        release = asyncio.Event()

        async def hold() -> None:
            async with turns.turn("a", False):
                await release.wait()

        async def quick(owner: str) -> str:
            async with turns.turn(owner, False):
                return owner

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        gone, stays = asyncio.create_task(quick("gone")), asyncio.create_task(quick("stays"))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        await holder
        return await stays, turns.active

    assert asyncio.run(asyncio.wait_for(go(), 30)) == ("stays", 0)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NEMO, reason="nemo-text-processing/pynini not installed")
def test_real_normalization_past_its_cpu_bound_is_a_coded_error():
    """`("+1-555-123-4567 " * 250)[:288]` takes about 1 s of CPU to normalize. Bounded at 0.05 s, it
    fails with normalization_timeout, and the pool goes on normalizing (a new worker)."""
    import asyncio

    from app.core.normalization import NormalizationPool
    from app.io.errors import RequestError

    async def go():
        pool = NormalizationPool(1, 0.05, 0)  # warms en_us as it starts: the shared grammar cache
        try:
            with pytest.raises(RequestError) as e:
                await pool.normalize(("+1-555-123-4567 " * 250)[:288], "en_us")
            pool.cpu_limit_s = 30.0
            return e.value, await pool.normalize("Dr. Smith has 21 cats.", "en_us")
        finally:
            pool.close()

    err, text = asyncio.run(asyncio.wait_for(go(), 600))
    assert err.code == "normalization_timeout" and err.status == 400
    assert text == "doctor Smith has twenty one cats."


def test_a_grammar_that_fails_to_build_is_warned_about_once(fake, tmp_path, caplog):
    fake.build_error = RuntimeError("no grammar")
    norm = TextNormalizer(cache_dir=tmp_path)
    for _ in range(3):  # as the gateway's workers do before each text
        assert norm.warm(["de"]) == {"de": False}
        assert norm.normalize("2 cats.", "de") == "2 cats."
    assert len(fake.builds) == 1
    assert len([r for r in _warnings(caplog) if "warm-up failed" in r.getMessage()]) == 1


def test_a_cancelled_text_finishes_in_its_worker_which_stays(tmp_path):
    """A caller that goes away mid-normalization does not end the worker (a grammar reload a client could
    cause at will); the worker's turn is held until its text is done."""
    import asyncio

    gate = str(tmp_path / "release")

    async def go():
        pool = _pool()
        try:
            first = await pool.run(None, False, os.getpid)
            task = asyncio.create_task(pool.run("gone", True, wait_for_file, gate))
            while not os.path.exists(gate + ".started"):  # running in its worker
                await asyncio.sleep(0.01)
            task.cancel()
            held = pool.turns.active  # still held while the text runs
            open(gate, "w").close()
            with pytest.raises(asyncio.CancelledError):
                await task
            return first, held, pool.turns.active, await pool.run(None, False, os.getpid)
        finally:
            pool.close()

    first, held, after, again = asyncio.run(asyncio.wait_for(go(), 120))
    assert held == 1 and after == 0 and again == first


GATE_ENV = "ZONOS_TEST_COLD_GRAMMAR_GATE"


def compile_cold_grammar(text: str, language: str, cpu_limit_s: float) -> str:
    """normalize_in_worker with a grammar to compile for every language but English: such a text holds its worker
    until the gate file (its path in GATE_ENV, inherited by the spawned workers) exists."""
    if not language.startswith("en"):
        wait_for_file(os.environ[GATE_ENV])
    return text.upper()


def test_texts_of_languages_no_worker_has_loaded_leave_a_worker_to_the_others(tmp_path, monkeypatch):
    """A language's first text may compile its grammar in its worker, for minutes (fr 67 s, es 241 s on 2 cores),
    outside the CPU bound. One client's params naming two such languages (or two sentences of one) held both
    workers, and every other session's first sentence waited for the compiles (the hostile pass: no audio on any
    socket for two minutes). Such texts now leave the last free worker to the others, as long texts do; once a
    language's text has been normalized it is an ordinary one."""
    import asyncio

    from app.core import normalization

    gate = str(tmp_path / "compiled")
    monkeypatch.setenv(GATE_ENV, gate)
    monkeypatch.setattr(normalization, "normalize_in_worker", compile_cold_grammar)

    async def go():
        pool = _pool(workers=2)
        cold: list[asyncio.Task[str]] = []
        try:
            assert await pool.normalize("Warm.", "en_us", "warm-up") == "WARM."
            cold += [
                asyncio.create_task(pool.normalize("Bonjour.", "fr_fr", "tenant")),
                asyncio.create_task(pool.normalize("Hola.", "es", "tenant")),
            ]
            while not os.path.exists(gate + ".started"):  # one compiles in its worker
                await asyncio.sleep(0.01)
            others = [await asyncio.wait_for(pool.normalize("Hello.", "en_us", f"s{i}"), 20) for i in range(3)]
            waiting = [t.done() for t in cold]
            open(gate, "w").close()
            done = await asyncio.gather(*cold)
            # French is loaded now: its texts are short ones again (two at once, one in each worker)
            again = await asyncio.gather(*(pool.normalize("Salut.", "fr_fr", f"f{i}") for i in range(2)))
            return others, waiting, done, again
        finally:
            open(gate, "w").close()  # (a failed wait: the held texts end before the pool does)
            await asyncio.gather(*cold, return_exceptions=True)
            pool.close()

    others, waiting, done, again = asyncio.run(asyncio.wait_for(go(), 120))
    assert others == ["HELLO."] * 3
    assert waiting == [False, False]
    assert done == ["BONJOUR.", "HOLA."] and again == ["SALUT."] * 2


def upper_in_worker(text: str, language: str, cpu_limit_s: float) -> str:
    """normalize_in_worker's stand-in: what a worker normalized is upper case, what it never saw is as written."""
    return text.upper()


def test_one_worker_speaks_texts_of_languages_it_did_not_load_at_start_as_written(monkeypatch, caplog):
    """With one worker there is no other to leave free: a text of a language it did not load at start would hold it,
    and every session's text behind it, for the grammar's load (up to ~12 s) or first compile (minutes: es 241 s on
    2 cores; the hostile pass, one worker per gateway process with --workers 2 on 2 CPUs). Such a text is spoken as
    written (logged once per language); the languages it loads at start (English and --normalization-language) are
    normalized."""
    import asyncio
    import logging

    from app.core import normalization
    from app.core.normalization import NormalizationPool

    monkeypatch.setenv("ZONOS2_TTS_NORM", "0")  # (the spawned worker's start-up warm-up loads nothing)
    monkeypatch.setattr(normalization, "normalize_in_worker", upper_in_worker)

    async def go():
        pool = NormalizationPool(1, 30.0, 0, warm=("en_us", "fr_fr"), available=True)
        try:
            return [
                await pool.normalize(text, language, "s")
                for text, language in (
                    ("Hello.", "en_us"),
                    ("Cheers.", "en_gb"),  # (the grammar of en_us)
                    ("Bonjour.", "fr_fr"),
                    ("Hola.", "es"),
                    ("Otra.", "es"),
                )
            ]
        finally:
            pool.close()

    with caplog.at_level(logging.WARNING, "gateway.textnorm"):
        spoken = asyncio.run(asyncio.wait_for(go(), 120))
    assert spoken == ["HELLO.", "CHEERS.", "BONJOUR.", "Hola.", "Otra."]
    said = [r.getMessage() for r in caplog.records if "spoken as written" in r.getMessage()]
    assert len(said) == 1 and "--normalization-language es" in said[0]
