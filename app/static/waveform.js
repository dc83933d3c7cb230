// The Output card's scrolling waveform of what is actually being played (the player's analyser).

import { $ } from "./dom.js";
import { player } from "./player.js";

const canvas = $("#wave");
const g = canvas.getContext("2d");
const COLUMN_MS = 25; // the scrolling view shows the last 400 × 25 ms = 10 s
const peaks = new Float32Array(400); // newest on the right
let peakPos = 0;
let lastColumnAt = 0;
let scratch = null;
let styleCache = null;
const colours = () => (styleCache ??= getComputedStyle(document.body)); // live object: follows the colour scheme

export function drawWave() {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.round(canvas.clientWidth * dpr);
  const h = Math.round(canvas.clientHeight * dpr);
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  let peak = 0;
  if (player.analyser && player.ctx?.state === "running") {
    scratch ??= new Float32Array(player.analyser.fftSize);
    player.analyser.getFloatTimeDomainData(scratch);
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
