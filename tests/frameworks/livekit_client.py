"""Drives one of LiveKit Agents' real TTS plugins (elevenlabs, cartesia, deepgram) against the gateway (run by
tests/system/test_dialects.py in the frameworks' virtualenv): configured as for the real provider except for its
base URL, with a voice from our library, and each plugin's default output format (ElevenLabs': MP3 at
22.05 kHz). Streams one text (`stream()`, the WebSocket dialects) or synthesizes it (`synthesize()`, the
plugins' one-shot HTTP calls: ElevenLabs' /stream, Cartesia's /tts/bytes, Deepgram's POST /v1/speak) and
prints one JSON line: audio bytes (decoded PCM), sample rate, errors, and the word-timed transcript the plugin
emitted from our alignment / timestamps (`timed_words`: [text, start s, end s] each; the plugins attach them
to the audio frames for LiveKit's synchronized transcription).

    python tests/frameworks/livekit_client.py {elevenlabs|cartesia|deepgram} http://127.0.0.1:8000 KEY VOICE
    [synthesize | reuse=IDLE_S]

`reuse=IDLE_S`: two streamed turns on one TTS, IDLE_S seconds apart (the plugin's pooled socket reused).
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

TIMEOUT = 120


def make_tts(kind: str, base: str, key: str, voice: str, session: aiohttp.ClientSession):
    if kind == "elevenlabs":
        from livekit.plugins import elevenlabs

        return elevenlabs.TTS(api_key=key, base_url=base + "/v1", voice_id=voice, http_session=session)
    if kind == "cartesia":
        from livekit.plugins import cartesia

        return cartesia.TTS(api_key=key, base_url=base, voice=voice, http_session=session)
    if kind == "deepgram":
        from livekit.plugins import deepgram

        return deepgram.TTS(api_key=key, base_url=base + "/v1/speak", model=voice, http_session=session)
    raise SystemExit(f"unknown plugin {kind}")


async def attempt(
    kind: str, base: str, key: str, voice: str, mode: str
) -> tuple[int, set[int], list[str], list[list[object]]]:
    from livekit.agents import APIConnectOptions
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

    errors: list[str] = []
    audio, rates = 0, set()
    timed: list[list[object]] = []
    async with aiohttp.ClientSession() as session:
        tts = make_tts(kind, base, key, voice, session)
        if mode == "synthesize":  # a fixed phrase; no retries, so that a refusal is reported at once
            stream = tts.synthesize("Hello there. How are you today?", conn_options=APIConnectOptions(max_retry=0))
        else:
            stream = tts.stream()
            stream.push_text("Hello there. How are you today?")
            stream.flush()
            stream.end_input()
        try:
            async with asyncio.timeout(TIMEOUT):
                async for ev in stream:
                    audio += len(ev.frame.data.tobytes())
                    rates.add(ev.frame.sample_rate)
                    for word in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or []:
                        timed.append([str(word), word.start_time, word.end_time])
        except Exception as e:  # the plugin's own error, reported
            errors.append(f"{type(e).__name__}: {e}")
        await stream.aclose()
        await tts.aclose()
    return audio, rates, errors, timed


async def turn(tts, errors: list[str]) -> int:
    """One streamed turn on the plugin's pooled socket: its audio bytes."""
    audio = 0
    stream = tts.stream()
    stream.push_text("Hello there. How are you today?")
    stream.flush()
    stream.end_input()
    try:
        async with asyncio.timeout(TIMEOUT):
            async for ev in stream:
                audio += len(ev.frame.data.tobytes())
    except Exception as e:  # the plugin's own error, reported
        errors.append(f"{type(e).__name__}: {e}")
    await stream.aclose()
    return audio


async def reuse(kind: str, base: str, key: str, voice: str, idle_s: float) -> dict:
    """Two turns on one TTS (its pooled socket), `idle_s` apart: a voice agent's next turn after a pause."""
    errors: list[str] = []
    async with aiohttp.ClientSession() as session:
        tts = make_tts(kind, base, key, voice, session)
        first = await turn(tts, errors)
        await asyncio.sleep(idle_s)
        second = await turn(tts, errors)
        await tts.aclose()
    return {"service": kind, "mode": "reuse", "turns_audio_bytes": [first, second], "errors": errors}


async def main(kind: str, base: str, key: str, voice: str, mode: str = "stream") -> dict:
    # The embedded random model sometimes ends both sentences before their first audio frame (about 1 in
    # 1,000): a text that said nothing is sent again, up to 5 times; the last attempt is reported.
    for _ in range(5):
        audio, rates, errors, timed = await attempt(kind, base, key, voice, mode)
        if audio:
            break
        print("[livekit_client] nothing was said: again", errors, file=sys.stderr, flush=True)
    return {
        "service": kind,
        "mode": mode,
        "audio_bytes": audio,
        "sample_rate": min(rates) if rates else None,
        "errors": errors,
        "timed_words": timed,
    }


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[5].startswith("reuse="):  # reuse=IDLE_S
        print(json.dumps(asyncio.run(reuse(*sys.argv[1:5], float(sys.argv[5].partition("=")[2])))))
    else:
        print(json.dumps(asyncio.run(main(*sys.argv[1:6]))))
