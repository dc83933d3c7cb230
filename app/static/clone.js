// The "Clone a voice" card: a file, or a microphone recording converted to a 16-bit WAV here in the browser.

import { api } from "./api.js";
import { $, setStatus } from "./dom.js";
import { log } from "./eventlog.js";
import { cleanName, loadVoices } from "./voices.js";
import { blobToWav } from "./wav.js";

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
  // disabled while the microphone opens: a double click opened it twice, and the first recording (its microphone,
  // its timer) was never stopped
  $("#rec").disabled = true;
  try {
    // Raw-ish audio: the speaker encoder wants the voice, not the browser's noise suppression.
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
  } catch (e) {
    return setStatus(status, `Microphone unavailable: ${e.message}`, "err");
  } finally {
    $("#rec").disabled = false;
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
