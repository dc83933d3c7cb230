// Microphone recordings as clips the server accepts.
// MediaRecorder gives webm/ogg Opus; the server wants WAV/FLAC/OGG/MP3 clips. Decode it with an
// OfflineAudioContext (which also resamples to its own rate) and write a mono 16-bit PCM WAV ourselves.

// the model's native rate, which the page's template writes (engine/contract/constants.py owns it)
export async function blobToWav(blob, rate = Number(document.body.dataset.nativeRate)) {
  const decoder = new OfflineAudioContext(1, 1, rate);
  const audio = await decoder.decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(audio.length);
  for (let c = 0; c < audio.numberOfChannels; c++) {
    const ch = audio.getChannelData(c);
    for (let i = 0; i < ch.length; i++) mono[i] += ch[i] / audio.numberOfChannels;
  }
  return { blob: encodeWav16(mono, audio.sampleRate), seconds: audio.duration, rate: audio.sampleRate };
}

export function encodeWav16(samples, rate) {
  const data = samples.length * 2;
  const view = new DataView(new ArrayBuffer(44 + data));
  const str = (off, s) => [...s].forEach((ch, i) => view.setUint8(off + i, ch.charCodeAt(0)));
  str(0, "RIFF");
  view.setUint32(4, 36 + data, true);
  str(8, "WAVE");
  str(12, "fmt ");
  view.setUint32(16, 16, true); // fmt chunk size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true); // byte rate
  view.setUint16(32, 2, true); // block align
  view.setUint16(34, 16, true); // bits per sample
  str(36, "data");
  view.setUint32(40, data, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Blob([view], { type: "audio/wav" });
}
