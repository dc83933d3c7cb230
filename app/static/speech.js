// One text being spoken (a turn), from Speak to "done", "stopped" or "connection lost": its messages
// and audio, barge-in and Stop, shown on the Stop button and the play-state line.

import { counters } from "./counters.js";
import { $, fmtMs } from "./dom.js";
import { log } from "./eventlog.js";
import { ensureAudio, player, playerSend, pushPcm } from "./player.js";
import { focusParam, limits } from "./params.js";
import { cancel, configure, send } from "./session.js";

export let turn = null; // the text being spoken: {ctx, t0, firstFrameAt, samples, flushed, ...}
export let lastTurn = null; // the one that ended last, still shown by the metrics
let turnSeq = 0;
let speakSeq = 0; // each Speak (and Stop) takes the next number: only the latest Speak may start its turn
const stopBtn = $("#stop");

// A text is sent in chunks of at most a quarter of the utterances the server queues (max_pending_utterances, 32),
// the next once all of the one before the last sent has started playing: a text whose sentences would queue past
// that limit is refused whole (a pasted article was not spoken at all).
const chunkUtterances = () => Math.max(1, Math.floor((limits.max_pending_utterances || 32) / 4));
// What the server leaves out of an utterance's text (audio.start): inline tags, and the spaces between sentences.
const TAGS = /<[^<>]{0,200}>|\[[^[\]]{0,40}\]/g;
// after a space, neither inside a tag nor right after one: a chunk that ended in `<break ` or in a whole tag left the
// text before it unspoken (the server speaks it once text after the tag comes), and the next chunk, due once that text
// started, was never sent: "generating…" for ever
const WORDS = /(?<=\s)(?<![>\]]\s+)(?![^<>]*>|[^[\]]*\])/u;
const bare = (s) => s.replace(TAGS, "").replace(/\s+/g, "");
const spoken = (s) => bare(s).length;

// The text cut after sentence ends and newlines, into chunks of at most `most` utterances as the server
// would count them (an overestimate: a sentence past the utterance budget is cut; a break tag is one of its own).
// Each chunk's `end`: the characters of spoken text up to its end.
export function chunkText(text, maxBytes = limits.max_utterance_bytes || 288, most = chunkUtterances()) {
  const utf8 = new TextEncoder();
  const breaks = (s) => s.match(/<\s*break\b/gi)?.length ?? 0;
  // a sentence: one utterance, or its cuts (at a clause mark or a space: at least half the budget each)
  // a run without a space (a pasted blob) in pieces of at most the budget in bytes (a quarter of it in code points, never
  // half a character): one message of it could pass what the server buffers (max_buffer_chars); it joins the pieces
  const cut = (w) => (w.length <= maxBytes >> 2 ? [w] : w.match(new RegExp(`[^]{1,${maxBytes >> 2}}`, "gu")));
  const cost = (s) => (s.trim() ? Math.max(1, Math.ceil((2 * utf8.encode(s).length) / maxBytes)) + breaks(s) : 0);
  const pieces = []; // [text, utterances]
  for (const sentence of text.split(/(?<=[.!?…]["'”’)\]]*\s+|[。！？]|\n)/u)) {
    const c = cost(sentence);
    if (c <= most) pieces.push([sentence, c]);
    else for (const p of sentence.split(WORDS).flatMap(cut)) pieces.push([p, (2 * utf8.encode(p).length) / maxBytes + breaks(p)]);
  }
  const chunks = [];
  let cur = "";
  let n = 0;
  for (const [piece, c] of pieces) {
    if (cur.trim() && n + c > most) {
      chunks.push(cur);
      cur = "";
      n = 0;
    }
    cur += piece;
    n += c;
  }
  if (cur || !chunks.length) chunks.push(cur);
  let end = 0;
  return chunks.map((t) => ({ text: t, end: (end += spoken(t)) }));
}

// t0: the Speak click, where the client-side first-audio time starts.
export async function speak(text, cfg, t0) {
  const mine = ++speakSeq;
  // barge-in: a new Speak interrupts the current one, before anything is awaited (a second click while the first
  // waited for its session.config found no turn to cancel, and both texts were spoken as one)
  if (turn) cancelTurn();
  try {
    await ensureAudio(cfg.sample_rate); // inside the click: satisfies the autoplay policy
  } catch (e) {
    log(`audio output failed: ${e.message}`, "err");
    return;
  }
  if (mine !== speakSeq) return; // a later Speak, or Stop, came meanwhile
  try {
    await configure(cfg);
  } catch (e) {
    if (mine === speakSeq) {
      setPlayState(`not sent: ${e.message}`, "err");
      focusParam(e.message); // a parameter the server refused ("seed must be an integer (bad_params)")
    }
    return;
  }
  if (mine !== speakSeq) return;
  if (turn && !turn.stopping) cancelTurn(); // (none can have begun meanwhile; a text must never join another's)
  // the text it interrupts ends here, stopped (its `cancelled` may still come): it was replaced unended, and its
  // sentences generated but not heard were never logged, nor was it counted
  if (turn) finishTurn("stopped");
  const ctx = `turn-${++turnSeq}`;
  turn = { ctx, t0, firstFrameAt: null, firstPlayAt: null, samples: 0, playedBase: counters.samplesPlayed, utterances: 0,
    audioMs: 0, serverTtfa: null, rtf: null, flushed: false, stopping: false, rate: cfg.sample_rate,
    sentences: new Map(), // utterance id -> {startSample, doneAt, startedAt, stats}: see trackSentences
    chunks: chunkText(text), bare: bare(text), sentChunks: 0, startedChars: 0, started: new Set(), ends: 0,
    forced: false };
  playerSend({ type: "reset", stats: true });
  counters.clientTtfaMs = null;
  sendChunks();
  stopBtn.disabled = false;
  counters.state = "speaking";
  setPlayState("generating…", "busy");
}

// Send the turn's next chunks: two ahead of the one playing (chunk i once all of chunk i - 2 has started), then
// the flush. force: one more now (the server ran out of our text with chunks still unsent: text it does not
// speak, or speaks otherwise, was counted short); at most one until the next utterance starts.
function sendChunks(force = false) {
  const t = turn;
  if (!t || t.stopping || t.sentChunks > t.chunks.length || (force && t.forced)) return;
  t.forced ||= force;
  const due = () => force || t.sentChunks < 2 || t.startedChars >= t.chunks[t.sentChunks - 2].end;
  while (t.sentChunks < t.chunks.length && due()) {
    send({ type: "text", text: t.chunks[t.sentChunks++].text, context_id: t.ctx });
    force = false;
  }
  if (t.sentChunks === t.chunks.length) {
    send({ type: "flush", context_id: t.ctx });
    t.sentChunks++; // flushed: nothing more to send
  }
}

function cancelTurn() {
  cancel();
  playerSend({ type: "reset" }); // drop what is buffered right away
  if (turn) turn.stopping = true;
}

export function stop() {
  speakSeq++; // a Speak still waiting for its session does not start after this
  if (!turn || turn.stopping) return;
  cancelTurn();
  counters.state = "stopping";
  setPlayState("stopping…", "busy");
}

function finishTurn(how, why = "") {
  if (!turn) return;
  trackSentences();
  turn.ended = how;
  for (const u of turn.sentences.values()) if (u.stats) logSentence(u); // generated, never heard (Stop)
  lastTurn = turn;
  turn = null;
  counters.state = "idle";
  counters.lastTurnEnd = how;
  counters.turnsEnded++;
  if (document.activeElement === stopBtn) $("#speak").focus(); // a keyboard user's focus is not dropped on the page
  stopBtn.disabled = true;
  if (how === "done" && lastTurn.error) setPlayState(`finished with error: ${lastTurn.error}`, "err");
  else if (why) setPlayState(`${how}: ${why}`, "err");
  else setPlayState(how === "done" ? "idle" : how, how === "done" || how === "stopped" ? "" : "err");
}

// Written on a change only: metrics.js calls it every frame, and a screen reader reads the live region out again at
// each write (~1,000 times for a short text).
export function setPlayState(text, kind = "") {
  const n = $("#play-state");
  if (n.textContent !== text) n.textContent = text;
  if (n.className !== `play-state ${kind}`) n.className = `play-state ${kind}`;
}

// An utterance of the turn began to play: how far into the text that is, and the chunks that are due now.
function utteranceStarted(msg) {
  turn.started.add(msg.utterance_id);
  // where it ends in the text, looked for from where the last one ended (an utterance that failed before it
  // started, or text the server does not speak as written, would otherwise be counted short for good)
  const said = bare(msg.text);
  const at = said ? turn.bare.indexOf(said, turn.startedChars) : -1;
  turn.startedChars = at >= 0 ? at + said.length : turn.startedChars + said.length;
  turn.forced = false;
  sendChunks();
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
      utteranceStarted(msg);
      break;
    case "audio.done": {
      if (!turn || msg.context_id !== turn.ctx) break;
      counters.lastDone = msg;
      counters.dones++;
      turn.ends++;
      const s = msg.stats;
      if (turn.serverTtfa == null) turn.serverTtfa = s.ttfa_ms;
      // Turn-level real-time factor: a later sentence's own server RTF includes the time it waited
      // behind the earlier ones, which makes short sentences look absurdly slow.
      turn.audioMs += s.audio_ms;
      if (s.engine?.rtf != null) turn.engineRtf = Math.max(turn.engineRtf ?? 0, s.engine.rtf); // (metrics.js)
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
      // only the errors of this turn's context: one naming none, or an earlier turn's, is not this text's (the refusal
      // of an earlier text, arriving after the next Speak, ended the new text as if it were its own)
      if (turn && msg.context_id === turn.ctx) {
        turn.error = msg.code;
        if (msg.utterance_id) {
          // one utterance failed and the rest goes on: its text may never start, so the next chunk goes now
          if (turn.started.has(msg.utterance_id)) turn.ends++;
          sendChunks(true);
        } else if (turn.sentChunks < turn.chunks.length) {
          // a text refused whole: what was taken is spoken, and the turn ends with the error there
          turn.sentChunks = turn.chunks.length;
          sendChunks();
        }
      }
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
  // a break tag's pause is silence the gateway makes: no frames (it said "null frames")
  const end = s.frames == null ? "a pause, no frames" : `${s.frames} frames${s.finish_reason ? `, ${s.finish_reason}` : ""}`;
  const rtf = `RTF ${s.rtf?.toFixed(2) ?? "–"}`;
  if (u.startedAt == null) {
    // a sentence whose audio is empty (the model ended it at once) never starts playing: it was not stopped
    const why = !s.audio_ms && turn.ended === "done" ? "no audio to play" : `generated, not played (${turn.ended})`;
    log(`${head}, ${why} · ${end}`);
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
  // Ran dry with chunks unsent and every utterance begun also done: the server has nothing of ours queued (what
  // it spoke was counted short), so the next chunk goes now rather than never.
  if (ev === "underrun" && turn && turn.started.size > 0 && turn.started.size === turn.ends) sendChunks(true);
  if (ev === "drained" && turn && turn.flushed) finishTurn("done");
}

export function onConnectionLost(why) {
  if (!turn) return;
  playerSend({ type: "reset" });
  finishTurn("connection lost", why);
}

// Whether the turn expects more from the server: its audio, its flush's answer, or its cancel's.
export const awaitingServer = () => !!turn && (!turn.flushed || turn.stopping);

// The server has said nothing for ms while the turn waited for it (null: it spoke again); the play state says so.
// A silence with chunks unsent: the text sent holds nothing the server can speak yet (a long sentence sent in
// pieces of words, none past the utterance budget), and what was sent would start the next chunk: it goes now.
export function onStall(ms) {
  if (!turn) return;
  if (ms != null && turn.stallMs == null) {
    turn.forced = false;
    sendChunks(true);
  }
  turn.stallMs = ms;
}
