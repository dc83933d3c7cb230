// The WebSocket session (/v1/tts/ws, see docs/protocol.md): one per page, reconnected when it closes.
// It sends session.config only when the wanted one changed, and drops the audio of cancelled text.

import { AUTH, apiKey } from "./api.js";
import { counters } from "./counters.js";
import { $ } from "./dom.js";
import { log } from "./eventlog.js";

const session = {
  ws: null,
  ready: null, // Promise resolved on session.created
  sent: null, // the last session.config we sent (JSON), so it is only re-sent when something changed
  retry: 0,
  waiters: [], // resolvers waiting for session.updated / error after a session.config
  awaitingCancel: 0, // cancels sent but not yet answered: audio before `cancelled` belongs to old text
  heardAt: 0, // when the server last said something (or the page last had nothing to wait for)
};

// Keep-alive. A paused or unreachable server closes nothing: the socket stays open and silent, and the page said
// "generating…" for ever. While the page waits for the server (a text it speaks, a config's or a cancel's answer),
// a socket silent for warnMs is reported (handlers.stalled) and the server asked over HTTP whether it still answers;
// one that does not within probeMs, or silence past dropMs, gives the session up: the text ends "connection lost"
// and the page reconnects with its back-off. A session not opened within connectMs is given up the same way.
export const stall = { warnMs: 8_000, probeMs: 5_000, dropMs: 60_000, connectMs: 10_000 };

// JSON, with BigInt values written as their digits: a seed past 2^53 is sent exactly (a Number would round it).
const BIG = `bigint-${Math.random().toString(36).slice(2)}:`;
export const toJson = (msg) =>
  JSON.stringify(msg, (_, v) => (typeof v === "bigint" ? BIG + v : v)).replace(new RegExp(`"${BIG}(\\d+)"`, "g"), "$1");

// What the page does with the session: created(msg) before it counts as connected, message(msg) for
// every JSON message, audio(ArrayBuffer) for each frame still wanted, closed(why) when the connection is lost,
// waiting() whether a turn expects more from the server, stalled(ms | null) how long it has been silent (null: it spoke).
let handlers = null;
export function setSessionHandlers(h) {
  handlers = h;
}

// The errors the server closes a session after (docs/protocol.md, close codes). Another error naming no context (a
// refused config) is no reason for a later close: "connection lost: seed must be an integer" after a restart.
const CLOSING = new Set(["unauthorized", "origin_not_allowed", "too_many_sessions", "idle_timeout", "evicted_idle"]);

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
export function reconnectNow() {
  const old = session.ws;
  session.ws = null; // the old socket's handlers see they are stale and stay quiet
  if (old && old.readyState <= WebSocket.OPEN) old.close(1000);
  connect();
}

export function connect() {
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
  let closedBy = null; // the error code the server closed this session with, if it said one
  let closedWhy = "the connection closed";
  let created = false;
  const openedAt = performance.now();
  let probedAt = 0;
  let stalled = false;
  let upSaid = false; // "the server is up", said once a silence
  const watch = setInterval(() => {
    if (session.ws !== ws) return clearInterval(watch); // replaced (reconnectNow)
    const now = performance.now();
    if (!created) {
      if (now - openedAt > stall.connectMs) giveUp(`no answer from the server within ${Math.round(stall.connectMs / 1000)} s`);
      return;
    }
    if (!(session.waiters.length || session.awaitingCancel || handlers.waiting())) session.heardAt = now;
    const silent = now - session.heardAt;
    if (silent < stall.warnMs) {
      if (stalled) {
        stalled = false; // nothing to wait for any more
        handlers.stalled(null);
      }
      return;
    }
    if (!stalled) log(`no answer from the server for ${Math.round(silent / 1000)} s; asking whether it is up`, "warn");
    if (!stalled) upSaid = false;
    stalled = true;
    handlers.stalled(silent);
    if (silent > stall.dropMs) giveUp(`no answer from the server for ${Math.round(silent / 1000)} s`);
    else if (now - probedAt > stall.warnMs) probe((probedAt = now));
  }, 250);

  // Is the server up? /healthz over HTTP, within probeMs; a server that does not answer is given up.
  async function probe(at) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), stall.probeMs);
    try {
      await fetch("/healthz", { cache: "no-store", signal: abort.signal });
      const first = session.ws === ws && stalled && probedAt === at && !upSaid;
      if (first) log("the server is up: still waiting for this session's audio", "warn");
      upSaid ||= first;
    } catch {
      if (session.ws === ws && stalled) giveUp("the server does not answer (paused or unreachable)");
    } finally {
      clearTimeout(timer);
    }
  }

  // A socket that says nothing: closed here (the browser notices nothing while the connection stays open).
  function giveUp(why) {
    if (session.ws !== ws) return;
    ws.onmessage = ws.onclose = null;
    ws.close();
    closedWhy = why;
    lost(null, why);
  }

  ws.onmessage = (e) => {
    if (session.ws !== ws) return;
    session.heardAt = performance.now();
    if (stalled) {
      stalled = false;
      log("the server answers again");
      handlers.stalled(null);
    }
    if (typeof e.data !== "string") return onAudio(e.data);
    const msg = JSON.parse(e.data);
    if (msg.type === "session.created") {
      created = true;
      session.retry = 0;
      handlers.created(msg);
      counters.connected = true;
      counters.sessionId = msg.session_id;
      $("#session-id").textContent = msg.session_id;
      setConn("connected", "ok");
      log(`session ${msg.session_id} opened`);
      resolveReady();
    } else if (msg.type === "error" && CLOSING.has(msg.code)) {
      if (msg.code === "unauthorized") unauthorized = true;
      closedBy = msg.code;
      closedWhy = `${msg.message} (${msg.code})`;
    }
    onMessage(msg);
  };
  ws.onclose = (e) => {
    const code = `${e.code}${e.reason ? ` ${e.reason}` : ""}`;
    if (closedBy === null && created) closedWhy = e.code === 1006 ? "the connection broke (1006)" : `the server closed it (${code})`;
    if (session.ws === ws) lost(e, closedWhy);
  };

  // The connection is gone (e: the close event; null: given up here).
  function lost(e, why) {
    clearInterval(watch);
    counters.connected = false;
    rejectReady(new Error(closedWhy)); // a Speak waiting for this session says why it was refused
    for (const w of session.waiters.splice(0)) w.reject(new Error("the connection closed"));
    handlers.closed(why);
    if (unauthorized) {
      setConn("wrong API key", "bad");
      log("the server refused the API key; fix it in the header field", "err");
      return; // reconnect when the key changes
    }
    // Closed because it was idle (its idle timeout, or a newcomer took its place at the server's session limit):
    // reconnecting now would hold a session nobody uses, and at the limit evict the newcomer in turn once it is
    // idle (two open pages took turns evicting each other for ever). The next Speak reconnects (configure).
    if (closedBy === "idle_timeout" || closedBy === "evicted_idle") {
      setConn("idle · reconnects on Speak", "wait");
      log("the server closed this idle session; Speak reconnects", "warn");
      return;
    }
    // Back off 0.5 s, 1 s, 2 s … 10 s so a restarting server is not hammered.
    if (session.retry === 0) {
      const how = e ? `connection closed (${e.code}${e.reason ? ` ${e.reason}` : ""})` : why;
      log(`${how}; reconnecting`, "warn");
    }
    const delay = Math.min(10_000, 500 * 2 ** session.retry++);
    const state = closedBy === "too_many_sessions" ? "server full" : e ? "disconnected" : "no answer";
    setConn(`${state} · retry in ${Math.round(delay / 1000) || 1} s`, "bad");
    setTimeout(() => session.ws === ws && connect(), delay);
  }
}

export function send(msg) {
  session.ws.send(toJson(msg));
}

// Cancel what the server is still speaking; its audio still in flight is dropped until `cancelled`.
export function cancel() {
  if (session.ws?.readyState === WebSocket.OPEN) {
    send({ type: "cancel" });
    session.awaitingCancel++;
  }
}

// The session, open and configured as cfg. Waiting out a reconnect back-off (server restarted, idle
// timeout)? This retries right away.
export async function configure(cfg) {
  if (!session.ws || session.ws.readyState > WebSocket.OPEN) reconnectNow();
  await session.ready;
  await applyConfig(cfg);
}

// Send a session.config when the desired one differs from the last one sent, and wait for the answer
// so a bad parameter is reported before any text is spoken with the old settings.
async function applyConfig(cfg) {
  const json = toJson(cfg);
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
    case "cancelled":
      counters.cancelled++;
      counters.lastCancelled = msg;
      session.awaitingCancel = Math.max(0, session.awaitingCancel - 1);
      log("■ cancelled by the server: no more audio of that text");
      break;
    case "error": {
      counters.errors = [...counters.errors.slice(-49), msg];
      // an error naming a context (or an utterance) answers a text, flush or cancel, never a config
      const w = !msg.utterance_id && !msg.context_id && session.waiters.shift();
      if (w) w.reject(new Error(`${msg.message} (${msg.code})`));
      log(`error ${msg.code}${msg.context_id ? ` (${msg.context_id})` : ""}: ${msg.message}`, "err");
      break;
    }
  }
  handlers.message(msg);
}

function onAudio(buf) {
  // Audio of cancelled text can still be in flight until the server's `cancelled`: drop it.
  if (session.awaitingCancel > 0) {
    counters.framesDropped++;
    return;
  }
  handlers.audio(buf);
}
