// The Output card's live metrics: first audio, RTF, audio received and played, buffer, underruns.

import { $, fmtMs, fmtS } from "./dom.js";
import { player } from "./player.js";
import { lastTurn, setPlayState, turn } from "./speech.js";

export function updateMetrics() {
  const t = turn || lastTurn;
  const s = player.stats;
  $("#m-ttfa-client").textContent = t?.firstFrameAt != null ? fmtMs(t.firstFrameAt - t.t0) : "–";
  $("#m-ttfa-server").textContent = t?.serverTtfa != null ? fmtMs(t.serverTtfa) : "–";
  const rtf = $("#m-rtf");
  rtf.textContent = t?.rtf != null ? `${t.rtf.toFixed(2)}×` : "–";
  rtf.className = `m-value ${t?.rtf > 1 ? "warn" : t?.rtf != null ? "good" : ""}`;
  $("#m-audio").textContent = t ? `${fmtS(t.samples, t.rate)} / ${fmtS(Math.max(0, s.played - t.playedBase) / (player.resample || 1), t.rate)}` : "–";
  $("#m-buffer").textContent = player.ctx ? `${Math.round(s.bufferedMs)} ms` : "–";
  $("#m-buffer-bar").style.width = `${Math.min(100, (s.bufferedMs / 2000) * 100)}%`;
  $("#m-buffer-bar").className = s.bufferedMs < 40 && turn && !turn.flushed ? "low" : "";
  const u = $("#m-underruns");
  u.textContent = player.ctx ? String(s.underruns) : "–";
  u.className = `m-value ${s.underruns ? "warn" : ""}`;
  if (turn && turn.stallMs != null) {
    setPlayState(`no answer from the server for ${Math.round(turn.stallMs / 1000)} s…`, "err"); // (session.js `stall`)
  } else if (turn && !turn.stopping) {
    const state = s.playing ? "playing" : turn.samples ? "buffering…" : "generating…";
    setPlayState(state, "busy");
  }
  const detail = [];
  if (player.ctx) detail.push(`start threshold ${Math.round(s.thresholdMs)} ms`);
  // "sound after" only once something of this text was heard: Stop before playback started says so instead
  const heard = t && s.played - t.playedBase > 0;
  if (t?.firstPlayAt != null && heard) detail.push(`sound after ${fmtMs(t.firstPlayAt - t.t0)}`);
  else if (t?.ended === "stopped" && !heard) detail.push("stopped before any sound played");
  if (t?.utterances) detail.push(`${t.utterances} sentence${t.utterances > 1 ? "s" : ""}`);
  // the engine's own real-time factor leaves the network out: below 1, the audio was made in time and came late
  if (s.underruns && t?.engineRtf < 1) {
    detail.push("underruns: the server makes the audio faster than it plays, but it arrives slower (the network?); "
      + "a lower output sample rate needs less of it");
  } else if (s.underruns) detail.push("underruns: generation is slower than playback here; the buffer grows to compensate");
  $("#m-detail").textContent = detail.join(" · ");
}
