// zonos-gateway demo page: one persistent WebSocket session (/v1/tts/ws, see docs/protocol.md),
// float32 PCM streamed into an AudioWorklet ring buffer, plus the voice library over /v1/voices.
// Plain ES module, no build step and no dependencies.

import { PlaybackRing } from "./worklet.js";

const $ = (sel) => document.querySelector(sel);
const AUTH = document.body.dataset.auth === "true";
const KEY_STORE = "zonos.apiKey";
const PARAMS_STORE = "zonos.params";
const VOICE_STORE = "zonos.voice";
const FRAME_RATE = 44100 / 512; // model frames per second of audio

// Counters the browser tests read (and handy in the devtools console).
const Z = (window.__zonos = {
  connected: false,
  sessionId: null,
  framesReceived: 0, // binary audio frames accepted for playback
  bytesReceived: 0,
  framesDropped: 0, // frames of cancelled text that arrived before `cancelled` (expected, dropped)
  strayFrames: 0, // frames with no turn to play them (would be a protocol violation)
  samplesPlayed: 0, // reported by the playback worklet (since the current AudioContext was opened)
  underruns: 0,
  bufferedMs: 0,
  playerKind: null, // "worklet" | "script-processor"
  contextRate: null,
  clientTtfaMs: null,
  state: "idle", // "idle" | "speaking" | "stopping"
  turnsEnded: 0,
  lastTurnEnd: null, // "done" | "stopped" | "connection lost"
  lastStart: null,
  lastDone: null,
  dones: 0,
  flushed: 0,
  cancelled: 0,
  lastCancelled: null,
  errors: [],
  voices: [],
});

// ---------------------------------------------------------------------------------------------------
// Small helpers

function apiKey() {
  return AUTH ? localStorage.getItem(KEY_STORE) || "" : "";
}

// fetch() with the API key header; throws Error("code: message") on the server's JSON errors.
async function api(path, opts = {}) {
  const headers = new Headers(opts.headers || {});
  if (apiKey()) headers.set("X-API-Key", apiKey());
  const res = await fetch(path, { ...opts, headers });
  if (!res.ok) {
    let msg = `${res.status} ${res.statusText}`;
    try {
      const j = await res.json();
      if (j.error) msg = `${j.error.message} (${j.error.code})`;
    } catch {
      /* not JSON */
    }
    const err = new Error(msg);
    err.status = res.status;
    throw err;
  }
  return res;
}

function el(tag, props = {}, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") n.className = v;
    else if (k === "dataset") Object.assign(n.dataset, v);
    else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) n.setAttribute(k, v === true ? "" : v);
  }
  n.append(...children.filter((c) => c !== null && c !== undefined));
  return n;
}

const fmtMs = (x) => (x == null ? "–" : x < 1000 ? `${Math.round(x)} ms` : `${(x / 1000).toFixed(2)} s`);
const fmtS = (samples, rate) => `${(samples / rate).toFixed(1)} s`;

// Voice names allow letters, digits, spaces and . , ' ( ) - _ (server rule).
const cleanName = (s) =>
  s.replace(/[^\p{L}\p{N}_ .,'()-]+/gu, " ").replace(/\s+/g, " ").trim().slice(0, 64);

function setStatus(node, text, kind = "") {
  node.textContent = text;
  node.className = `form-status ${kind}`;
}

// ---------------------------------------------------------------------------------------------------
// Event log: what the session said, newest first.

const logList = $("#log");
function log(text, kind = "") {
  const t = new Date().toLocaleTimeString([], { hour12: false });
  logList.prepend(el("li", { class: kind }, el("time", {}, t), el("span", {}, text)));
  while (logList.children.length > 60) logList.lastChild.remove();
}

// ---------------------------------------------------------------------------------------------------
// Parameters: static controls in the HTML, option lists from /tts/capabilities, kept in localStorage.

const form = $("#params");
let caps = null;
let limits = { max_frames: 3000 };

function initRangeOutputs() {
  for (const input of form.querySelectorAll('input[type="range"]')) {
    const out = form.querySelector(`output[for="${input.id}"]`);
    const show = () => (out.textContent = Number(input.value).toFixed(2));
    input.addEventListener("input", show);
    show();
  }
}

function applyCapabilities(c) {
  caps = c;
  const lang = $("#p-language");
  lang.replaceChildren(...c.text_norm_languages.map((l) => el("option", { value: l }, l)));
  const rate = $("#p-speaking_rate_bucket");
  const names = ["slowest", "very slow", "slow", "relaxed", "normal", "brisk", "fast", "fastest"];
  rate.replaceChildren(
    el("option", { value: "" }, "natural (off)"),
    ...c.speaking_rate_buckets.map((label, i) =>
      el("option", { value: String(i), title: `bucket ${i}: ${label} bytes of text per second` }, `${names[i] ?? i} (${label})`),
    ),
  );
  $("#rate-field").hidden = !c.speaking_rate_enabled;
  $("#p-repetition_codebooks").max = c.n_codebooks;
  $("#p-max_frames").max = c.max_tokens;
  limits.max_frames = c.max_tokens;
  $("#p-max_frames").placeholder = `server limit (${c.max_tokens})`;
  restoreParams();
}

// What this server cannot do, shown as off (and why), whatever the saved or default setting says.
function applyServerSwitches() {
  const norm = $("#p-text_normalization");
  const off = caps && !caps.text_normalization_enabled;
  norm.disabled = !!off;
  if (off) norm.checked = false;
  $("#norm-off").hidden = !off;
  norm.closest("label").title = off ? "This server was started with --no-text-normalization" : "";
}

function readParams() {
  const v = (name) => form.elements[name].value;
  const num = (name) => Number(v(name));
  const p = {
    temperature: num("temperature"),
    top_k: Math.round(num("top_k")),
    top_p: num("top_p"),
    min_p: num("min_p"),
    repetition_window: Math.round(num("repetition_window")),
    repetition_penalty: num("repetition_penalty"),
    repetition_codebooks: Math.round(num("repetition_codebooks")),
    seed: v("seed") === "" ? null : Math.round(num("seed")),
    // An empty field means "the server's limit": sending null would keep an earlier value (merge semantics).
    max_frames: v("max_frames") === "" ? limits.max_frames : Math.round(num("max_frames")),
    ignore_eos: form.elements.ignore_eos.checked,
    language: v("language"),
    text_normalization: form.elements.text_normalization.checked,
    accurate_mode: form.querySelector('input[name="mode"]:checked').value === "accurate",
    clean_speaker_background: form.elements.clean_speaker_background.checked,
  };
  if (v("speaking_rate_bucket") !== "") p.speaking_rate_bucket = Number(v("speaking_rate_bucket"));
  return p;
}

function saveParams() {
  let state = {};
  try {
    state = JSON.parse(localStorage.getItem(PARAMS_STORE) || "{}"); // a control this server disables keeps its choice
  } catch {
    /* corrupt: start again */
  }
  for (const input of form.querySelectorAll("[name]")) {
    if (input.disabled) continue;
    if (input.type === "radio") {
      if (input.checked) state[input.name] = input.value;
    } else state[input.name] = input.type === "checkbox" ? input.checked : input.value;
  }
  localStorage.setItem(PARAMS_STORE, JSON.stringify(state));
}

function restoreParams(defaults = false) {
  let state = {};
  try {
    state = defaults ? {} : JSON.parse(localStorage.getItem(PARAMS_STORE) || "{}");
  } catch {
    /* corrupt: defaults */
  }
  for (const input of form.querySelectorAll("[name]")) {
    const saved = state[input.name];
    if (input.type === "radio") {
      input.checked = saved !== undefined ? saved === input.value : input.dataset.default === "true";
    } else if (input.type === "checkbox") {
      input.checked = saved !== undefined ? !!saved : input.dataset.default === "true";
    } else {
      const val = saved !== undefined ? saved : input.dataset.default;
      // Only accept a saved option that still exists (the server may have changed).
      if (input.tagName !== "SELECT" || [...input.options].some((o) => o.value === val)) input.value = val;
    }
    input.dispatchEvent(new Event("input"));
  }
  applyServerSwitches();
  saveParams();
}

form.addEventListener("input", saveParams);
form.addEventListener("change", saveParams);
form.addEventListener("submit", (e) => e.preventDefault());
$("#params-reset").addEventListener("click", () => restoreParams(true));

// ---------------------------------------------------------------------------------------------------
// Voices: picker, library, clone (file or microphone), blend.

const voiceSelect = $("#voice");

function voiceLabel(v) {
  const extra = v.details?.seconds ? ` · ${v.details.seconds} s` : "";
  return `${v.name} (${v.source}${extra})`;
}

async function loadVoices(selectId) {
  let voices;
  try {
    voices = (await (await api("/v1/voices")).json()).voices;
  } catch (e) {
    $("#library").replaceChildren(el("li", { class: "empty error" }, `Could not load voices: ${e.message}`));
    return;
  }
  Z.voices = voices;
  const want = selectId ?? voiceSelect.value ?? localStorage.getItem(VOICE_STORE) ?? "";
  const mine = voices.filter((v) => !v.default);
  const defaults = voices.filter((v) => v.default);
  const groups = [el("option", { value: "" }, "Model's own voice (no speaker)")];
  if (mine.length) groups.push(el("optgroup", { label: "Your voices" }, ...mine.map(voiceOption)));
  if (defaults.length) groups.push(el("optgroup", { label: "Default voices" }, ...defaults.map(voiceOption)));
  voiceSelect.replaceChildren(...groups);
  voiceSelect.value = voices.some((v) => v.id === want) ? want : "";
  onVoiceChange();
  renderLibrary(voices);
  renderBlend(voices);
}

function voiceOption(v) {
  return el("option", { value: v.id }, voiceLabel(v));
}

function onVoiceChange() {
  localStorage.setItem(VOICE_STORE, voiceSelect.value);
  const v = Z.voices.find((x) => x.id === voiceSelect.value);
  $("#voice-now").textContent = v ? v.name : "model's own voice";
  // Expressive mode and the clean-background marker only exist together with a speaker embedding.
  const hasVoice = !!v;
  for (const n of form.querySelectorAll('input[name="mode"], #p-clean_speaker_background')) n.disabled = !hasVoice;
  for (const row of document.querySelectorAll(".library li[data-id]")) {
    row.classList.toggle("selected", row.dataset.id === voiceSelect.value);
  }
}
voiceSelect.addEventListener("change", onVoiceChange);

function renderLibrary(voices) {
  const list = $("#library");
  $("#lib-count").textContent = voices.length ? `${voices.length} voice${voices.length > 1 ? "s" : ""}` : "";
  if (!voices.length) {
    list.replaceChildren(el("li", { class: "empty" }, "No voices yet: clone one above."));
    return;
  }
  list.replaceChildren(
    ...voices.map((v) => {
      const meta = [v.source, v.details?.seconds ? `${v.details.seconds} s` : null, v.details?.t != null ? `t=${v.details.t}` : null]
        .filter(Boolean)
        .join(" · ");
      return el(
        "li",
        { dataset: { id: v.id }, class: v.id === voiceSelect.value ? "selected" : "" },
        el(
          "button",
          { class: "v-main", type: "button", title: "Use this voice", onclick: () => { voiceSelect.value = v.id; onVoiceChange(); } },
          el("span", { class: "v-name" }, v.name, v.default ? el("span", { class: "badge" }, "default") : null),
          el("span", { class: "v-meta" }, `${meta} · ${v.id}`),
        ),
        el("span", { class: "v-actions" },
          el("button", { class: "icon", type: "button", title: v.has_preview ? "Play the reference clip" : "No reference clip (embedding or blend)",
            disabled: !v.has_preview, "aria-label": `Preview ${v.name}`, onclick: (e) => previewVoice(v, e.currentTarget) }, "▶"),
          el("button", { class: "icon", type: "button", title: "Download the speaker embedding (.npy)", "aria-label": `Download ${v.name} embedding`,
            onclick: () => downloadEmbedding(v) }, "⤓"),
          v.default ? null : el("button", { class: "icon danger", type: "button", title: "Delete this voice", "aria-label": `Delete ${v.name}`,
            onclick: () => deleteVoice(v) }, "✕"),
        ),
      );
    }),
  );
}

let previewUrl = null;
async function previewVoice(v, button) {
  // Fetched as a blob so the API key travels in a header, not in a URL.
  const audio = $("#preview-audio");
  try {
    const blob = await (await api(`/v1/voices/${encodeURIComponent(v.id)}/preview`)).blob();
    if (previewUrl) URL.revokeObjectURL(previewUrl);
    previewUrl = URL.createObjectURL(blob);
    audio.src = previewUrl;
    button.classList.add("playing");
    audio.onended = audio.onpause = () => button.classList.remove("playing");
    await audio.play();
  } catch (e) {
    button.classList.remove("playing");
    log(`preview failed: ${e.message}`, "err");
  }
}

async function downloadEmbedding(v) {
  try {
    const blob = await (await api(`/v1/voices/${encodeURIComponent(v.id)}/embedding`)).blob();
    const a = el("a", { href: URL.createObjectURL(blob), download: `${cleanName(v.name) || v.id}.npy` });
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 5000);
  } catch (e) {
    log(`download failed: ${e.message}`, "err");
  }
}

async function deleteVoice(v) {
  if (!confirm(`Delete the voice "${v.name}"?`)) return;
  try {
    await api(`/v1/voices/${encodeURIComponent(v.id)}`, { method: "DELETE" });
    log(`deleted voice ${v.name}`);
    await loadVoices(voiceSelect.value === v.id ? "" : undefined);
  } catch (e) {
    log(`delete failed: ${e.message}`, "err");
  }
}

const NEEDS_TWO = "Needs two voices in the library.";

function renderBlend(voices) {
  const a = $("#blend-a");
  const b = $("#blend-b");
  const prevA = a.value;
  const prevB = b.value;
  const opts = () => voices.map(voiceOption);
  a.replaceChildren(...opts());
  b.replaceChildren(...opts());
  if (voices.some((v) => v.id === prevA)) a.value = prevA;
  if (voices.some((v) => v.id === prevB)) b.value = prevB;
  if (voices.length > 1 && a.value === b.value) b.selectedIndex = a.selectedIndex === 0 ? 1 : 0; // two different voices
  const ok = voices.length >= 2;
  $("#blend-submit").disabled = !ok;
  const status = $("#blend-status");
  // Keep what the last blend said ("Created ..."); only the "needs two voices" hint comes and goes.
  if (!ok) setStatus(status, NEEDS_TWO, "muted");
  else if (status.textContent === NEEDS_TWO) setStatus(status, "");
  updateBlendLabel();
}

function updateBlendLabel() {
  const t = Number($("#blend-t").value);
  $("#blend-t-out").textContent = `${Math.round((1 - t) * 100)}% A · ${Math.round(t * 100)}% B`;
}
$("#blend-t").addEventListener("input", updateBlendLabel);

$("#blend-submit").addEventListener("click", async () => {
  const status = $("#blend-status");
  const a = Z.voices.find((v) => v.id === $("#blend-a").value);
  const b = Z.voices.find((v) => v.id === $("#blend-b").value);
  if (!a || !b || a.id === b.id) return setStatus(status, "Pick two different voices.", "err");
  const t = Number($("#blend-t").value);
  // Name it ourselves: the default "A + B" would need a '+', which voice names do not allow.
  const name = cleanName($("#blend-name").value) || cleanName(`${a.name} - ${b.name} (${t.toFixed(2)})`);
  setStatus(status, "Blending…");
  try {
    const v = await (await api("/v1/voices/blend", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ a: a.id, b: b.id, t, name }),
    })).json();
    setStatus(status, `Created "${v.name}".`, "ok");
    $("#blend-name").value = "";
    log(`blended ${a.name} and ${b.name} (t=${t}) → ${v.name}`);
    await loadVoices(v.id);
  } catch (e) {
    setStatus(status, e.message, "err");
  }
});

// Clone: a file, or a microphone recording converted to a 16-bit WAV here in the browser.
let recordedWav = null; // Blob
let recorder = null;

$("#clone-file").addEventListener("change", () => {
  const f = $("#clone-file").files[0];
  if (f) clearRecording();
  if (f && !$("#clone-name").value) $("#clone-name").value = cleanName(f.name.replace(/\.[^.]+$/, ""));
});

function clearRecording() {
  recordedWav = null;
  const audio = $("#rec-audio");
  if (audio.src) URL.revokeObjectURL(audio.src);
  audio.removeAttribute("src");
  audio.hidden = true;
}

$("#clone").addEventListener("submit", async (e) => {
  e.preventDefault();
  const status = $("#clone-status");
  const files = [...$("#clone-file").files];
  if (!files.length && !recordedWav) return setStatus(status, "Choose an audio file or record one.", "err");
  const name = cleanName($("#clone-name").value) || cleanName(files[0]?.name.replace(/\.[^.]+$/, "") ?? "") || "recording";
  const body = new FormData();
  if (files.length) for (const f of files) body.append("file", f, f.name);
  else body.append("file", recordedWav, "recording.wav");
  body.append("name", name);
  const button = $("#clone-submit");
  button.disabled = true;
  setStatus(status, "Uploading and encoding the voice…");
  try {
    const res = await api("/v1/voices", { method: "POST", body });
    const v = await res.json();
    // The same clip again is the voice it already is; under a new name it is renamed (the server says so).
    const msg = v.renamed_from
      ? `This clip was already in the library as "${v.renamed_from}": renamed to "${v.name}".`
      : v.deduplicated
        ? `This clip is already in the library as "${v.name}".`
        : `Cloned "${v.name}".`;
    setStatus(status, msg, "ok");
    log(v.renamed_from ? `voice ${v.renamed_from} renamed to ${v.name} (same clip)`
      : v.deduplicated ? `voice ${v.name} already existed (same clip)` : `cloned voice ${v.name} (${v.id})`);
    $("#clone").reset();
    clearRecording();
    await loadVoices(v.id);
  } catch (err) {
    setStatus(status, err.message, "err");
  } finally {
    button.disabled = false;
  }
});

const canRecord = !!(navigator.mediaDevices?.getUserMedia && window.MediaRecorder);
if (!canRecord) {
  $("#rec").disabled = true;
  $("#rec").title = "Recording needs a secure context (https or localhost) and MediaRecorder support";
  $("#rec-label").textContent = "Recording unavailable here";
}

$("#rec").addEventListener("click", async () => {
  if (recorder) return recorder.stop();
  const status = $("#clone-status");
  let stream;
  try {
    // Raw-ish audio: the speaker encoder wants the voice, not the browser's noise suppression.
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
  } catch (e) {
    return setStatus(status, `Microphone unavailable: ${e.message}`, "err");
  }
  const chunks = [];
  const rec = new MediaRecorder(stream);
  recorder = rec;
  const t0 = performance.now();
  const tick = setInterval(() => {
    const s = (performance.now() - t0) / 1000;
    $("#rec-label").textContent = `Stop recording (${s.toFixed(1)} s)`;
    if (s >= 30) rec.stop(); // plenty for a voice; keeps uploads small
  }, 100);
  rec.ondataavailable = (ev) => ev.data.size && chunks.push(ev.data);
  rec.onstop = async () => {
    clearInterval(tick);
    stream.getTracks().forEach((t) => t.stop());
    recorder = null;
    $("#rec").classList.remove("recording");
    $("#rec-label").textContent = "Record again";
    try {
      const wav = await blobToWav(new Blob(chunks, { type: rec.mimeType }));
      if (wav.seconds < 0.5) throw new Error("the recording is shorter than 0.5 s");
      recordedWav = wav.blob;
      $("#clone-file").value = "";
      const audio = $("#rec-audio");
      audio.src = URL.createObjectURL(wav.blob);
      audio.hidden = false;
      if (!$("#clone-name").value) $("#clone-name").value = "My voice";
      setStatus(status, `Recorded ${wav.seconds.toFixed(1)} s (16-bit WAV, ${wav.rate} Hz). Press Clone voice.`, "ok");
    } catch (e) {
      setStatus(status, `Could not use the recording: ${e.message}`, "err");
    }
  };
  rec.start(250);
  $("#rec").classList.add("recording");
  setStatus(status, "Recording… speak naturally, then press Stop.");
});

// MediaRecorder gives webm/ogg Opus; the server wants WAV/FLAC/OGG/MP3 clips. Decode it with an
// OfflineAudioContext (which also resamples to its own rate) and write a mono 16-bit PCM WAV ourselves.
async function blobToWav(blob, rate = 44100) {
  const decoder = new OfflineAudioContext(1, 1, rate);
  const audio = await decoder.decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(audio.length);
  for (let c = 0; c < audio.numberOfChannels; c++) {
    const ch = audio.getChannelData(c);
    for (let i = 0; i < ch.length; i++) mono[i] += ch[i] / audio.numberOfChannels;
  }
  return { blob: encodeWav16(mono, audio.sampleRate), seconds: audio.duration, rate: audio.sampleRate };
}

function encodeWav16(samples, rate) {
  const data = samples.length * 2;
  const view = new DataView(new ArrayBuffer(44 + data));
  const str = (off, s) => [...s].forEach((ch, i) => view.setUint8(off + i, ch.charCodeAt(0)));
  str(0, "RIFF");
  view.setUint32(4, 36 + data, true);
  str(8, "WAVE");
  str(12, "fmt ");
  view.setUint32(16, 16, true); // fmt chunk size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true); // byte rate
  view.setUint16(32, 2, true); // block align
  view.setUint16(34, 16, true); // bits per sample
  str(36, "data");
  view.setUint32(40, data, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Blob([view], { type: "audio/wav" });
}
Z.encodeWav16 = encodeWav16; // for tests
Z.blobToWav = blobToWav;

// ---------------------------------------------------------------------------------------------------
// Audio output: AudioContext at the stream's rate -> playback worklet -> analyser -> speakers.

const audio = {
  ctx: null,
  node: null, // AudioWorkletNode or ScriptProcessorNode
  ring: null, // PlaybackRing when running on the ScriptProcessor fallback
  analyser: null,
  rate: 0, // the rate the server streams at
  opening: null, // Promise of the context + worklet set-up
  resample: 1, // ctx.sampleRate / rate, when the browser would not open the context at `rate`
  stats: { bufferedMs: 0, played: 0, underruns: 0, thresholdMs: 80, playing: false },
};

async function ensureAudio(rate) {
  if (audio.ctx && audio.rate === rate) {
    await audio.opening; // a second click while the worklet is still loading
    if (audio.ctx.state !== "running") await audio.ctx.resume(); // autoplay policy: resume on the click
    return;
  }
  audio.rate = rate;
  audio.opening = openAudio(rate, audio.ctx);
  try {
    await audio.opening;
  } catch (e) {
    audio.rate = 0; // the next click tries again
    throw e;
  }
}

async function openAudio(rate, old) {
  audio.node = null;
  if (old) await old.close();
  // Open the context at the stream's rate so the PCM needs no conversion in the browser.
  const ctx = new AudioContext({ sampleRate: rate, latencyHint: "interactive" });
  audio.ctx = ctx;
  // A new context starts a new player: its counters (played samples included) start from zero.
  audio.stats = { bufferedMs: 0, played: 0, underruns: 0, thresholdMs: 80, playing: false };
  Z.samplesPlayed = 0;
  audio.resample = ctx.sampleRate / rate;
  if (ctx.sampleRate !== rate) log(`the browser opened audio at ${ctx.sampleRate} Hz, not ${rate}; resampling here`, "warn");
  audio.analyser = ctx.createAnalyser();
  audio.analyser.fftSize = 2048;
  audio.analyser.connect(ctx.destination);
  if (ctx.audioWorklet) {
    await ctx.audioWorklet.addModule(new URL("./worklet.js", import.meta.url));
    audio.node = new AudioWorkletNode(ctx, "zonos-player", { numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1] });
    audio.node.port.onmessage = (e) => onPlayerStats(e.data);
    audio.ring = null;
    Z.playerKind = "worklet";
  } else {
    // AudioWorklet needs a secure context; the same ring buffer runs on the main thread instead.
    const ring = new PlaybackRing(ctx.sampleRate);
    const node = ctx.createScriptProcessor(2048, 0, 1);
    let since = 0;
    node.onaudioprocess = (e) => {
      ring.render(e.outputBuffer.getChannelData(0));
      since += e.outputBuffer.length;
      if (ring.events.length || since > ctx.sampleRate / 8) {
        onPlayerStats({ ...ring.stats(), events: ring.events.splice(0) });
        since = 0;
      }
    };
    audio.node = node;
    audio.ring = ring;
    Z.playerKind = "script-processor";
    log("AudioWorklet unavailable (insecure context?): using the ScriptProcessor fallback", "warn");
  }
  audio.node.connect(audio.analyser);
  Z.contextRate = ctx.sampleRate;
  $("#audio-info").textContent = `${rate / 1000} kHz float32 · ${Z.playerKind} · output latency ${fmtMs((ctx.baseLatency + (ctx.outputLatency || 0)) * 1000)}`;
  await ctx.resume();
}

function playerSend(msg, transfer) {
  if (!audio.node) return;
  if (audio.ring) {
    if (msg.type === "pcm") audio.ring.push(msg.pcm);
    else if (msg.type === "end") audio.ring.end();
    else if (msg.type === "reset") {
      audio.ring.reset();
      if (msg.stats) audio.ring.resetStats();
    }
  } else audio.node.port.postMessage(msg, transfer || []);
}

function pushPcm(f32) {
  if (audio.resample !== 1) f32 = linearResample(f32, audio.resample);
  playerSend({ type: "pcm", pcm: f32 }, [f32.buffer]);
}

// Only used when the browser refuses the requested context rate (rare): simple linear interpolation.
function linearResample(x, ratio) {
  const out = new Float32Array(Math.round(x.length * ratio));
  for (let i = 0; i < out.length; i++) {
    const p = i / ratio;
    const j = Math.floor(p);
    const f = p - j;
    out[i] = (x[j] ?? 0) * (1 - f) + (x[j + 1] ?? x[j] ?? 0) * f;
  }
  return out;
}

function onPlayerStats(s) {
  audio.stats = s;
  Z.samplesPlayed = s.played;
  Z.underruns = s.underruns;
  Z.bufferedMs = s.bufferedMs;
  for (const ev of s.events || []) {
    if (ev === "start" && turn && !turn.stopping && turn.firstPlayAt == null) turn.firstPlayAt = performance.now();
    if (ev === "drained" && turn && turn.flushed) finishTurn("done");
  }
}

// ---------------------------------------------------------------------------------------------------
// The WebSocket session: one per page, reconnected when it closes.

const session = {
  ws: null,
  ready: null, // Promise resolved on session.created
  sent: null, // the last session.config we sent (JSON), so it is only re-sent when something changed
  retry: 0,
  waiters: [], // resolvers waiting for session.updated / error after a session.config
  awaitingCancel: 0, // cancels sent but not yet answered: audio before `cancelled` belongs to old text
};
let turn = null; // the text being spoken: {ctx, t0, firstFrameAt, samples, flushed, ...}
let turnSeq = 0;

function wsUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const key = apiKey();
  return `${proto}//${location.host}/v1/tts/ws${key ? `?api_key=${encodeURIComponent(key)}` : ""}`;
}

function setConn(text, kind) {
  const pill = $("#conn");
  pill.textContent = text;
  pill.className = `pill pill-${kind}`;
}

// Replace the session with a fresh one (new API key, or settings the old one cannot undo).
function reconnectNow() {
  const old = session.ws;
  session.ws = null; // the old socket's handlers see they are stale and stay quiet
  if (old && old.readyState <= WebSocket.OPEN) old.close(1000);
  connect();
}

function connect() {
  if (AUTH && !apiKey()) {
    setConn("API key needed", "bad");
    session.ready = Promise.reject(new Error("enter the server's API key first"));
    session.ready.catch(() => {});
    return;
  }
  setConn("connecting…", "wait");
  const ws = new WebSocket(wsUrl());
  ws.binaryType = "arraybuffer";
  session.ws = ws;
  session.sent = null;
  session.awaitingCancel = 0;
  let resolveReady, rejectReady;
  session.ready = new Promise((res, rej) => ((resolveReady = res), (rejectReady = rej)));
  session.ready.catch(() => {});
  let unauthorized = false;

  ws.onmessage = (e) => {
    if (session.ws !== ws) return;
    if (typeof e.data !== "string") return onAudio(e.data);
    const msg = JSON.parse(e.data);
    if (msg.type === "session.created") {
      session.retry = 0;
      limits = { ...limits, ...msg.limits };
      textBox.maxLength = limits.max_buffer_chars ?? -1;
      Z.connected = true;
      Z.sessionId = msg.session_id;
      $("#session-id").textContent = msg.session_id;
      setConn("connected", "ok");
      log(`session ${msg.session_id} opened`);
      resolveReady();
    } else if (msg.type === "error" && msg.code === "unauthorized") {
      unauthorized = true;
    }
    onMessage(msg);
  };
  ws.onclose = (e) => {
    if (session.ws !== ws) return; // replaced on purpose
    Z.connected = false;
    rejectReady(new Error("the connection closed"));
    for (const w of session.waiters.splice(0)) w.reject(new Error("the connection closed"));
    if (turn) {
      playerSend({ type: "reset" });
      finishTurn("connection lost");
    }
    if (unauthorized) {
      setConn("wrong API key", "bad");
      log("the server refused the API key; fix it in the header field", "err");
      return; // reconnect when the key changes
    }
    // Back off 0.5 s, 1 s, 2 s … 10 s so a restarting server is not hammered.
    if (session.retry === 0) log(`connection closed (${e.code}${e.reason ? ` ${e.reason}` : ""}); reconnecting`, "warn");
    const delay = Math.min(10_000, 500 * 2 ** session.retry++);
    setConn(`disconnected · retry in ${Math.round(delay / 1000) || 1} s`, "bad");
    setTimeout(() => session.ws === ws && connect(), delay);
  };
}

function send(msg) {
  session.ws.send(JSON.stringify(msg));
}

// Send a session.config when the desired one differs from the last one sent, and wait for the answer
// so a bad parameter is reported before any text is spoken with the old settings.
async function applyConfig(cfg) {
  const json = JSON.stringify(cfg);
  if (json === session.sent) return;
  // The server merges params into the session's: a speaking rate cannot be switched back off on the
  // same session, so start a fresh one for that.
  const prev = session.sent ? JSON.parse(session.sent) : null;
  if (prev?.params.speaking_rate_bucket != null && cfg.params.speaking_rate_bucket == null) {
    log("starting a fresh session: a speaking rate cannot be switched off on the same one", "warn");
    reconnectNow();
    await session.ready;
  }
  const answer = new Promise((resolve, reject) => session.waiters.push({ resolve, reject }));
  send({ type: "session.config", ...cfg });
  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error("no answer to session.config")), 10_000));
  await Promise.race([answer, timeout]);
  session.sent = json;
}

function onMessage(msg) {
  switch (msg.type) {
    case "session.updated": {
      const w = session.waiters.shift();
      if (w) w.resolve(msg);
      log(`config: ${msg.sample_rate / 1000} kHz ${msg.encoding}, voice ${msg.voice ?? "none"}`);
      break;
    }
    case "audio.start":
      if (!turn || msg.context_id !== turn.ctx) break;
      Z.lastStart = msg;
      turn.utterances++;
      log(`▶ ${msg.utterance_id}: “${msg.text}”`);
      break;
    case "audio.done": {
      if (!turn || msg.context_id !== turn.ctx) break;
      Z.lastDone = msg;
      Z.dones++;
      const s = msg.stats;
      if (turn.serverTtfa == null) turn.serverTtfa = s.ttfa_ms;
      // Turn-level real-time factor: a later sentence's own server RTF includes the time it waited
      // behind the earlier ones, which makes short sentences look absurdly slow.
      turn.audioMs += s.audio_ms;
      if (turn.audioMs > 0) turn.rtf = (performance.now() - turn.t0) / turn.audioMs;
      log(`✓ ${msg.utterance_id}: ${fmtMs(s.audio_ms)} audio, server: first audio ${fmtMs(s.ttfa_ms)}, RTF ${s.rtf?.toFixed(2) ?? "–"}, ${s.frames} frames${s.finish_reason ? `, ${s.finish_reason}` : ""}`);
      break;
    }
    case "flushed":
      if (!turn || msg.context_id !== turn.ctx) break;
      Z.flushed++;
      turn.flushed = true;
      playerSend({ type: "end" }); // play the tail out even if it is below the start threshold; "drained" ends the turn
      break;
    case "cancelled":
      Z.cancelled++;
      Z.lastCancelled = msg;
      session.awaitingCancel = Math.max(0, session.awaitingCancel - 1);
      log("■ cancelled by the server: no more audio of that text");
      if (turn?.stopping) finishTurn("stopped");
      break;
    case "error": {
      Z.errors = [...Z.errors.slice(-49), msg];
      if (turn && (msg.context_id == null || msg.context_id === turn.ctx)) turn.error = msg.code;
      const w = !msg.utterance_id && session.waiters.shift();
      if (w) w.reject(new Error(`${msg.message} (${msg.code})`));
      log(`error ${msg.code}: ${msg.message}`, "err");
      break;
    }
    default:
      break;
  }
}

function onAudio(buf) {
  // Audio of cancelled text can still be in flight until the server's `cancelled`: drop it.
  if (session.awaitingCancel > 0 || turn?.stopping) {
    Z.framesDropped++;
    return;
  }
  if (!turn) {
    Z.strayFrames++;
    return;
  }
  Z.framesReceived++;
  Z.bytesReceived += buf.byteLength;
  if (turn.firstFrameAt == null) {
    turn.firstFrameAt = performance.now();
    Z.clientTtfaMs = turn.firstFrameAt - turn.t0;
  }
  // pcm_f32le: little-endian like every browser platform. Frames hold whole samples; guard anyway.
  const pcm = new Float32Array(buf.byteLength % 4 ? buf.slice(0, buf.byteLength & ~3) : buf);
  turn.samples += pcm.length;
  pushPcm(pcm);
}

// ---------------------------------------------------------------------------------------------------
// Speak / Stop

const speakBtn = $("#speak");
const stopBtn = $("#stop");
const textBox = $("#text");

function desiredConfig() {
  return {
    voice: voiceSelect.value || null,
    encoding: "pcm_f32le", // the worklet plays float32 directly
    sample_rate: Number(form.elements.sample_rate.value),
    params: readParams(),
  };
}

async function speak() {
  const t0 = performance.now(); // client-side first-audio time starts at the click
  const text = textBox.value.trim();
  if (!text) {
    textBox.focus();
    return;
  }
  const cfg = desiredConfig();
  try {
    await ensureAudio(cfg.sample_rate); // inside the click: satisfies the autoplay policy
  } catch (e) {
    log(`audio output failed: ${e.message}`, "err");
    return;
  }
  if (turn) cancelTurn(); // barge-in: a new Speak interrupts the current one
  // Waiting out a reconnect back-off (server restarted, idle timeout)? The click retries right away.
  if (!session.ws || session.ws.readyState > WebSocket.OPEN) reconnectNow();
  try {
    await session.ready;
    await applyConfig(cfg);
  } catch (e) {
    setPlayState(`not sent: ${e.message}`, "err");
    return;
  }
  const ctx = `turn-${++turnSeq}`;
  turn = { ctx, t0, firstFrameAt: null, firstPlayAt: null, samples: 0, playedBase: Z.samplesPlayed, utterances: 0,
    audioMs: 0, serverTtfa: null, rtf: null, flushed: false, stopping: false, rate: cfg.sample_rate };
  playerSend({ type: "reset", stats: true });
  Z.clientTtfaMs = null;
  send({ type: "text", text, context_id: ctx });
  send({ type: "flush", context_id: ctx });
  stopBtn.disabled = false;
  Z.state = "speaking";
  setPlayState("generating…", "busy");
}

function cancelTurn() {
  if (session.ws?.readyState === WebSocket.OPEN) {
    send({ type: "cancel" });
    session.awaitingCancel++;
  }
  playerSend({ type: "reset" }); // drop what is buffered right away
  if (turn) turn.stopping = true;
}

function stop() {
  if (!turn || turn.stopping) return;
  cancelTurn();
  Z.state = "stopping";
  setPlayState("stopping…", "busy");
}

function finishTurn(how) {
  if (!turn) return;
  turn.ended = how;
  lastTurn = turn;
  turn = null;
  Z.state = "idle";
  Z.lastTurnEnd = how;
  Z.turnsEnded++;
  stopBtn.disabled = true;
  if (how === "done" && lastTurn.error) setPlayState(`finished with error: ${lastTurn.error}`, "err");
  else setPlayState(how === "done" ? "idle" : how, how === "done" || how === "stopped" ? "" : "err");
}
let lastTurn = null;

function setPlayState(text, kind = "") {
  const n = $("#play-state");
  n.textContent = text;
  n.className = `play-state ${kind}`;
}

speakBtn.addEventListener("click", speak);
stopBtn.addEventListener("click", stop);
textBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    speak();
  }
});
const countChars = () => ($("#char-count").textContent = textBox.value.length);
textBox.addEventListener("input", countChars);
countChars();

// ---------------------------------------------------------------------------------------------------
// Live view: metrics and a scrolling waveform of what is actually being played.

const canvas = $("#wave");
const g = canvas.getContext("2d");
const COLUMN_MS = 25; // the scrolling view shows the last 400 × 25 ms = 10 s
const peaks = new Float32Array(400); // newest on the right
let peakPos = 0;
let lastColumnAt = 0;
let scratch = null;
let styleCache = null;
const colours = () => (styleCache ??= getComputedStyle(document.body)); // live object: follows the colour scheme

function drawWave() {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.round(canvas.clientWidth * dpr);
  const h = Math.round(canvas.clientHeight * dpr);
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  let peak = 0;
  if (audio.analyser && audio.ctx?.state === "running") {
    scratch ??= new Float32Array(audio.analyser.fftSize);
    audio.analyser.getFloatTimeDomainData(scratch);
    for (const x of scratch) peak = Math.max(peak, Math.abs(x));
  }
  // Advance by wall time, not by animation frames, so the scroll speed does not depend on the frame rate.
  const now = performance.now();
  const columns = Math.min(peaks.length, Math.floor((now - lastColumnAt) / COLUMN_MS));
  if (columns > 0) {
    lastColumnAt = columns === peaks.length ? now : lastColumnAt + columns * COLUMN_MS;
    for (let i = 0; i < columns; i++) peaks[peakPos++ % peaks.length] = Math.min(1, peak);
  }
  const css = colours();
  g.clearRect(0, 0, w, h);
  g.fillStyle = css.getPropertyValue("--wave-bg");
  g.fillRect(0, 0, w, h);
  g.fillStyle = css.getPropertyValue("--wave-mid");
  g.fillRect(0, h / 2 - dpr / 2, w, dpr);
  const bars = peaks.length;
  const bw = w / bars;
  g.fillStyle = css.getPropertyValue("--wave-fg");
  for (let i = 0; i < bars; i++) {
    const p = peaks[(peakPos + i) % bars];
    if (p <= 0.002) continue;
    const bh = Math.max(dpr, Math.sqrt(p) * (h * 0.9)); // sqrt: quiet speech stays visible
    g.fillRect(i * bw, (h - bh) / 2, Math.max(dpr, bw * 0.7), bh);
  }
}

function updateMetrics() {
  const t = turn || lastTurn;
  const s = audio.stats;
  $("#m-ttfa-client").textContent = t?.firstFrameAt != null ? fmtMs(t.firstFrameAt - t.t0) : "–";
  $("#m-ttfa-server").textContent = t?.serverTtfa != null ? fmtMs(t.serverTtfa) : "–";
  const rtf = $("#m-rtf");
  rtf.textContent = t?.rtf != null ? `${t.rtf.toFixed(2)}×` : "–";
  rtf.className = `m-value ${t?.rtf > 1 ? "warn" : t?.rtf != null ? "good" : ""}`;
  $("#m-audio").textContent = t ? `${fmtS(t.samples, t.rate)} / ${fmtS(Math.max(0, s.played - t.playedBase) / (audio.resample || 1), t.rate)}` : "–";
  $("#m-buffer").textContent = audio.ctx ? `${Math.round(s.bufferedMs)} ms` : "–";
  $("#m-buffer-bar").style.width = `${Math.min(100, (s.bufferedMs / 2000) * 100)}%`;
  $("#m-buffer-bar").className = s.bufferedMs < 40 && turn && !turn.flushed ? "low" : "";
  const u = $("#m-underruns");
  u.textContent = audio.ctx ? String(s.underruns) : "–";
  u.className = `m-value ${s.underruns ? "warn" : ""}`;
  if (turn && !turn.stopping) {
    const state = s.playing ? "playing" : turn.samples ? "buffering…" : "generating…";
    setPlayState(state, "busy");
  }
  const detail = [];
  if (audio.ctx) detail.push(`start threshold ${Math.round(s.thresholdMs)} ms`);
  // "sound after" only once something of this text was heard: Stop before playback started says so instead
  const heard = t && s.played - t.playedBase > 0;
  if (t?.firstPlayAt != null && heard) detail.push(`sound after ${fmtMs(t.firstPlayAt - t.t0)}`);
  else if (t?.ended === "stopped" && !heard) detail.push("stopped before any sound played");
  if (t?.utterances) detail.push(`${t.utterances} sentence${t.utterances > 1 ? "s" : ""}`);
  if (s.underruns) detail.push("underruns: generation is slower than playback here; the buffer grows to compensate");
  $("#m-detail").textContent = detail.join(" · ");
}

function frame() {
  drawWave();
  updateMetrics();
  requestAnimationFrame(frame);
}

// ---------------------------------------------------------------------------------------------------
// Start-up

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
      localStorage.setItem(KEY_STORE, keyInput.value.trim());
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
  await loadVoices(localStorage.getItem(VOICE_STORE) || "");
}

init();
