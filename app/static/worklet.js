// Playback ring buffer for streamed PCM: the "Unmute" pattern.
//
// The main thread posts Float32Array frames as they arrive from the WebSocket; the audio thread pulls
// 128 samples per render quantum. Playback starts only once a small cushion is buffered (80 ms), so
// network and generation jitter do not turn into gaps. When the buffer runs dry while more audio is
// expected (an underrun) we output silence, count it, and raise the start threshold a little, so a slow
// stream settles into fewer, longer chunks instead of stuttering. Gains are ramped: a short fade-in
// after every (re)start, and a fade-out as the buffer empties, so starting and stopping never clicks.
//
// PlaybackRing is plain JS so the page can also drive it from a ScriptProcessorNode where AudioWorklet
// is unavailable (insecure contexts); the processor below only registers inside an AudioWorkletGlobalScope.

export class PlaybackRing {
  constructor(rate, opts = {}) {
    const ms = (x) => Math.round((rate * x) / 1000);
    this.rate = rate;
    this.buf = new Float32Array(ms(opts.initialCapacityMs ?? 10_000)); // grows on demand
    this.maxCapacity = ms(opts.maxCapacityMs ?? 600_000);
    this.readPos = 0;
    this.size = 0; // samples buffered
    this.initialThreshold = ms(opts.startMs ?? 80);
    this.threshold = this.initialThreshold;
    this.thresholdStep = ms(opts.growMs ?? 40);
    this.maxThreshold = ms(opts.maxStartMs ?? 600);
    this.fadeLen = Math.max(1, ms(opts.fadeMs ?? 6));
    this.gain = 0;
    this.playing = false;
    this.ended = false; // the sender said no more audio is coming for now: play the tail out
    this.played = 0; // samples played since construction (never reset: the page takes differences)
    this.underruns = 0; // since the last resetStats()
    this.overflowed = 0; // samples dropped because the buffer hit maxCapacity
    this.events = []; // "start" | "underrun" | "drained", drained by the owner after render()
  }

  push(pcm) {
    this.ended = false;
    if (this.size + pcm.length > this.buf.length) this.grow(this.size + pcm.length);
    const room = this.buf.length - this.size;
    const n = Math.min(pcm.length, room);
    this.overflowed += pcm.length - n;
    let w = (this.readPos + this.size) % this.buf.length;
    const first = Math.min(n, this.buf.length - w);
    this.buf.set(pcm.subarray(0, first), w);
    if (n > first) this.buf.set(pcm.subarray(first, n), 0);
    this.size += n;
  }

  grow(need) {
    let cap = this.buf.length;
    while (cap < need && cap < this.maxCapacity) cap *= 2;
    cap = Math.min(cap, this.maxCapacity);
    if (cap <= this.buf.length) return;
    const next = new Float32Array(cap);
    const first = Math.min(this.size, this.buf.length - this.readPos);
    next.set(this.buf.subarray(this.readPos, this.readPos + first), 0);
    next.set(this.buf.subarray(0, this.size - first), first);
    this.buf = next;
    this.readPos = 0;
  }

  end() {
    this.ended = true;
    if (!this.playing && this.size === 0) this.events.push("drained"); // already played out
  }

  // Barge-in: drop everything buffered. The threshold learned from past underruns is kept.
  reset() {
    this.readPos = 0;
    this.size = 0;
    this.playing = false;
    this.ended = false;
    this.gain = 0;
  }

  // Per-utterance counters. The start threshold is kept: it reflects how fast this stream really is.
  resetStats() {
    this.underruns = 0;
    this.overflowed = 0;
  }

  // Fill `out` (any length) with the next samples or silence.
  render(out) {
    const n = out.length;
    if (!this.playing) {
      if (this.size > 0 && (this.size >= this.threshold || this.ended)) {
        this.playing = true;
        this.gain = 0; // fade in from silence
        this.events.push("start");
      } else {
        out.fill(0);
        return;
      }
    }
    const take = Math.min(n, this.size);
    const cap = this.buf.length;
    const step = 1 / this.fadeLen;
    let r = this.readPos;
    for (let i = 0; i < take; i++) {
      // Target gain 1, or lower as the last samples in the buffer approach, so a dry buffer fades to 0.
      // The gain moves at most `step` per sample, which makes both ramps click-free.
      const left = this.size - i; // samples left including this one
      const target = left < this.fadeLen ? left / this.fadeLen : 1;
      if (this.gain < target) this.gain = Math.min(target, this.gain + step);
      else if (this.gain > target) this.gain = Math.max(target, this.gain - step);
      out[i] = this.buf[r] * this.gain;
      if (++r === cap) r = 0;
    }
    if (take < n) out.fill(0, take);
    this.readPos = take === this.size ? 0 : r;
    this.size -= take;
    this.played += take;
    if (take < n) {
      this.playing = false;
      this.gain = 0;
      if (this.ended) {
        this.events.push("drained");
      } else {
        this.underruns++;
        this.threshold = Math.min(this.maxThreshold, this.threshold + this.thresholdStep);
        this.events.push("underrun");
      }
    }
  }

  stats() {
    return {
      type: "stats",
      bufferedSamples: this.size,
      bufferedMs: (this.size / this.rate) * 1000,
      played: this.played,
      underruns: this.underruns,
      thresholdMs: (this.threshold / this.rate) * 1000,
      playing: this.playing,
      ended: this.ended,
      overflowed: this.overflowed,
    };
  }
}

if (typeof AudioWorkletProcessor !== "undefined" && typeof registerProcessor === "function") {
  class ZonosPlayer extends AudioWorkletProcessor {
    constructor(options) {
      super();
      // `sampleRate` is the AudioWorkletGlobalScope's global: the context's real rate.
      this.ring = new PlaybackRing(sampleRate, options?.processorOptions ?? {});
      this.statsEvery = Math.round(sampleRate / 8); // ~8 reports per second
      this.sinceStats = 0;
      this.port.onmessage = (e) => this.onMessage(e.data);
    }

    onMessage(msg) {
      switch (msg.type) {
        case "pcm":
          this.ring.push(msg.pcm);
          return; // the periodic report covers it
        case "end":
          this.ring.end();
          break;
        case "reset":
          this.ring.reset();
          if (msg.stats) this.ring.resetStats();
          break;
        default:
          return;
      }
      const s = this.ring.stats();
      s.events = this.ring.events.splice(0);
      this.port.postMessage(s);
    }

    process(_inputs, outputs) {
      const out = outputs[0];
      this.ring.render(out[0]);
      for (let c = 1; c < out.length; c++) out[c].set(out[0]);
      this.sinceStats += out[0].length;
      if (this.ring.events.length || this.sinceStats >= this.statsEvery) {
        const s = this.ring.stats();
        s.events = this.ring.events.splice(0);
        this.port.postMessage(s);
        this.sinceStats = 0;
      }
      return true; // keep the node alive between utterances
    }
  }
  registerProcessor("zonos-player", ZonosPlayer);
}
