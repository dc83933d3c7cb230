"""The speaker encoder's input: a 24 kHz clip -> its log-mel spectrogram, as the reference computes it
(reflect padding, torchaudio MelSpectrogram 1024/256 with slaney mels, magnitude, log of clamp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchaudio
from torch import nn

# Frontend constants: literals in the reference (speaker_cloning.py), not config fields.
SAMPLE_RATE = 24_000
N_FFT = 1024
WIN_LENGTH = 1024
HOP_LENGTH = 256
N_MELS = 128
F_MIN = 0.0
F_MAX = 12_000.0
LOG_FLOOR = 1e-5
WAVE_PAD = (N_FFT - HOP_LENGTH) // 2  # 384 samples of reflect padding on each side


def num_frames(num_samples: int) -> int:
    """Mel frames the frontend produces for ``num_samples`` 24 kHz samples (0 if too short)."""
    padded = num_samples + 2 * WAVE_PAD
    if num_samples <= WAVE_PAD or padded < N_FFT:
        return 0
    return 1 + (padded - N_FFT) // HOP_LENGTH


class LogMelFrontend(nn.Module):
    """Waveform [B, N] at 24 kHz -> log-mel [B, T, 128], exactly as the reference builds it.

    Its buffers (Hann window, slaney filterbank) are non-persistent so they never appear in
    ``state_dict`` (the checkpoint has none), and it always computes in float32.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE,
            n_fft=N_FFT,
            win_length=WIN_LENGTH,
            hop_length=HOP_LENGTH,
            f_min=F_MIN,
            f_max=F_MAX,
            n_mels=N_MELS,
            power=1.0,
            center=False,
            norm="slaney",
            mel_scale="slaney",
        )
        # Re-registering an existing buffer with persistent=False is public nn.Module API.
        for module in self.mel.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, buf, persistent=False)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.ndim == 1:
            wav = wav.unsqueeze(0)
        if self.mel.mel_scale.fb.dtype != torch.float32:
            # Someone called .half()/.to(bf16) on the whole encoder: keep the DSP in float32.
            self.mel.float()
        wav = wav.to(torch.float32)
        wav = F.pad(wav.unsqueeze(1), (WAVE_PAD, WAVE_PAD), mode="reflect").squeeze(1)
        mel = self.mel(wav)  # [B, 128, T]
        mel = torch.log(torch.clamp(mel, min=LOG_FLOOR))
        return mel.transpose(1, 2)  # [B, T, 128]


# ------------------------------------------------------------------------------------------
# Network. Attribute names mirror the checkpoint keys; there is no BatchNorm anywhere.
# ------------------------------------------------------------------------------------------
