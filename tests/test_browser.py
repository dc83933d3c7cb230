"""The demo page in a real browser: Debian's chromium driven by Playwright against a real server.

Checks, inside the page: cloning a voice through the upload form (and from a fake microphone), speaking
with audio frames arriving and the playback worklet reporting played samples, Stop answered by the
server's `cancelled` with the audio stopping, and a screenshot for the README
(test-artifacts/demo-page.png). Needs `apt-get install chromium` and the playwright Python package;
skipped otherwise. The page exposes its counters on `window.__zonos`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
np = pytest.importorskip("numpy")
sf = pytest.importorskip("soundfile")

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    # a fake microphone (a beep) and an auto-accepted permission prompt, for the recording test
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
]
TIMEOUT_MS = 30_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    """A real `python -m app` on a free loopback port with its own data dir (tiny random CPU model)."""
    data = tmp_path_factory.mktemp("browser-data")
    port = _free_port()
    log = data.parent / f"browser-server-{port}.log"
    device = os.environ.get("ZONOS_BROWSER_TEST_DEVICE", "cpu")
    cmd = [sys.executable, "-m", "app", "--port", str(port), "--data-dir", str(data), "--device", device]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready within 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server_url):
    """A fresh page (own localStorage) with the session connected; fails on any page error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, permissions=["microphone"])
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server_url + "/")
    pg.wait_for_function("window.__zonos && window.__zonos.connected")
    pg.wait_for_selector("#p-language option[value='de']", state="attached")  # capabilities applied
    yield pg
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def z(page, expr: str):
    return page.evaluate(f"window.__zonos.{expr}")


STATE_JS = "({...window.__zonos, voices: window.__zonos.voices.map(v => v.name), encodeWav16: null, blobToWav: null})"


def wait(page, js: str, arg=None, timeout: float = TIMEOUT_MS) -> None:
    """page.wait_for_function, but a timeout reports the page's counters and its event log."""
    try:
        page.wait_for_function(js, arg=arg, timeout=timeout)
    except sync_api.TimeoutError:
        state = page.evaluate(STATE_JS)
        events = page.inner_text("#log")
        raise AssertionError(f"timed out waiting for {js}\nstate: {state}\nevents:\n{events}") from None


def write_clip(path: Path, seconds: float = 1.0, rate: int = 16000) -> Path:
    """A 16-bit WAV hum; the file name seeds it, so different names make different (not deduplicated) voices."""
    t = np.arange(int(seconds * rate)) / rate
    seed = zlib.crc32(path.name.encode())
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * (120 + seed % 100) * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(len(t))
    sf.write(path, x.astype(np.float32), rate, subtype="PCM_16")
    return path


def clone_from_file(page, clip: Path, name: str) -> str:
    page.fill("#clone-name", name)
    page.set_input_files("#clone-file", str(clip))
    page.click("#clone-submit")
    wait(page, "name => window.__zonos.voices.some(v => v.name === name)", arg=name)
    return page.evaluate("name => window.__zonos.voices.find(v => v.name === name).id", name)


def set_param(page, name: str, value: str) -> None:
    page.fill(f"#p-{name}", value)


def test_page_renders_honestly(page):
    assert page.title().startswith("zonos-gateway")
    assert "Random weights: the model speaks noise" in page.inner_text(".banner")
    assert page.inner_text("#conn") == "connected"
    # the controls are built from /tts/capabilities and carry the protocol's defaults
    assert page.input_value("#p-temperature") == "1.15"
    assert page.input_value("#p-top_k") == "106"
    assert page.input_value("#p-sample_rate") == "44100"
    assert page.locator("#p-speaking_rate_bucket option").count() == 9  # off + 8 buckets
    assert page.input_value("#voice") == ""  # the model's own voice


def test_clone_upload_appears_in_picker(page, tmp_path):
    vid = clone_from_file(page, write_clip(tmp_path / "ada.wav"), "Ada test")
    # selected in the picker, listed in the library with a playable preview
    assert page.input_value("#voice") == vid
    assert page.locator("#voice option", has_text="Ada test").count() == 1
    row = page.locator(f".library li[data-id='{vid}']")
    assert row.count() == 1 and "clip" in row.inner_text()
    assert "Cloned" in page.inner_text("#clone-status")
    row.get_by_role("button", name="Preview Ada test").click()
    wait(page, "document.querySelector('#preview-audio').currentTime > 0")


def test_record_from_fake_microphone(page):
    # Chromium's fake device plays a beep; the page re-encodes the recording as a 16-bit WAV itself.
    page.click("#rec")
    page.wait_for_timeout(1300)
    page.click("#rec")
    wait(page, "!document.querySelector('#rec-audio').hidden")
    assert "16-bit WAV" in page.inner_text("#clone-status")
    page.fill("#clone-name", "Mic test")
    page.click("#clone-submit")
    wait(page, "window.__zonos.voices.some(v => v.name === 'Mic test')")
    voice = page.evaluate("window.__zonos.voices.find(v => v.name === 'Mic test')")
    assert voice["source"] == "clip" and voice["details"]["seconds"] >= 0.5


def test_speak_plays_audio_and_reports_metrics(page, tmp_path):
    clone_from_file(page, write_clip(tmp_path / "bea.wav"), "Bea test")
    set_param(page, "max_frames", "100")  # at most ~1.2 s of audio per sentence keeps the CPU test short
    set_param(page, "seed", "7")
    # the default text: three sentences, each streamed while the next one is generated
    page.click("#speak")
    wait(page, "window.__zonos.framesReceived > 0")
    wait(page, "window.__zonos.samplesPlayed > 0")
    # the README screenshot: mid-speech when possible, with the first sentence's server stats in
    wait(page, "window.__zonos.dones >= 1 || window.__zonos.lastTurnEnd !== null")
    page.wait_for_timeout(400)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-page.png"), full_page=True)

    wait(page, "window.__zonos.lastTurnEnd !== null", timeout=60_000)
    zs = page.evaluate(STATE_JS)
    assert zs["lastTurnEnd"] == "done", zs
    assert zs["playerKind"] == "worklet" and zs["contextRate"] == 44100
    assert zs["bytesReceived"] > 0 and zs["strayFrames"] == 0 and zs["framesDropped"] == 0
    done = zs["lastDone"]
    assert done["type"] == "audio.done" and done["stats"]["frames"] <= 100
    assert zs["dones"] == 3 and zs["flushed"] == 1 and zs["clientTtfaMs"] > 0
    # everything received was played (the tail is played out even below the start threshold)
    assert zs["samplesPlayed"] * 4 >= zs["bytesReceived"]
    assert zs["bufferedMs"] == 0
    for metric in ("#m-ttfa-client", "#m-ttfa-server", "#m-rtf", "#m-audio", "#m-underruns"):
        assert page.inner_text(metric) != "–", metric
    assert page.inner_text("#play-state") == "idle"
    assert page.locator("#log li", has_text="✓ u_").count() == 3


def test_stop_cancels_and_silences(page):
    set_param(page, "max_frames", "600")  # ~7 s per sentence, and no early end: long enough to stop in the middle
    page.check("#p-ignore_eos")
    page.select_option("#p-sample_rate", "24000")
    page.fill("#text", "This long sentence is interrupted in the middle, so nobody hears how it ends.")
    page.focus("#text")
    page.keyboard.press("Control+Enter")  # the shortcut speaks too
    wait(page, "window.__zonos.samplesPlayed > 0")
    assert z(page, "contextRate") == 24000
    assert page.is_enabled("#stop")
    page.click("#stop")
    wait(page, "window.__zonos.cancelled === 1")
    wait(page, "window.__zonos.lastTurnEnd === 'stopped'")
    assert z(page, "lastCancelled")["type"] == "cancelled"
    assert z(page, "dones") == 0 and z(page, "flushed") == 0  # stopped in the middle of the sentence
    page.wait_for_timeout(300)  # let the worklet report its emptied buffer
    frames, played = z(page, "framesReceived"), z(page, "samplesPlayed")
    page.wait_for_timeout(1200)
    assert z(page, "framesReceived") == frames, "audio frames were accepted after Stop"
    assert z(page, "samplesPlayed") == played, "audio kept playing after Stop"
    assert z(page, "bufferedMs") == 0 and z(page, "strayFrames") == 0
    assert page.inner_text("#play-state") == "stopped"
    assert not page.is_enabled("#stop")
    assert "cancelled by the server" in page.inner_text("#log")


def test_blend_and_delete(page, tmp_path):
    a = clone_from_file(page, write_clip(tmp_path / "a.wav"), "Cy test")
    b = clone_from_file(page, write_clip(tmp_path / "b.wav", seconds=1.5), "Di test")
    page.click("#blend-box summary")
    page.select_option("#blend-a", a)
    page.select_option("#blend-b", b)
    page.eval_on_selector("#blend-t", "el => { el.value = '0.25'; el.dispatchEvent(new Event('input')); }")
    assert page.inner_text("#blend-t-out") == "75% A · 25% B"
    page.click("#blend-submit")
    wait(page, "window.__zonos.voices.some(v => v.source === 'blend')")
    blend = page.evaluate("window.__zonos.voices.find(v => v.source === 'blend')")
    assert blend["details"]["t"] == 0.25 and page.input_value("#voice") == blend["id"]
    page.once("dialog", lambda d: d.accept())
    page.locator(f".library li[data-id='{blend['id']}']").get_by_role("button", name="Delete").click()
    wait(page, "id => !window.__zonos.voices.some(v => v.id === id)", arg=blend["id"])
    assert page.input_value("#voice") == ""


def test_no_external_requests(browser, server_url):
    """The page loads nothing from outside the server (no CDNs)."""
    context = browser.new_context()
    pg = context.new_page()
    hosts: set[str] = set()
    pg.on("request", lambda r: hosts.add(r.url.split("/")[2] if "://" in r.url else r.url[:16]))
    pg.goto(server_url + "/")
    pg.wait_for_function("window.__zonos && window.__zonos.connected")
    context.close()
    assert hosts <= {server_url.split("/")[2], "data:image/svg+"}, hosts

