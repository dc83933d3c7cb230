// One text being spoken (a turn), from Speak to "done", "stopped" or "connection lost": its messages
// and audio, barge-in and Stop, shown on the Stop button and the play-state line.

import { counters } from "./counters.js";
import { $, fmtMs } from "./dom.js";
import { log } from "./eventlog.js";
import { ensureAudio, player, playerSend, pushPcm } from "./player.js";
import { cancel, configure, send } from "./session.js";

export let turn = null; // the text being spoken: {ctx, t0, firstFrameAt, samples, flushed, ...}
export let lastTurn = null; // the one that ended last, still shown by the metrics
let turnSeq = 0;
const stopBtn = $("#stop");

// t0: the Speak click, where the client-side first-audio time starts.
export async function speak(text, cfg, t0) {
  try {
    await ensureAudio(cfg.sample_rate); // inside the click: satisfies the autoplay policy
  } catch (e) {
    log(`audio output failed: ${e.message}`, "err");
    return;
  }
  if (turn) cancelTurn(); // barge-in: a new Speak interrupts the current one
  try {
    await configure(cfg);
  } catch (e) {
    setPlayState(`not sent: ${e.message}`, "err");
    return;
  }
  const ctx = `turn-${++turnSeq}`;
  turn = { ctx, t0, firstFrameAt: null, firstPlayAt: null, samples: 0, playedBase: counters.samplesPlayed, utterances: 0,
    audioMs: 0, serverTtfa: null, rtf: null, flushed: false, stopping: false, rate: cfg.sample_rate,
    sentences: new Map() }; // utterance id -> {startSample, doneAt, startedAt, stats}: see trackSentences
  playerSend({ type: "reset", stats: true });
  counters.clientTtfaMs = null;
  send({ type: "text", text, context_id: ctx });
  send({ type: "flush", context_id: ctx });
  stopBtn.disabled = false;
  counters.state = "speaking";
  setPlayState("generating…", "busy");
}

function cancelTurn() {
  cancel();
  playerSend({ type: "reset" }); // drop what is buffered right away
  if (turn) turn.stopping = true;
}

export function stop() {
  if (!turn || turn.stopping) return;
  cancelTurn();
  counters.state = "stopping";
  setPlayState("stopping…", "busy");
}

function finishTurn(how) {
  if (!turn) return;
  trackSentences();
  for (const u of turn.sentences.values()) if (u.stats) logSentence(u); // generated, never heard (Stop)
  turn.ended = how;
  lastTurn = turn;
  turn = null;
  counters.state = "idle";
  counters.lastTurnEnd = how;
  counters.turnsEnded++;
  stopBtn.disabled = true;
  if (how === "done" && lastTurn.error) setPlayState(`finished with error: ${lastTurn.error}`, "err");
  else setPlayState(how === "done" ? "idle" : how, how === "done" || how === "stopped" ? "" : "err");
}

export function setPlayState(text, kind = "") {
  const n = $("#play-state");
  n.textContent = text;
  n.className = `play-state ${kind}`;
}

export function onTurnMessage(msg) {
  switch (msg.type) {
    case "audio.start":
      if (!turn || msg.context_id !== turn.ctx) break;
      counters.lastStart = msg;
      turn.utterances++;
      // its first sample is the next one received: it plays once everything before it has played
      turn.sentences.set(msg.utterance_id, { id: msg.utterance_id, startSample: turn.samples, doneAt: null,
        startedAt: null, stats: null });
      log(`▶ ${msg.utterance_id}: “${msg.text}”`);
      break;
    case "audio.done": {
      if (!turn || msg.context_id !== turn.ctx) break;
      counters.lastDone = msg;
      counters.dones++;
      const s = msg.stats;
      if (turn.serverTtfa == null) turn.serverTtfa = s.ttfa_ms;
      // Turn-level real-time factor: a later sentence's own server RTF includes the time it waited
      // behind the earlier ones, which makes short sentences look absurdly slow.
      turn.audioMs += s.audio_ms;
      if (turn.audioMs > 0) turn.rtf = (performance.now() - turn.t0) / turn.audioMs;
      const u = turn.sentences.get(msg.utterance_id);
      if (u) {
        trackSentences(); // first: did it start playing before it was complete?
        u.doneAt = performance.now();
        u.stats = s;
        if (u.startedAt != null) logSentence(u); // it was heard while it was generated
      }
      break;
    }
    case "flushed":
      if (!turn || msg.context_id !== turn.ctx) break;
      counters.flushed++;
      turn.flushed = true;
      playerSend({ type: "end" }); // play the tail out even if it is below the start threshold; "drained" ends the turn
      break;
    case "cancelled":
      if (turn?.stopping) finishTurn("stopped");
      break;
    case "error":
      if (turn && (msg.context_id == null || msg.context_id === turn.ctx)) turn.error = msg.code;
      break;
  }
}

// Each sentence's line in the event log says what a listener got from it: when it started playing (from the
// Speak click) and either the server's first-audio wait and real-time factor (a sentence heard while it was
// generated) or how long before its turn it was complete (one generated ahead, while an earlier sentence
// played: the server's own figures are ~0 for it, because it waited for nothing).
export function trackSentences() {
  if (!turn) return;
  const played = (player.stats.played - turn.playedBase) / (player.resample || 1); // stream-rate samples
  for (const u of turn.sentences.values()) {
    if (u.startedAt != null || played <= u.startSample) continue;
    u.startedAt = performance.now();
    if (u.stats) logSentence(u); // generated ahead: complete before it started
  }
}

function logSentence(u) {
  const s = u.stats;
  turn.sentences.delete(u.id);
  const head = `✓ ${u.id}: ${fmtMs(s.audio_ms)} audio`;
  const end = `${s.frames} frames${s.finish_reason ? `, ${s.finish_reason}` : ""}`;
  const rtf = `RTF ${s.rtf?.toFixed(2) ?? "–"}`;
  if (u.startedAt == null) {
    log(`${head}, generated, not played (stopped) · ${end}`);
    return;
  }
  const at = `${head}, played from +${fmtMs(u.startedAt - turn.t0)}`;
  if (u.doneAt < u.startedAt) {
    log(`${at} · generated ahead: complete ${fmtMs(u.startedAt - u.doneAt)} before it played · ${end}`);
  } else if (s.ttfa_ms >= 1) {
    log(`${at} · first audio ${fmtMs(s.ttfa_ms)} after its turn came (server), ${rtf} · ${end}`);
  } else {
    // begun ahead: its first audio waited for its turn, the rest was generated while it played
    log(`${at} · begun ahead, complete ${fmtMs(u.doneAt - u.startedAt)} after it started, ${rtf} · ${end}`);
  }
}

export function onTurnAudio(buf) {
  // Stopped: the rest of this text's audio is not played.
  if (turn?.stopping) {
    counters.framesDropped++;
    return;
  }
  if (!turn) {
    counters.strayFrames++;
    return;
  }
  counters.framesReceived++;
  counters.bytesReceived += buf.byteLength;
  if (turn.firstFrameAt == null) {
    turn.firstFrameAt = performance.now();
    counters.clientTtfaMs = turn.firstFrameAt - turn.t0;
  }
  // pcm_f32le: little-endian like every browser platform. Frames hold whole samples; guard anyway.
  const pcm = new Float32Array(buf.byteLength % 4 ? buf.slice(0, buf.byteLength & ~3) : buf);
  turn.samples += pcm.length;
  pushPcm(pcm);
}

export function onPlaybackEvent(ev) {
  if (ev === "start" && turn && !turn.stopping && turn.firstPlayAt == null) turn.firstPlayAt = performance.now();
  if (ev === "drained" && turn && turn.flushed) finishTurn("done");
}

export function onConnectionLost() {
  if (!turn) return;
  playerSend({ type: "reset" });
  finishTurn("connection lost");
}
