"""Buffers text streamed in from an LLM and cuts it into utterances at sentence boundaries."""

from __future__ import annotations

import re

# A sentence ends at . ! ? … (optionally followed by closing quotes/brackets) and then whitespace,
# or at a CJK full stop, or at a newline. "Dr. Smith" style abbreviations are not worth a model here:
# a short utterance costs little, and waiting costs latency.
_BOUNDARY = re.compile(r"([.!?…]+[\"'”’)\]]*)(\s+)|([。！？]+)|(\n+)")


class TextBuffer:
    def __init__(self, max_utterance_chars: int) -> None:
        self.max_chars = max_utterance_chars
        self.text = ""

    def __len__(self) -> int:
        return len(self.text)

    def append(self, text: str) -> list[str]:
        """Add text; return the complete sentences that can be spoken now."""
        self.text += text
        return self._complete()

    def flush(self) -> list[str]:
        """Everything buffered, complete or not."""
        out = self._complete()
        rest = self.text.strip()
        self.text = ""
        if rest:
            out.extend(self._split_long(rest))
        return out

    def clear(self) -> None:
        self.text = ""

    def _complete(self) -> list[str]:
        out: list[str] = []
        while m := _BOUNDARY.search(self.text):
            end = m.end(1) if m.group(1) else m.end()
            sentence = self.text[:end].strip()
            self.text = self.text[m.end():]
            if sentence:
                out.extend(self._split_long(sentence))
        # A run-on text without punctuation still gets spoken once it is too long to be one utterance.
        while len(self.text) > self.max_chars:
            cut = self.text.rfind(" ", 0, self.max_chars)
            cut = cut if cut > 0 else self.max_chars
            out.append(self.text[:cut].strip())
            self.text = self.text[cut:].lstrip()
        return [s for s in out if s]

    def _split_long(self, sentence: str) -> list[str]:
        parts = []
        while len(sentence) > self.max_chars:
            cut = sentence.rfind(" ", 0, self.max_chars)
            cut = cut if cut > 0 else self.max_chars
            parts.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if sentence:
            parts.append(sentence)
        return parts
