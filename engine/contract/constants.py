"""ZONOS2's fixed numbers, shared by every node and the gateway (spec §5, §8)."""

from __future__ import annotations

SAMPLE_RATE = 44100  # DAC 44.1 kHz: every PCM sample the engine produces
HOP = 512  # samples per frame
FRAME_S = HOP / SAMPLE_RATE  # 11.6 ms of audio per frame: the real-time budget of one decode step
N_CODEBOOKS = 9
CODEBOOK_SIZE = 1024
EOA_ID = 1024  # end of audio, in any codebook
PAD_ID = 1025  # the delay pattern's padding
# an utterance's word times not aligned within this are not worth aligning: the gateway keeps its estimate, and
# the engine's aligner skips an utterance that waited this long in its queue
ALIGN_WAIT_S = 10.0
# how long the gateway waits for a clip's embedding: the engine's speaker_encoder skips a clip that waited this long
EMBED_WAIT_S = 60.0
