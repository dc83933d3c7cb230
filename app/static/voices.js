// The voice picker and the "Voice library" card over /v1/voices: list, preview, download, delete, blend.

import { api } from "./api.js";
import { counters } from "./counters.js";
import { $, el, setStatus } from "./dom.js";
import { log } from "./eventlog.js";
import { enableVoiceOptions } from "./params.js";

const VOICE_STORE = "zonos.voice";
const voiceSelect = $("#voice");
let library = []; // the voices as last listed by the server

// Voice names allow letters, digits, spaces and . , ' ( ) - _ (server rule).
// at most 64 characters as the server counts them (code points: a slice of UTF-16 units could split an emoji's pair,
// which the server then refused as bad_name)
export const cleanName = (s) =>
  Array.from(s.replace(/[^\p{L}\p{N}_ .,'()-]+/gu, " ").replace(/\s+/g, " ").trim())
    .slice(0, 64)
    .join("")
    .trim();

export const selectedVoiceId = () => voiceSelect.value;
export const savedVoiceId = () => localStorage.getItem(VOICE_STORE) || "";

function voiceLabel(v) {
  const extra = v.details?.seconds ? ` · ${v.details.seconds} s` : "";
  return `${v.name} (${v.source}${extra})`;
}

export async function loadVoices(selectId) {
  let voices;
  try {
    voices = (await (await api("/v1/voices")).json()).voices;
  } catch (e) {
    $("#library").replaceChildren(el("li", { class: "empty error" }, `Could not load voices: ${e.message}`));
    return;
  }
  const want = selectId ?? voiceSelect.value ?? localStorage.getItem(VOICE_STORE) ?? "";
  const gone = want && !voices.some((v) => v.id === want) && (library.find((v) => v.id === want)?.name ?? want);
  if (gone) log(`the voice ${gone} is no longer on the server: the model's own voice is selected`, "warn");
  library = counters.voices = voices;
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
  const v = library.find((x) => x.id === voiceSelect.value);
  $("#voice-now").textContent = v ? v.name : "model's own voice";
  enableVoiceOptions(!!v);
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
            onclick: (e) => deleteVoice(v, e.currentTarget) }, "✕"),
        ),
      );
    }),
  );
}

let previewUrl = null;
async function previewVoice(v, button) {
  // Fetched as a blob so the API key travels in a header, not in a URL.
  const audio = $("#preview-audio");
  // the preview playing until now stops here: its button kept showing it as playing for good
  for (const b of document.querySelectorAll(".library .icon.playing")) b.classList.remove("playing");
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

async function deleteVoice(v, button) {
  if (!confirm(`Delete the voice "${v.name}"?`)) return;
  button.disabled = true; // a double click asked twice, and the second delete failed (not_found)
  try {
    await api(`/v1/voices/${encodeURIComponent(v.id)}`, { method: "DELETE" });
    log(`deleted voice ${v.name}`);
    await loadVoices(voiceSelect.value === v.id ? "" : undefined);
  } catch (e) {
    button.disabled = false;
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
  const a = library.find((v) => v.id === $("#blend-a").value);
  const b = library.find((v) => v.id === $("#blend-b").value);
  if (!a || !b || a.id === b.id) return setStatus(status, "Pick two different voices.", "err");
  const t = Number($("#blend-t").value);
  // Name it ourselves: the default "A + B" would need a '+', which voice names do not allow.
  const name = cleanName($("#blend-name").value) || cleanName(`${a.name} - ${b.name} (${t.toFixed(2)})`);
  setStatus(status, "Blending…");
  const button = $("#blend-submit");
  button.disabled = true; // a double click made two blends (the second one a duplicate the server folded in)
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
  } finally {
    button.disabled = library.length < 2;
  }
});
