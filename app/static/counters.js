// What the page did, on window.__zonos: the browser tests read it (and it is handy in the devtools console).

export const counters = (window.__zonos = {
  connected: false,
  sessionId: null,
  framesReceived: 0, // binary audio frames accepted for playback
  bytesReceived: 0,
  framesDropped: 0, // frames of cancelled text that arrived before `cancelled` (expected, dropped)
  strayFrames: 0, // frames with no turn to play them (would be a protocol violation)
  samplesPlayed: 0, // reported by the playback worklet (since the current AudioContext was opened)
  underruns: 0,
  bufferedMs: 0,
  playerKind: null, // "worklet" | "script-processor"
  contextRate: null,
  clientTtfaMs: null,
  state: "idle", // "idle" | "speaking" | "stopping"
  turnsEnded: 0,
  lastTurnEnd: null, // "done" | "stopped" | "connection lost"
  lastStart: null,
  lastDone: null,
  dones: 0,
  flushed: 0,
  cancelled: 0,
  lastCancelled: null,
  errors: [],
  voices: [],
});
