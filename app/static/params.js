// The Parameters card: static controls in the HTML, option lists from /tts/capabilities, kept in localStorage.

import { $, el } from "./dom.js";

const PARAMS_STORE = "zonos.params";
const form = $("#params");
let caps = null;
// What the server allows: /tts/capabilities, then each session's `session.created` limits.
export const limits = { max_frames: 3000 };

function showRange(input) {
  const out = form.querySelector(`output[for="${input.id}"]`);
  const show = () => (out.textContent = Number(input.value).toFixed(2));
  input.addEventListener("input", show);
  show();
}

export function initRangeOutputs() {
  for (const input of form.querySelectorAll('input[type="range"]')) showRange(input);
}

// Emotion (the reference's emotion-control-clean page): a slider per named emotion and axis the server's
// directions have (-1..1), the strength (a multiplier of the calibrated strengths when calibrated) and the
// emotion guidance scale; the whole set is hidden when the server has no emotion directions.
function buildEmotion(c) {
  const on = !!c.emotion_enabled;
  $("#emotion-set").hidden = !on;
  const box = $("#emotion-sliders");
  box.replaceChildren();
  if (!on) return;
  for (const name of [...c.emotion_names, ...c.emotion_axes]) {
    const id = `p-emotion-${name}`;
    const input = el("input", { id, name: `emotion:${name}`, type: "range", min: "-1", max: "1", step: "0.05",
                                value: "0", "data-default": "0", "data-emotion": name });
    const label = name.replace(/_/g, " ");
    box.append(el("label", { class: "field range", for: id },
      el("span", {}, `${label.charAt(0).toUpperCase()}${label.slice(1)} `, el("output", { for: id })), input));
    showRange(input);
  }
  const strength = $("#p-emotion_strength");
  const [max, step, def] = c.emotion_calibrated ? ["3", "0.05", "1"] : ["12", "0.1", "3"];
  Object.assign(strength, { max, step, value: def });
  strength.dataset.default = def;
  $("#emotion-strength-label").firstChild.nodeValue = c.emotion_calibrated ? "Strength (× calibrated) " : "Strength ";
}

export function applyCapabilities(c) {
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
  buildEmotion(c);
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

// Expressive mode and the clean-background marker only exist together with a speaker embedding.
export function enableVoiceOptions(hasVoice) {
  for (const n of form.querySelectorAll('input[name="mode"], #p-clean_speaker_background')) n.disabled = !hasVoice;
}

// A number field left empty (or holding what the browser cannot read as a number, "abc") where a number is
// needed: it was sent as 0, silently (top_k 0 = all 1024 codes, a repetition window of 0 = off). Seed and max
// frames may be empty (random, the server's limit). The field, or null.
export function badNumberField() {
  for (const input of form.querySelectorAll('input[type="number"]')) {
    if (input.disabled) continue;
    if (input.validity.badInput || (input.dataset.default !== "" && input.value.trim() === "")) return input;
  }
  return null;
}

// A parameter the server refused (its message begins with the key: "seed must be an integer"): its field, focused.
export function focusParam(message) {
  const input = form.elements[/^\w+/.exec(message)?.[0]];
  if (input?.focus) input.focus();
}

export function readParams() {
  const v = (name) => form.elements[name].value;
  const num = (name) => Number(v(name));
  // A whole number as typed, not rounded (a seed of 1.5 was sent as 2, silently): the server's parse_options refuses
  // what it does not take and Speak says so. Digits past 2^53 go as a BigInt, sent exactly (session.js toJson).
  const int = (name) => (/^\d{16,}$/.test(v(name).trim()) ? BigInt(v(name).trim()) : num(name));
  const p = {
    temperature: num("temperature"),
    top_k: int("top_k"),
    top_p: num("top_p"),
    min_p: num("min_p"),
    repetition_window: int("repetition_window"),
    repetition_penalty: num("repetition_penalty"),
    repetition_codebooks: int("repetition_codebooks"),
    seed: v("seed") === "" ? null : int("seed"),
    // An empty field means "the server's limit": sending null would keep an earlier value (merge semantics).
    max_frames: v("max_frames") === "" ? limits.max_frames : int("max_frames"),
    ignore_eos: form.elements.ignore_eos.checked,
    language: v("language"),
    text_normalization: form.elements.text_normalization.checked,
    accurate_mode: form.querySelector('input[name="mode"]:checked').value === "accurate",
    clean_speaker_background: form.elements.clean_speaker_background.checked,
  };
  if (v("speaking_rate_bucket") !== "") p.speaking_rate_bucket = Number(v("speaking_rate_bucket"));
  if (caps && caps.emotion_enabled) Object.assign(p, readEmotion());
  return p;
}

// The emotion_* fields (always all of them: session.config merges, so a field left out would keep its old value).
function readEmotion() {
  const value = (name) => Number(form.elements[`emotion:${name}`].value);
  const axis = (name) => (caps.emotion_axes.includes(name) ? value(name) : 0);
  return {
    emotion_enabled: form.elements.emotion_enabled.checked,
    emotion_sliders: Object.fromEntries(caps.emotion_names.map((n) => [n, value(n)])),
    emotion_valence: axis("valence"),
    emotion_arousal: axis("arousal"),
    emotion_strength: Number(form.elements.emotion_strength.value),
    emotion_cfg_scale: Number(form.elements.emotion_cfg_scale.value),
  };
}

export const readSampleRate = () => Number(form.elements.sample_rate.value);

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

export function restoreParams(defaults = false) {
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
