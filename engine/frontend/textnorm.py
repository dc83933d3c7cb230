"""Text normalization: turn written text into its spoken form before byte tokenization.

"$5.32" -> "five dollars thirty two cents", "Dr. Smith has 21 cats." -> "doctor Smith has twenty
one cats.". Like the reference (`zonos2/tokenizer/textnorm.py`), this uses the NVIDIA
NeMo-text-processing forward text-normalization grammars (pynini WFSTs). The reference vendors
nemo_text_processing r1.2.0; the PyPI wheel `nemo-text-processing==1.2.0` has the same grammar
files, so the output matches.

* Request codes map to NeMo languages (`NEMO_LANGUAGE`). Korean uses NeMo's `lower_cased` grammars
  and every other language the `cased` ones.
* Before normalizing, a space goes between a digit and a following `.!?,;:` when whitespace or the
  end of the text comes next ("born in 1990." -> "born in 1990 ."). Without it some upstream
  grammars fail (pt) or read dates digit by digit (de). Afterwards, spaces before such punctuation
  are removed again. "3.5" and "3:30" are not touched.
* Moses `punct_post_process` runs only for en, zh, ja and ko. For the European languages it glues
  currency symbols onto the next word.
* The grammars are compiled lazily, once per language, and kept in memory and as `.far` files under
  `ZONOS2_TTS_NORM_CACHE_DIR` (default `~/.cache/zonos2-tts-norm`), in one subfolder per
  nemo/pynini version. The compile is slow. Measured on 2 CPU cores: en 51 s, fr 67 s, de 56 s,
  es 241 s, it 111 s, pt 119 s, ja 12 s, zh 22 s, ko 54 s. Loading from the cache takes under
  1.2 s, except de at about 12 s. Call `TextNormalizer.warm` at startup, or ship a prebuilt
  cache, so that no request pays for a compile. A compile holds that language's lock, so the
  requests behind it wait.
* Normalization never fails a request. If it is disabled (`ZONOS2_TTS_NORM=0`), the language is not
  supported, the package is missing, or anything goes wrong, you get the raw text back and a
  warning is logged.

`normalize` blocks and uses the CPU. With the grammar loaded, a short sentence takes 20-60 ms (de
up to about 1.5 s) and 300 characters of English about 0.3 s. Calls for one language are
serialized, because NeMo's `Normalizer` is not thread-safe. The gateway runs it in worker processes
(app/core/normalization.py: parallel, a CPU bound per text, workers recycled), never in its own process.

Nothing from NeMo or pynini is imported until the first normalization. Importing this module is
cheap, and it works without the package installed.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)

# Request language code -> NeMo text_normalization language.
NEMO_LANGUAGE: dict[str, str] = {
    "en_us": "en",
    "en_gb": "en",
    "fr_fr": "fr",
    "de": "de",
    "es": "es",
    "it": "it",
    "pt_br": "pt",
    "ja": "ja",
    "cmn": "zh",
    "ko": "ko",
}
SUPPORTED_LANGUAGES: tuple[str, ...] = tuple(NEMO_LANGUAGE)

# NeMo's own tests run the Korean grammars on lower-cased input; every other language runs cased.
_LOWER_CASED = frozenset({"ko"})
# Moses detokenization re-attaches punctuation well only for these languages.
_MOSES_LANGS = frozenset({"en", "zh", "ja", "ko"})
# The zh and ja verbalizers read a cached .far but never write one (upstream quirk), so it is
# written here after the first compile. ja reads a "jp_"-prefixed file name.
_VERBALIZER_FAR_PREFIX = {"zh": "zh", "ja": "jp"}

_DIGIT_PUNCT_RE = re.compile(r"(\d)([.!?,;:])(?=\s|$)")
_SPACE_PUNCT_RE = re.compile(r" +([.!?,;:])(?=\s|$)")

ENV_ENABLED = "ZONOS2_TTS_NORM"
ENV_CACHE_DIR = "ZONOS2_TTS_NORM_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/zonos2-tts-norm"

_NEMO_LOGGER = "NeMo-text-processing"


def normalize_language(code: str) -> str:
    """Return the canonical request code ("EN-us" -> "en_us"), or raise ValueError if it is unsupported."""
    canon = str(code).strip().lower().replace("-", "_")
    if canon not in NEMO_LANGUAGE:
        raise ValueError(
            f"unsupported text-normalization language {code!r}; supported: {', '.join(SUPPORTED_LANGUAGES)}"
        )
    return canon


def normalization_enabled() -> bool:
    """False when normalization is turned off globally with ZONOS2_TTS_NORM=0."""
    return os.environ.get(ENV_ENABLED, "1").strip() != "0"


def default_cache_dir() -> str:
    return os.path.expanduser(os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR)


def pre_process(text: str) -> str:
    """Space off punctuation between a digit and whitespace/end: "in 1990." -> "in 1990 ."; "3.5" and "3:30" stay."""
    return _DIGIT_PUNCT_RE.sub(r"\1 \2", text)


def post_process(text: str) -> str:
    """Remove spaces before sentence punctuation: "twenty one cats ." -> "twenty one cats."."""
    return _SPACE_PUNCT_RE.sub(r"\1", text)


class _DropBelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _ensure_cdifflib() -> None:
    # nemo_text_processing.text_normalization/__init__ imports NormalizerWithAudio, which imports
    # cdifflib. cdifflib is published only as a C source distribution, and we never use that
    # normalizer. If cdifflib is missing, we register the pure-Python difflib.SequenceMatcher in its
    # place; cdifflib's CSequenceMatcher is a faster drop-in for it.
    try:
        import cdifflib  # noqa: F401
    except ImportError:
        shim = types.ModuleType("cdifflib")
        shim.CSequenceMatcher = difflib.SequenceMatcher  # type: ignore[attr-defined]
        shim.__doc__ = "engine.frontend.textnorm stand-in: difflib.SequenceMatcher (C build not installed)"
        sys.modules["cdifflib"] = shim


def _load_nemo() -> tuple[Callable[..., Any], Callable[[str, dict[str, Any]], None], str]:
    """Import NeMo lazily. Returns (Normalizer class, generator_main, cache-version tag).

    Raises ImportError when the package (or pynini) is not installed.
    """
    _ensure_cdifflib()
    from nemo_text_processing.text_normalization.en.graph_utils import generator_main
    from nemo_text_processing.text_normalization.normalize import Normalizer

    # NeMo resets its logger to INFO on every call and logs routine messages, for example one per
    # sentence with punctuation. Keep only its warnings and errors.
    nemo_log = logging.getLogger(_NEMO_LOGGER)
    if not any(isinstance(f, _DropBelowWarning) for f in nemo_log.filters):
        nemo_log.addFilter(_DropBelowWarning())

    versions = []
    for dist in ("nemo-text-processing", "pynini"):
        try:
            versions.append(f"{dist.split('-')[0]}{metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist.split('-')[0]}-unknown")
    return Normalizer, generator_main, "-".join(versions)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """Lock a file for the whole build, so that processes sharing the cache never write the same .far
    at the same time. If the lock cannot be taken, the build goes ahead without it."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class TextNormalizer:
    """NeMo normalizers for each language, built lazily, kept in memory and cached on disk. Thread-safe.

    One instance per process is enough. Grammars are shared by every thread, and calls for one
    language are serialized by that language's lock.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None, enabled: bool | None = None):
        """`cache_dir`: root of the .far cache (default: $ZONOS2_TTS_NORM_CACHE_DIR or
        ~/.cache/zonos2-tts-norm). `enabled`: None follows ZONOS2_TTS_NORM at every call; True or
        False overrides it."""
        self.cache_dir = os.path.expanduser(os.fspath(cache_dir)) if cache_dir is not None else default_cache_dir()
        self._enabled = enabled
        self._lock = threading.Lock()  # guards the dicts and the one-time import
        self._lang_locks: dict[str, threading.Lock] = {}
        self._normalizers: dict[str, Any] = {}
        self._failed: dict[str, str] = {}  # NeMo language -> why its grammar could not be built
        self._nemo: tuple[Callable[..., Any], Callable[[str, dict[str, Any]], None], str] | None = None
        self._import_error: str | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        return normalization_enabled() if self._enabled is None else self._enabled

    @property
    def available(self) -> bool:
        """True if nemo_text_processing and pynini can be imported. The first call imports them (~1 s)."""
        return self._load() is not None

    def loaded_languages(self) -> list[str]:
        """NeMo languages whose grammars are in memory."""
        with self._lock:
            return sorted(self._normalizers)

    def _warn_once(self, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        with self._lock:
            if key in self._warned or len(self._warned) >= 256:  # bounded: keys can come from clients
                return
            self._warned.add(key)
        log.warning(msg, *args, exc_info=exc_info)

    def _load(self) -> tuple[Callable[..., Any], Callable[[str, dict[str, Any]], None], str] | None:
        with self._lock:
            if self._nemo is not None or self._import_error is not None:
                return self._nemo
            try:
                self._nemo = _load_nemo()
            except Exception as exc:  # ImportError, or a broken native pynini build
                self._import_error = f"{type(exc).__name__}: {exc}"
            nemo, err = self._nemo, self._import_error
        if err is not None:
            self._warn_once(
                "import",
                "text normalization unavailable (nemo-text-processing/pynini not importable: %s); "
                "text is passed through unnormalized",
                err,
            )
        return nemo

    def _lang_lock(self, lang: str) -> threading.Lock:
        with self._lock:
            lock = self._lang_locks.get(lang)
            if lock is None:
                lock = self._lang_locks[lang] = threading.Lock()
            return lock

    # ------------------------------------------------------------------ building

    def _build(self, lang: str) -> Any:
        nemo = self._load()
        if nemo is None:
            raise RuntimeError(f"nemo-text-processing is not available: {self._import_error}")
        normalizer_cls, generator_main, version_tag = nemo
        input_case = "lower_cased" if lang in _LOWER_CASED else "cased"

        # One folder per (lang, case): upstream .far names collide across languages (ja's tagger
        # writes a zh_-prefixed file). The package versions are part of the path, so an upgrade
        # never loads stale grammars.
        lang_dir: str | None = os.path.join(self.cache_dir, version_tag, f"{lang}_{input_case}")
        try:
            os.makedirs(lang_dir, exist_ok=True)  # type: ignore[arg-type]
        except OSError as exc:
            log.warning("text-normalization cache %s not writable (%s); grammars stay in memory only", lang_dir, exc)
            lang_dir = None

        with _file_lock(os.path.join(lang_dir, ".build.lock")) if lang_dir else contextlib.nullcontext():
            had_cache = bool(lang_dir) and any(f.endswith(".far") for f in os.listdir(lang_dir))
            log.info(
                "loading text normalizer %s (%s) %s",
                lang,
                input_case,
                "from cache" if had_cache else "- compiling grammars, this takes a while",
            )

            def make(overwrite: bool) -> Any:
                return normalizer_cls(input_case=input_case, lang=lang, cache_dir=lang_dir, overwrite_cache=overwrite)

            try:
                normalizer = make(False)
            except Exception:
                if not had_cache:
                    raise
                # A truncated or incompatible .far (a crash during a write, say) is rebuilt once.
                log.warning("cached grammars for %s failed to load; recompiling", lang, exc_info=True)
                normalizer = make(True)

            prefix = _VERBALIZER_FAR_PREFIX.get(lang)
            if lang_dir and prefix:
                far = os.path.join(lang_dir, f"{prefix}_tn_True_deterministic_verbalizer.far")
                if not os.path.exists(far):
                    tmp = f"{far}.{os.getpid()}.tmp"
                    try:
                        generator_main(tmp, {"verbalize": normalizer.verbalizer.fst})
                        os.replace(tmp, far)
                    except Exception:
                        log.warning("could not cache the %s verbalizer grammar", lang, exc_info=True)
                        with contextlib.suppress(OSError):
                            os.remove(tmp)
        return normalizer

    def _get(self, lang: str) -> Any:
        """The in-memory normalizer for a NeMo language. Builds it the first time; the caller holds that
        language's lock."""
        normalizer = self._normalizers.get(lang)
        if normalizer is not None:
            return normalizer
        if lang in self._failed:
            raise RuntimeError(self._failed[lang])
        try:
            normalizer = self._build(lang)
        except Exception as exc:
            # A grammar that does not build now will not build on the next request either. Don't make
            # every request pay for another attempt.
            with self._lock:
                self._failed[lang] = f"building the {lang} grammar failed: {type(exc).__name__}: {exc}"
            raise
        with self._lock:
            self._normalizers[lang] = normalizer
        return normalizer

    def warm(self, languages: Iterable[str] = ("en_us",)) -> dict[str, bool]:
        """Build (or load from the .far cache) the grammars of `languages` (request codes) now.

        Unknown codes raise ValueError before anything is built. A grammar that fails to build is
        logged and reported as False; it does not raise. Does nothing if normalization is disabled.
        Returns {request code: ready}.
        """
        codes = [normalize_language(c) for c in languages]
        result = dict.fromkeys(codes, False)
        if not self.enabled or self._load() is None:
            return result
        for code in codes:
            lang = NEMO_LANGUAGE[code]
            try:
                with self._lang_lock(lang):
                    self._get(lang)
                result[code] = True
            except Exception:  # said once: the gateway's workers warm a language before each text
                self._warn_once(f"warm:{lang}", "text normalizer warm-up failed for %s (%s)", code, lang, exc_info=True)
        return result

    # ------------------------------------------------------------------ normalizing

    def normalize(self, text: str, language: str = "en_us") -> str:
        """Written -> spoken form for a request language code. Never raises: if normalization is disabled,
        the language is unsupported, the package is missing, or anything fails, `text` comes back
        unchanged."""
        if not text or not text.strip() or not self.enabled:
            return text
        try:
            code = normalize_language(language)
        except ValueError:
            self._warn_once(
                f"lang:{str(language)[:32]}",
                "no text normalization for language %r; using raw text",
                language,
            )
            return text
        if self._load() is None:
            return text
        lang = NEMO_LANGUAGE[code]
        try:
            with self._lang_lock(lang):
                normalizer = self._get(lang)
                result = normalizer.normalize(pre_process(text), punct_post_process=lang in _MOSES_LANGS)
        except Exception as exc:
            if lang in self._failed:  # the grammar did not build: say why once, then stay quiet
                self._warn_once(
                    f"failed:{lang}",
                    "text normalization for %s is off (%s); using raw text",
                    code,
                    exc,
                    exc_info=True,
                )
            else:  # a text the grammar cannot take (the client's to send again and again): one line, no traceback
                log.warning("text normalization failed for %s (%s: %s); using raw text", code, type(exc).__name__, exc)
            return text
        if not isinstance(result, str) or not result.strip():
            return text
        result = post_process(result)
        log.debug("textnorm [%s] %r -> %r", code, text, result)
        return result


_default: TextNormalizer | None = None
_default_lock = threading.Lock()


def get_normalizer() -> TextNormalizer:
    """The process-wide TextNormalizer (created on first use, with the default cache dir)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TextNormalizer()
        return _default
