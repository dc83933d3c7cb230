"""Drives one of pipecat's real HTTP TTS services (ElevenLabsHttpTTSService: /stream/with-timestamps,
CartesiaHttpTTSService: /tts/bytes, DeepgramHttpTTSService: POST /v1/speak) against the gateway (run by
tests/system/test_clients.py in the frameworks' virtualenv): configured as for the real provider except for its
base URL, with a voice from our library. Speaks one turn and prints one JSON line: audio bytes, sample rate,
errors, the words of its word-timed transcript frames.

    python tests/frameworks/pipecat_http_client.py {elevenlabs|cartesia|deepgram} http://127.0.0.1:8000 KEY VOICE
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from pipecat.frames.frames import EndFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat_client import RATE, Collector, make_worker, speak, timed_words, within  # the same directory


def make_service(kind: str, base: str, key: str, voice: str, session: aiohttp.ClientSession):
    if kind == "elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService as Service
    elif kind == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaHttpTTSService as Service
    elif kind == "deepgram":
        from pipecat.services.deepgram.tts import DeepgramHttpTTSService as Service
    else:
        raise SystemExit(f"unknown service {kind}")
    return Service(
        api_key=key, base_url=base, aiohttp_session=session, sample_rate=RATE, settings=Service.Settings(voice=voice)
    )


async def main(kind: str, base: str, key: str, voice: str) -> dict:
    async with aiohttp.ClientSession() as session:
        col = Collector()
        worker, running = await make_worker(Pipeline([make_service(kind, base, key, voice, session), col]))
        run = asyncio.create_task(running)
        text = "Hello there. How are you today?"
        audio = await speak(worker, col, text, "the turn")
        await timed_words(col, text, kind == "elevenlabs")  # (only its with-timestamps route times words)
        await worker.queue_frame(EndFrame())
        await within(run, "the pipeline to end")
    return {
        "service": kind,
        "audio_bytes": audio,
        "sample_rate": min(col.rates) if col.rates else None,
        "errors": col.reported_errors(),
        "words": col.words,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
