"""Drives one of pipecat's real TTS services against the gateway (run by tests/test_dialects.py in the
frameworks' virtualenv, `.venv-frameworks`): the service is configured as for the real provider except for
its URL, with a voice from our library. It speaks a turn, then a second turn is interrupted the way a
pipecat pipeline interrupts (an InterruptionFrame when the user starts talking), then a last turn is spoken.
Prints one JSON line: the first turn's audio bytes, the sample rate, errors, the last turn's audio bytes.

    python tests/frameworks/pipecat_client.py {elevenlabs|cartesia|deepgram} http://127.0.0.1:8000 KEY VOICE
"""

from __future__ import annotations

import asyncio
import json
import sys

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    TextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

RATE = 24000
TIMEOUT = 120


class Collector(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.audio = 0
        self.rates: set[int] = set()
        self.errors: list[str] = []
        self.stopped = asyncio.Event()
        self.first_audio = asyncio.Event()
        self.marked: int | None = None  # audio bytes when the last turn was queued
        self.last_turn = asyncio.Event()  # its first audio came (a stop of the turn before no longer counts)

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio += len(frame.audio)
            self.rates.add(frame.sample_rate)
            self.first_audio.set()
            if self.marked is not None and not self.last_turn.is_set():
                self.stopped.clear()
                self.last_turn.set()
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(str(frame.error))
        await self.push_frame(frame, direction)


def make_service(kind: str, base: str, key: str, voice: str):
    ws = base.replace("http://", "ws://").replace("https://", "wss://")
    if kind == "elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
        return ElevenLabsTTSService(api_key=key, url=ws, settings=ElevenLabsTTSService.Settings(voice=voice))
    if kind == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService
        return CartesiaTTSService(api_key=key, url=ws + "/tts/websocket",
                                  settings=CartesiaTTSService.Settings(voice=voice))
    if kind == "deepgram":
        from pipecat.services.deepgram.tts import DeepgramTTSService
        return DeepgramTTSService(api_key=key, base_url=ws, settings=DeepgramTTSService.Settings(voice=voice))
    raise SystemExit(f"unknown service {kind}")


async def make_worker(pipeline: Pipeline):
    try:  # pipecat >= 1.3
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.workers.runner import WorkerRunner

        worker = PipelineWorker(pipeline, params=PipelineParams(audio_out_sample_rate=RATE), idle_timeout_secs=None)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        return worker, runner.run()
    except ImportError:
        from pipecat.pipeline.runner import PipelineRunner
        from pipecat.pipeline.task import PipelineParams, PipelineTask

        task = PipelineTask(pipeline, params=PipelineParams(audio_out_sample_rate=RATE))
        return task, PipelineRunner(handle_sigint=False).run(task)


async def main(kind: str, base: str, key: str, voice: str) -> dict:
    col = Collector()
    worker, running = await make_worker(Pipeline([make_service(kind, base, key, voice), col]))
    run = asyncio.create_task(running)

    # 1. a spoken turn
    await worker.queue_frame(TTSSpeakFrame("Hello there. How are you today?"))
    await asyncio.wait_for(col.stopped.wait(), TIMEOUT)
    spoken = col.audio

    # 2. an LLM reply interrupted once its audio has begun (pipecat sends close_context / cancel / Clear)
    col.first_audio.clear()
    await worker.queue_frames([LLMFullResponseStartFrame(),
                               *(TextFrame(f"This is sentence number {i} of a long reply. ") for i in range(8))])
    await asyncio.wait_for(col.first_audio.wait(), TIMEOUT)
    await worker.queue_frame(InterruptionFrame())
    await worker.queue_frame(LLMFullResponseEndFrame())

    # 3. the same socket still speaks after the interruption
    col.marked = col.audio
    await worker.queue_frame(TTSSpeakFrame("Sure, go ahead."))
    await asyncio.wait_for(col.last_turn.wait(), TIMEOUT)
    await asyncio.wait_for(col.stopped.wait(), TIMEOUT)
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(run, TIMEOUT)
    return {"service": kind, "audio_bytes": spoken, "sample_rate": min(col.rates) if col.rates else None,
            "errors": col.errors, "after_interruption_bytes": col.audio - col.marked}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
