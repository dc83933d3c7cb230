"""Shared fixtures: a real gateway server (uvicorn + engine process) on a free loopback port."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

# Before anything imports torch: its OpenMP runtime (libgomp) reads the wait policy once, when torch loads it.
# By default an OpenMP thread with no work spins (GOMP_SPINCOUNT 300000) before it sleeps; on cores that something
# else also runs on (the suite's servers, another job on CI's 2 busy cores) the spinning thread holds a core
# while the thread that has the work waits for one, and each of a tiny model's thousands of small parallel ops
# waits out a scheduler slice: CPU synthesis in this process ran tens of times slower than on idle cores.
# PASSIVE threads sleep at once (the same speed on idle cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy's OpenBLAS (the float64 references, Triton's interpreter) likewise, read when numpy loads it: its threads
# spin too, and on a shared core a 128 x 128 product took ~1-4 ms on two threads where one thread takes ~40 us.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The batch-invariance tests run the Triton kernels in the interpreter, whose tl.dot is numpy's matmul: a row's
# result must not depend on the other rows of its tile. OpenBLAS's Haswell sgemm kernel (chosen at run time on some
# AMD EPYC hosts) rounds a row differently by its place in the tile, so every "rows do not depend on the batch" test
# failed there; the Sandybridge kernel (AVX, on every x86-64 host these tests run on) keeps rows apart.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

ROOT = Path(__file__).resolve().parent.parent


def _one_default_ssl_context() -> None:
    """Every httpx client (each httpx.get/post/... call makes one, and so does every httpx.Client, OpenAI client
    and AsyncClient) builds an SSL context and loads the whole CA bundle into it, though the suite speaks only
    plain HTTP to 127.0.0.1: ~20 ms on an idle core, 100-150 ms on 2 busy ones, and the suite makes thousands
    (test_fuzz.py's pronunciation dictionaries alone ~240). The default context (verify=True, no client cert) is
    made once per CA location and shared, as one client shares it between its connections; any other is made
    as httpx makes it. The requests and answers are the same."""
    transports = getattr(httpx, "_transports", None)
    default = getattr(transports, "default", None)
    create = getattr(default, "create_ssl_context", None)  # private (httpx 0.28): another httpx runs as it is
    if create is None or getattr(create, "_shared", False):
        return
    made: dict[tuple[object, ...], object] = {}

    def shared(verify: object = True, cert: object = None, trust_env: bool = True) -> object:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in made:
            made[key] = create(verify=True, cert=None, trust_env=trust_env)
        return made[key]

    shared._shared = True  # type: ignore[attr-defined]
    default.create_ssl_context = shared


_one_default_ssl_context()


def triton_on_cpu() -> None:
    """Triton's kernels on a machine without CUDA: in Triton's interpreter, which must be chosen before the
    kernels are first imported and then holds for the whole process. On a machine with CUDA nothing is set:
    the interpreter would take over every kernel of the process, the GPU tests' too (a CPU test that needs
    the interpreter skips there)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _lean_triton_interpreter() -> Iterator[None]:
    """Work Triton's interpreter repeats for nothing, skipped (the kernels compute exactly what they did; in the
    kernel tests the first two were about half of the interpreter's time):
    - with sanitize_overflow on and debug off it widens every integer add, sub and mul to int64, redoes it and
      compares it with the type's bounds, then drops the result: its device_assert checks nothing without debug
      (a compiled kernel's compiler deletes the same dead code);
    - it patches triton.language into its interpreted form again at every launch and every call of a jit
      function (tl.sum's combine function, per program): the same closures each time, so once per module;
    - every tensor it makes keeps its shape as a triton.language tuple, which makes the type of its values at
      once, and that tuple_type spells out its name (the repr of every member) at once, though the interpreter
      reads neither for a shape and only printing reads the name: each made when first read;
    - it maps each Triton type to its numpy type through a table of 18 types it builds anew at every call: one
      table, filled as types come.
    (The last two: tests/engine/test_kernels.py 40 -> 28 s on 2 cores; the tuple's lazy type then 34-42 -> 29-34 s.)"""
    import dataclasses
    import importlib.util

    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        yield
        return

    from triton.language import core as tl_core
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    patch = getattr(interpreter, "_patch_lang", None)  # private (Triton 3.5, torch 2.9's): another build runs as it is
    if patch is None or "sanitize_overflow" not in {f.name for f in dataclasses.fields(builder.options)}:
        yield
        return
    assert not builder.options.debug  # with debug the checks would assert: keep them then
    options = builder.options
    builder.options = dataclasses.replace(options, sanitize_overflow=False)

    patched: set[int] = set()  # the modules (their globals) whose functions' patch is done

    def patch_once(fn: Callable) -> None:
        if id(fn.__globals__) not in patched:
            patch(fn)
            patched.add(id(fn.__globals__))

    interpreter._patch_lang = patch_once
    tuple_type = tl_core.tuple_type
    eager_init = tuple_type.__init__

    def lean_init(self, types, fields=None) -> None:  # eager_init less the name
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self) -> str:  # as eager_init spells it
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=False)]) + "]"

    tl_tuple = tl_core.tuple
    eager_tuple_init = tl_tuple.__init__

    def lean_tuple_init(self, args, type=None) -> None:  # eager_tuple_init less the type of its values
        self.values = [i for i in args]
        if isinstance(type, tuple_type):
            self.type = type
        elif type is not None:
            self.type = tuple_type(type)

    def tuple_type_of(self):  # as eager_tuple_init makes it (only _setitem changes values, and sets the type)
        if "_type" not in self.__dict__:
            self.__dict__["_type"] = tl_core._type_for_tuple_values(self.values)
        return self.__dict__["_type"]

    def set_tuple_type(self, t) -> None:
        self.__dict__["_type"] = t

    lean = "name" not in vars(tuple_type) and "type" not in vars(tl_tuple)
    if lean:
        tuple_type.__init__, tuple_type.name = lean_init, property(name)
        tl_tuple.__init__, tl_tuple.type = lean_tuple_init, property(tuple_type_of, set_tuple_type)
    np_dtype = interpreter._get_np_dtype
    np_dtypes: dict = {}  # a scalar type -> np_dtype's answer
    tl = interpreter.tl

    def np_dtype_once(tt_dtype):  # np_dtype's answer; np_dtype builds its table of 18 types anew at every call
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return np_dtype(scalar)
        if scalar not in np_dtypes:
            np_dtypes[scalar] = np_dtype(scalar)
        return np_dtypes[scalar]

    interpreter._get_np_dtype = np_dtype_once
    yield
    interpreter._get_np_dtype = np_dtype
    if lean:
        tuple_type.__init__ = eager_init
        del tuple_type.name
        tl_tuple.__init__ = eager_tuple_init
        del tl_tuple.type
    interpreter._patch_lang = patch
    builder.options = options


def process_settings() -> dict[str, object]:
    """The process-wide settings a test could leave behind for every test after it: the interpreter's switch
    interval, Triton's interpreter (where CUDA is: a CPU run chooses it once, triton_on_cpu) and torch's global
    numerics (when torch is imported)."""
    # the interpreter's switch interval: an in-process Engine shortens it for its scheduler loop, and every
    # later test's threads would hand the GIL back and forth at that pace
    got: dict[str, object] = {"switch interval": sys.getswitchinterval()}
    torch = sys.modules.get("torch")
    if torch is None:
        return got
    if torch.cuda.is_available():
        got["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    got.update(
        {
            "default dtype": torch.get_default_dtype(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32 matmul precision": torch.get_float32_matmul_precision(),
            "threads": torch.get_num_threads(),
        }
    )
    return got


@pytest.fixture(autouse=True)
def _process_settings_restored() -> Iterator[None]:
    """Every test leaves the process-wide settings as it found them (monkeypatch, or a fixture that restores
    them), so the GPU list passes in any order."""
    before = process_settings()
    yield
    after = process_settings()
    changed = {k: (before[k], after[k]) for k in before.keys() & after.keys() if before[k] != after[k]}
    assert not changed, f"the test left process-wide settings changed (before, after): {changed}"


@contextlib.contextmanager
def in_process_engines() -> Iterator[list]:
    """Engines built in this process (engine.runtime.engine.Engine): append each; when the block ends their
    speaker_encoder threads stop and the switch interval the first one shortened is restored."""
    interval = sys.getswitchinterval()
    engines: list = []
    try:
        yield engines
    finally:
        for engine in engines:
            engine.speaker.close()
        sys.setswitchinterval(interval)


@pytest.fixture
def built_engines() -> Iterator[list]:
    """in_process_engines() for one test."""
    with in_process_engines() as engines:
        yield engines


def loopback_socket() -> socket.socket:
    """A TCP socket bound on 127.0.0.1: to a port the OS picks, or, with ZONOS_TEST_PORTS=LO-HI set, to a free port
    of that range (the tests of a machine shared with other work keep to the ports they were given). Every port a
    test serves on comes from here."""
    span = os.environ.get("ZONOS_TEST_PORTS", "").strip()
    if not span:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        return s
    lo, _, hi = span.partition("-")
    ports = list(range(int(lo), int(hi or lo) + 1))
    start = random.randrange(len(ports))  # two test workers rarely try the same port first
    for port in ports[start:] + ports[:start]:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        return s
    raise RuntimeError(f"no free loopback port in ZONOS_TEST_PORTS={span}")


def free_port() -> int:
    """A loopback port free now (loopback_socket) for a server the test starts."""
    with loopback_socket() as s:
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, data_dir: Path, *extra: str, nofile: int | None = None) -> None:
        """`nofile`: the server's open-file limit (soft and hard), as a host may set it low."""
        self.port = free_port()
        self.data_dir = data_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/ws"
        self.log = data_dir.parent / f"server-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "app",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            "--max-batch",
            "6",
            "--max-context",
            "1024",
            "--no-text-normalization",
            # 2 busy cores generate slower than real time: a player would always be dry, so give the next
            # sentence of a reply time to arrive (tests/engine/test_continuation.py tests the flush itself)
            "--continuation-grace-ms",
            "5000",
            # ... and every queued request would be predicted late and refused at the door: the door is
            # off here (0), tests/system/test_storm.py turns it on
            "--max-queue-ms",
            "0",
            # stopped at once at the module's end, whatever a test left speaking (tests/system/test_drain.py drains)
            "--drain-timeout-s",
            "0",
            *extra,
        ]
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        limit = None if nofile is None else functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, (nofile,) * 2)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=limit,
        )

    def wait_ready(self, timeout: float = 180) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # often: the suite waits for some 40 starts
        raise TimeoutError(f"server not ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@contextlib.contextmanager
def in_process_gateway(data_dir: Path, *extra: str) -> Iterator[tuple[int, object]]:
    """The gateway served in this process (its uvicorn server on a thread, as `python -m app` runs it, with its
    engine process), ready: (its port, its Starlette app), so a test can look at what the gateway holds."""
    import threading

    from app.__main__ import parse_args
    from app.server import create_app, gateway_server

    port = free_port()
    settings = parse_args(["--data-dir", str(data_dir), *extra, "--port", str(port), "--log-level", "WARNING"])
    app = create_app(settings)
    server = gateway_server(app, settings)  # as `python -m app` serves (its protocols too)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            time.sleep(0.2)
        yield port, app
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def servers(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """A starter of servers (ready when it returns), each stopped when the block ends."""
    started: list[ServerProcess] = []

    def start(*extra: str, data_dir: Path | None = None, nofile: int | None = None) -> ServerProcess:
        d = data_dir or tmp_path_factory.mktemp("data")
        srv = ServerProcess(d, *extra, nofile=nofile)
        started.append(srv)
        srv.wait_ready()
        return srv

    try:
        yield start
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Servers of one test module, stopped when it ends (idle ones left running would take CPU from every
    later module)."""
    with servers(tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Servers that several test modules share, one per set of arguments: started on first use, stopped when
    the session ends (each start costs seconds of imports and warm-up). For tests that leave the server as
    they found it; a test that needs a fresh server, or stops it, uses start_server."""
    running: dict[tuple[str, ...], ServerProcess] = {}
    with servers(tmp_path_factory) as start:

        def get(*extra: str) -> ServerProcess:
            if extra not in running:
                running[extra] = start(*extra)
            return running[extra]

        yield get


# The keyed server that modules share (shared_server(*KEYED)). A voice library is its key's own, so each module
# speaks with keys of its own: tests/system/test_dialects.py the first, test_reliability.py the second,
# test_gateway_http.py the last two.
API_KEYS = ("dialect-key", "k-test-7c1e", "alpha", "beta")
KEYED = tuple(a for key in API_KEYS for a in ("--api-key", key))
# One decode slot (the door off) that a held request fills: test_gateway_http, test_gateway_ws and test_fuzz share it.
ONE_SLOT = ("--max-batch", "1")
# A ping every PING_S (an idle of a few seconds is many ping intervals), no key: test_dialects and test_storm
# share it.
PING_S = 0.2
PINGING = ("--ws-ping-interval", str(PING_S), "--idle-timeout", "30")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One server shared by the gateway tests (tiny CPU model)."""
    with servers(tmp_path_factory) as start:
        yield start()
