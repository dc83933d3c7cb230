"""Drives one of pipecat's real TTS services against the gateway (run by tests/system/test_dialects.py in the
frameworks' virtualenv, `.venv-frameworks`): the service is configured as for the real provider except for
its URL, with a voice from our library. It speaks a turn, then a second turn is interrupted the way a
pipecat pipeline interrupts (an InterruptionFrame when the user starts talking), then a last turn is spoken.
Prints one JSON line: the first turn's audio bytes, the sample rate, errors, the last turn's audio bytes.

    python tests/frameworks/pipecat_client.py {elevenlabs|cartesia|deepgram} http://127.0.0.1:8000 KEY VOICE
"""

from __future__ import annotations

import asyncio
import json
import os
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
    TTSTextFrame,
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
        self.first_audio = asyncio.Event()
        self.turn_start = 0  # audio bytes when the turn being spoken was queued
        self.stopped = asyncio.Event()  # a TTSStoppedFrame came
        self.spoken = asyncio.Event()  # ... after audio of the turn being spoken
        self.silent = 0  # turns the random model left silent (see `speak`)
        self.words: list[str] = []  # TTSTextFrames: the words the service timed (word timestamps)

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio += len(frame.audio)
            self.rates.add(frame.sample_rate)
            self.first_audio.set()
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped.set()
            if self.audio > self.turn_start:
                self.spoken.set()
        elif isinstance(frame, TTSTextFrame):
            self.words.append(frame.text)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(str(frame.error))
        await self.push_frame(frame, direction)

    def reported_errors(self) -> list[str]:
        """The errors, less pipecat's "completed with no audio" for each turn spoken again (see `speak`)."""
        out, forgive = [], self.silent
        for e in self.errors:
            if forgive and "completed with no audio" in e:
                forgive -= 1
            else:
                out.append(e)
        return out


def make_service(kind: str, base: str, key: str, voice: str):
    ws = base.replace("http://", "ws://").replace("https://", "wss://")
    if kind == "elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

        return ElevenLabsTTSService(api_key=key, url=ws, settings=ElevenLabsTTSService.Settings(voice=voice))
    if kind == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService

        return CartesiaTTSService(
            api_key=key, url=ws + "/tts/websocket", settings=CartesiaTTSService.Settings(voice=voice)
        )
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


def step(what: str) -> None:
    """A progress line on stderr: a hung run's output says which step it hung at."""
    print(f"[pipecat_client] {what}", file=sys.stderr, flush=True)


async def within(aw, what: str):
    """Wait for `aw`; past TIMEOUT say what never came and exit at once (cancelling a pipecat worker that
    waits on the server can hang past the test's own timeout, and then nothing says where it stood)."""
    try:
        return await asyncio.wait_for(aw, TIMEOUT)
    except TimeoutError:
        step(f"TIMEOUT after {TIMEOUT} s waiting for {what}")
        os._exit(3)


async def speak(worker, col: Collector, text: str, what: str) -> int:
    """Speak a turn (a TTSSpeakFrame) to its TTSStoppedFrame; its audio bytes. The embedded random model
    sometimes ends a sentence before its first audio frame (a few in a hundred): a turn that said nothing is
    spoken again, up to 5 times, and pipecat's error for it ("completed with no audio") is not counted."""
    for _ in range(5):
        col.turn_start = col.audio
        col.stopped.clear()
        col.spoken.clear()
        col.words.clear()  # (a silent attempt's text, pushed whole by pipecat, is not this turn's words)
        await worker.queue_frame(TTSSpeakFrame(text))
        await within(col.stopped.wait(), f"{what}'s TTSStoppedFrame")
        while col.audio > col.turn_start and not col.spoken.is_set():  # a stop from before; its own follows
            col.stopped.clear()
            await within(col.stopped.wait(), f"{what}'s TTSStoppedFrame")
        if col.spoken.is_set():
            return col.audio - col.turn_start
        step(f"{what} said nothing: again")
        col.silent += 1
    return 0


async def timed_words(col: Collector, text: str, timed: bool) -> None:
    """Wait for the words of `text` the service times against its audio (so the last come after it): up to 15 s (a
    fixed second was too short on a loaded machine); a service without word times (`timed` false) gets a second."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (15.0 if timed else 1.0)
    while len(col.words) < len(text.split()) and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def main(kind: str, base: str, key: str, voice: str) -> dict:
    col = Collector()
    worker, running = await make_worker(Pipeline([make_service(kind, base, key, voice), col]))
    run = asyncio.create_task(running)

    step("1. a spoken turn")
    text = "Hello there. How are you today?"
    spoken = await speak(worker, col, text, "the first turn")
    await timed_words(col, text, kind != "deepgram")  # (Deepgram sends no word times)
    first_words = list(col.words)

    step(f"2a. replies interrupted while the LLM still streams them (turn 1: {spoken} bytes)")
    # pipecat interrupts the turn it is streaming (ElevenLabs: one close_context, Cartesia: cancel, Deepgram:
    # Clear); the reply's end comes after. Interrupted replies must not pile up on the server.
    for n in range(3):
        col.first_audio.clear()
        await worker.queue_frames(
            [LLMFullResponseStartFrame(), *(TextFrame(f"Reply {n}, sentence {i}, cut short. ") for i in range(5))]
        )
        await within(col.first_audio.wait(), f"interrupted reply {n}'s first audio")
        await worker.queue_frame(InterruptionFrame())
        await worker.queue_frame(LLMFullResponseEndFrame())

    step("2b. an LLM reply interrupted once its audio has begun")
    # The LLM streams the whole reply long before it is spoken, then the user barges in. pipecat ends the turn
    # (ElevenLabs: flush + close_context, Cartesia: continue false, Deepgram: Flush), then interrupts it
    # (ElevenLabs: close_context again, Cartesia: cancel, Deepgram: Clear).
    col.first_audio.clear()
    await worker.queue_frames(
        [
            LLMFullResponseStartFrame(),
            *(TextFrame(f"This is sentence number {i} of a long reply. ") for i in range(8)),
            LLMFullResponseEndFrame(),
        ]
    )
    await within(col.first_audio.wait(), "the reply's first audio")
    step("2b. interrupting")
    await worker.queue_frame(InterruptionFrame())

    step("3. the same socket still speaks after the interruption")
    after = await speak(worker, col, "Sure, go ahead.", "the last turn")
    step("4. ending")
    await worker.queue_frame(EndFrame())
    await within(run, "the pipeline to end")
    return {
        "service": kind,
        "audio_bytes": spoken,
        "sample_rate": min(col.rates) if col.rates else None,
        "errors": col.reported_errors(),
        "after_interruption_bytes": after,
        "first_turn_words": first_words,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
