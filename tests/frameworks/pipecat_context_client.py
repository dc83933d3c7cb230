"""What pipecat's assistant context keeps of a reply the user interrupts (run by tests/system/test_dialects.py in
the frameworks' virtualenv). A pipeline as a voice agent has it: the TTS service (ElevenLabs or Cartesia, only
its URL changed), an output transport, the assistant context aggregator. pipecat makes a word-timed transcript
frame for each word the gateway's alignment / timestamps time (so only for words whose audio was sent); the
output transport releases each at its time and drops the rest on an interruption; the aggregator writes what
was released into the context. An LLM reply streams, and once a few of its words have been released the
user interrupts.

Prints one JSON line: the reply, the interrupted assistant message, the words the service had timed when the
interruption passed it, the words released to the aggregator, errors.

    python tests/frameworks/pipecat_context_client.py {elevenlabs|cartesia} http://127.0.0.1:8000 KEY VOICE
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
    StartFrame,
    TextFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat_client import RATE, make_service, make_worker, step, within  # the same directory

REPLY = [f"This is sentence number {i} of a long reply that the user cuts short." for i in range(8)]
RELEASED_BEFORE = 3  # words the output transport has released when the user interrupts


class Tap(FrameProcessor):
    """Notes the word frames that pass it, and how many had passed when the interruption did."""

    def __init__(self) -> None:
        super().__init__()
        self.words: list[str] = []
        self.at_interruption: int | None = None
        self.errors: list[str] = []
        self.enough = asyncio.Event()

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSTextFrame):
            self.words.append(frame.text)
            if len(self.words) >= RELEASED_BEFORE:
                self.enough.set()
        elif isinstance(frame, InterruptionFrame) and self.at_interruption is None:
            self.at_interruption = len(self.words)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(str(frame.error))
        await self.push_frame(frame, direction)


class Output(BaseOutputTransport):
    """An output transport with no device: its audio goes nowhere, its clock releases timed frames."""

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)


async def main(kind: str, base: str, key: str, voice: str) -> dict:
    context = LLMContext()
    pair = LLMContextAggregatorPair(context)
    stopped: asyncio.Future = asyncio.get_running_loop().create_future()

    @pair.assistant().event_handler("on_assistant_turn_stopped")
    async def on_stopped(_aggregator, message) -> None:
        if not stopped.done():
            stopped.set_result(message)

    made, released = Tap(), Tap()
    output = Output(TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE))
    pipeline = Pipeline([make_service(kind, base, key, voice), made, output, released, pair.assistant()])
    worker, running = await make_worker(pipeline)
    run = asyncio.create_task(running)

    step("1. an LLM reply streams")
    await worker.queue_frames(
        [LLMFullResponseStartFrame(), *(TextFrame(s + " ") for s in REPLY), LLMFullResponseEndFrame()]
    )
    await within(released.enough.wait(), f"{RELEASED_BEFORE} words released by the output transport")
    step("2. the user interrupts")
    await worker.queue_frame(InterruptionFrame())
    message = await within(stopped, "the interrupted assistant turn")
    step("3. ending")
    await worker.queue_frame(EndFrame())
    await within(run, "the pipeline to end")
    return {
        "service": kind,
        "reply": " ".join(REPLY),
        "message": message.content,
        "interrupted": message.interrupted,
        "context": [m.get("content") for m in context.get_messages() if m.get("role") == "assistant"],
        "timed_at_interruption": made.words[: made.at_interruption],
        "released": released.words,
        "errors": made.errors + released.errors,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
