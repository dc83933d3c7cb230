// Audio output: AudioContext at the stream's rate -> playback worklet (worklet.js) -> analyser -> speakers.

import { counters } from "./counters.js";
import { $, fmtMs } from "./dom.js";
import { log } from "./eventlog.js";
import { PlaybackRing } from "./worklet.js";

export const player = {
  ctx: null,
  node: null, // AudioWorkletNode or ScriptProcessorNode
  ring: null, // PlaybackRing when running on the ScriptProcessor fallback
  analyser: null,
  rate: 0, // the rate the server streams at
  opening: null, // Promise of the context + worklet set-up
  resample: 1, // ctx.sampleRate / rate, when the browser would not open the context at `rate`
  stats: { bufferedMs: 0, played: 0, underruns: 0, thresholdMs: 80, playing: false },
};

export async function ensureAudio(rate) {
  if (player.ctx && player.rate === rate) {
    await player.opening; // a second click while the worklet is still loading
    if (player.ctx.state !== "running") await player.ctx.resume(); // autoplay policy: resume on the click
    return;
  }
  player.rate = rate;
  player.opening = openAudio(rate, player.ctx);
  try {
    await player.opening;
  } catch (e) {
    player.rate = 0; // the next click tries again
    throw e;
  }
}

async function openAudio(rate, old) {
  player.node = null;
  if (old) await old.close();
  // Open the context at the stream's rate so the PCM needs no conversion in the browser.
  const ctx = new AudioContext({ sampleRate: rate, latencyHint: "interactive" });
  player.ctx = ctx;
  // A new context starts a new player: its counters (played samples included) start from zero.
  player.stats = { bufferedMs: 0, played: 0, underruns: 0, thresholdMs: 80, playing: false };
  counters.samplesPlayed = 0;
  player.resample = ctx.sampleRate / rate;
  if (ctx.sampleRate !== rate) log(`the browser opened audio at ${ctx.sampleRate} Hz, not ${rate}; resampling here`, "warn");
  player.analyser = ctx.createAnalyser();
  player.analyser.fftSize = 2048;
  player.analyser.connect(ctx.destination);
  if (ctx.audioWorklet) {
    await ctx.audioWorklet.addModule(new URL("./worklet.js", import.meta.url));
    player.node = new AudioWorkletNode(ctx, "zonos-player", { numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1] });
    player.node.port.onmessage = (e) => onPlayerStats(e.data);
    player.ring = null;
    counters.playerKind = "worklet";
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
    player.node = node;
    player.ring = ring;
    counters.playerKind = "script-processor";
    log("AudioWorklet unavailable (insecure context?): using the ScriptProcessor fallback", "warn");
  }
  player.node.connect(player.analyser);
  counters.contextRate = ctx.sampleRate;
  $("#audio-info").textContent = `${rate / 1000} kHz float32 · ${counters.playerKind} · output latency ${fmtMs((ctx.baseLatency + (ctx.outputLatency || 0)) * 1000)}`;
  await ctx.resume();
}

export function playerSend(msg, transfer) {
  if (!player.node) return;
  if (player.ring) {
    if (msg.type === "pcm") player.ring.push(msg.pcm);
    else if (msg.type === "end") player.ring.end();
    else if (msg.type === "reset") {
      player.ring.reset();
      if (msg.stats) player.ring.resetStats();
    }
  } else player.node.port.postMessage(msg, transfer || []);
}

export function pushPcm(f32) {
  if (player.resample !== 1) f32 = linearResample(f32, player.resample);
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

// The ring's events, in order ("start", "drained", "underrun"): the turn being spoken follows them.
let onPlaybackEvent = () => {};
export function setPlaybackEventHandler(handler) {
  onPlaybackEvent = handler;
}

function onPlayerStats(s) {
  player.stats = s;
  counters.samplesPlayed = s.played;
  counters.underruns = s.underruns;
  counters.bufferedMs = s.bufferedMs;
  for (const ev of s.events || []) onPlaybackEvent(ev);
}
