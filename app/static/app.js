// zonos-gateway demo page: one persistent WebSocket session (/v1/tts/ws, see docs/protocol.md),
// float32 PCM streamed into an AudioWorklet ring buffer, plus the voice library over /v1/voices.
// Plain ES modules, no build step and no dependencies; this one wires them together and starts the page.

import { AUTH, api, apiKey, setApiKey } from "./api.js";
import "./clone.js"; // the Clone a voice card wires itself up
import { counters } from "./counters.js";
import { $ } from "./dom.js";
import { log } from "./eventlog.js";
import { updateMetrics } from "./metrics.js";
import {
  applyCapabilities,
  badNumberField,
  initRangeOutputs,
  limits,
  readParams,
  readSampleRate,
  restoreParams,
} from "./params.js";
import { setPlaybackEventHandler } from "./player.js";
import { connect, reconnectNow, setSessionHandlers } from "./session.js";
import {
  awaitingServer,
  onConnectionLost,
  onStall,
  onPlaybackEvent,
  onTurnAudio,
  onTurnMessage,
  setPlayState,
  speak,
  stop,
  trackSentences,
} from "./speech.js";
import { loadVoices, savedVoiceId, selectedVoiceId } from "./voices.js";
import { drawWave } from "./waveform.js";
import { blobToWav, encodeWav16 } from "./wav.js";

counters.encodeWav16 = encodeWav16; // for tests
counters.blobToWav = blobToWav;

const speakBtn = $("#speak");
const stopBtn = $("#stop");
const textBox = $("#text");

let sessions = 0;
setSessionHandlers({
  created(msg) {
    // (no maxLength from max_buffer_chars: a longer paste was cut without a word; a text is sent in parts anyway)
    Object.assign(limits, msg.limits);
    // a reconnect: voices created or deleted elsewhere meanwhile (the first list is the page's own, in init)
    if (sessions++) loadVoices();
  },
  message(msg) {
    // a voice deleted elsewhere (another page, the API): the picker stops offering it
    if (msg.type === "error" && msg.code === "unknown_voice") loadVoices();
    onTurnMessage(msg);
  },
  audio: onTurnAudio,
  closed: onConnectionLost,
  waiting: awaitingServer,
  stalled: onStall,
});
setPlaybackEventHandler(onPlaybackEvent);

function desiredConfig() {
  return {
    voice: selectedVoiceId() || null,
    encoding: "pcm_f32le", // the worklet plays float32 directly
    sample_rate: readSampleRate(),
    params: readParams(),
  };
}

function onSpeak() {
  const t0 = performance.now(); // client-side first-audio time starts at the click
  const text = textBox.value.trim();
  if (!text) {
    textBox.focus();
    return;
  }
  const bad = badNumberField();
  if (bad) {
    setPlayState(`not sent: ${bad.name} needs a number`, "err");
    bad.focus();
    return;
  }
  speak(text, desiredConfig(), t0);
  // On a small screen the output may be below the fold: bring it up (no scroll when it is in view).
  const out = $("#card-output").getBoundingClientRect();
  if (out.top < 0 || out.bottom > innerHeight) $("#card-output").scrollIntoView({ block: "nearest", behavior: "smooth" });
}

speakBtn.addEventListener("click", onSpeak);
stopBtn.addEventListener("click", stop);
textBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    onSpeak();
  }
});
const countChars = () => ($("#char-count").textContent = textBox.value.length);
// The text is kept like the parameters: a reload (or a page the server restart made you reload) lost what was typed.
const TEXT_STORE = "zonos.text";
if (localStorage.getItem(TEXT_STORE) !== null) textBox.value = localStorage.getItem(TEXT_STORE);
textBox.addEventListener("input", () => {
  countChars();
  try {
    localStorage.setItem(TEXT_STORE, textBox.value);
  } catch {
    localStorage.removeItem(TEXT_STORE); // past the browser's quota (megabytes): not kept
  }
});
countChars();

function frame() {
  drawWave();
  trackSentences();
  updateMetrics();
  requestAnimationFrame(frame);
}

async function init() {
  initRangeOutputs();
  if (AUTH) {
    const keyInput = $("#api-key");
    keyInput.value = apiKey();
    $("#key-form").addEventListener("submit", (e) => {
      e.preventDefault(); // Enter in the field: apply the key (the change event does the work)
      keyInput.blur();
    });
    keyInput.addEventListener("change", () => {
      setApiKey(keyInput.value.trim());
      reconnectNow();
      loadVoices();
    });
  }
  connect();
  requestAnimationFrame(frame);
  try {
    applyCapabilities(await (await api("/tts/capabilities")).json()); // also restores the saved parameters
  } catch (e) {
    log(`could not read /tts/capabilities: ${e.message}`, "err");
    restoreParams();
  }
  await loadVoices(savedVoiceId());
}

init();
