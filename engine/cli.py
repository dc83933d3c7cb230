"""`python -m engine`: checkpoints, prompts, parity logits, speaker embeddings, offline synthesis."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from engine.contract.constants import SAMPLE_RATE
from engine.contract.flags import add_flags
from engine.contract.records import SamplingParams
from engine.contract.settings import WeightSources
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.offline import MAX_FRAMES
from engine.weights import load_codec, load_model, load_speaker_encoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(arg: str | None) -> str:
    return arg or ("cuda" if torch.cuda.is_available() else "cpu")


def _weights(args: argparse.Namespace) -> WeightSources:
    src = WeightSources(
        model_path=getattr(args, "model_path", None),
        dac_weights=getattr(args, "dac_weights", None),
        speaker_weights=getattr(args, "speaker_weights", None),
    )
    src.check()
    return src


def _read_embedding(path: str, dim: int | None) -> torch.Tensor:
    """A .npy/.npz speaker embedding, (D,) or (N, D) averaged; refused unless it is `dim` (any D when None)
    finite numbers."""
    arr = np.load(path, allow_pickle=False)
    if isinstance(arr, np.lib.npyio.NpzFile):
        with arr:
            if "emb" not in arr.files and len(arr.files) != 1:
                raise ValueError(f"{path}: an .npz embedding must hold one array or an 'emb' array, found {arr.files}")
            arr = arr["emb"] if "emb" in arr.files else arr[arr.files[0]]
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{path}: a speaker embedding must hold real numbers, got {arr.dtype}")
    arr = np.asarray(arr, dtype=np.float32).squeeze()
    if arr.ndim == 2 and arr.shape[0] > 0:
        arr = arr.mean(0)
    want = dim if dim is not None else arr.shape[0] if arr.ndim == 1 and arr.size else None
    if want is None or arr.shape != (want,):
        d = dim if dim is not None else "D"
        raise ValueError(f"{path}: the speaker embedding must have shape ({d},) or (N, {d}), got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{path}: the speaker embedding contains NaN or infinite values")
    return torch.from_numpy(np.array(arr))


def cmd_make_checkpoint(args: argparse.Namespace) -> None:
    from engine.model.checkpoint import count_params, write_checkpoint

    path = write_checkpoint(args.out, args.preset, seed=args.seed, fmt=args.format, device=args.device or "cpu")
    n_tensors, n_params = count_params(Zonos2Config.from_dict(preset_params(args.preset)))
    print(json.dumps({"weights": str(path), "tensors": n_tensors, "params": n_params}))


def cmd_prompt(args: argparse.Namespace) -> None:
    cfg = Zonos2Config.from_file(args.model_path) if args.model_path else Zonos2Config.from_dict(preset_params("full"))
    text = args.text
    if args.language is not None:
        from engine.frontend.textnorm import TextNormalizer

        text = TextNormalizer().normalize(text, args.language)
    cond = Conditioning(
        speaker=args.speaker,
        clean_speaker_background=args.clean_background,
        accurate_mode=not args.expressive,
        speaking_rate_bucket=args.speaking_rate_bucket,
        quality_buckets=None if args.no_quality else json.loads(args.quality_buckets),
    )
    builder = PromptBuilder(cfg)
    if args.context_codes is not None:
        if args.context_text is None:
            raise ValueError("--context-codes needs --context-text (the transcript of those frames)")
        frames = np.load(args.context_codes, allow_pickle=False)
        if not np.issubdtype(frames.dtype, np.integer):
            raise ValueError(f"{args.context_codes}: context codes must be integers, got {frames.dtype}")
        ids = builder.build_continuation(args.context_text, text, frames, cond, non_final=args.non_final)
    elif args.context_text is not None:
        raise ValueError("--context-text needs --context-codes (the frames it is the transcript of)")
    else:
        ids = builder.build(text, cond, non_final=args.non_final)
    np.save(args.out, ids)
    print(json.dumps({"out": args.out, "frames": len(ids)}))


def cmd_logits(args: argparse.Namespace) -> None:
    """Teacher-forced logits of every frame, or with a guidance scale the guided logits [9, V] of the last
    frame (engine/guidance.py): speaker CFG against the same ids without the speaker, prefix CFG against
    --uncond-input-ids with the speaker kept (prefix CFG wins when both are given, as in the reference)."""
    from engine.guidance import guide, twin

    device = _device(args.device)
    model = load_model(_weights(args), device, _DTYPES[args.dtype])
    ids = _read_ids(args.input_ids, model.cfg).to(device)
    dim = model.cfg.speaker_embedding_dim
    spk = _read_embedding(args.speaker_embedding, dim).to(device) if args.speaker_embedding else None
    if args.cfg_scale is None and args.prefix_cfg_scale is None:
        if args.uncond_input_ids:
            raise ValueError("--uncond-input-ids needs --prefix-cfg-scale")
        logits = model.forward_full(ids, speaker=spk)
        np.save(args.out, logits.float().cpu().numpy())
        print(json.dumps({"out": args.out, "shape": list(logits.shape)}))
        return
    g = SamplingParams(
        cfg_scale=1.0 if args.cfg_scale is None else args.cfg_scale,
        prefix_cfg_scale=1.0 if args.prefix_cfg_scale is None else args.prefix_cfg_scale,
    )
    g.validate()
    if args.prefix_cfg_scale is not None and not args.uncond_input_ids:
        raise ValueError("--prefix-cfg-scale needs --uncond-input-ids (the chunk's fresh prompt)")
    if args.cfg_scale is not None and args.prefix_cfg_scale is None and spk is None:
        raise ValueError("--cfg-scale (speaker CFG) needs --speaker-embedding")
    cond = model.forward_full(ids, speaker=spk)[-1]
    which = twin(g, has_speaker=spk is not None, continuation=bool(args.uncond_input_ids))
    if which is None:  # every scale is 1.0: the conditional logits
        kind, scale, uncond = "none", 1.0, cond
    elif which[0] == "prefix":
        kind, scale = which
        uncond = model.forward_full(_read_ids(args.uncond_input_ids, model.cfg).to(device), speaker=spk)[-1]
    else:
        kind, scale = which
        uncond = model.forward_full(ids, speaker=None)[-1]
    guided = guide(cond[None], uncond[None], scale)[0]
    np.save(args.out, guided.cpu().numpy())
    print(json.dumps({"out": args.out, "shape": list(guided.shape), "guidance": kind, "scale": scale}))


def _read_ids(path: str, cfg: Zonos2Config) -> torch.Tensor:
    arr = np.load(path, allow_pickle=False)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 2 or arr.shape[1] != cfg.n_codebooks + 1:
        raise ValueError(
            f"{path}: prompt ids must be integers of shape [T, {cfg.n_codebooks + 1}], got {arr.dtype} {arr.shape}"
        )
    return torch.from_numpy(arr.astype(np.int64))


def _emotion(args: argparse.Namespace, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """--emotion NAME=W ... applied to a speaker embedding (engine/frontend/emotion.py): (embedding, hidden delta)."""
    from engine.frontend.emotion import EmotionDirections, EmotionError, parse_request

    sliders: dict[str, float] = {}
    for item in args.emotion or []:
        name, sep, weight = item.partition("=")
        try:
            sliders[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"--emotion {item!r}: expected NAME=WEIGHT") from None
    fields = {
        "emotion_enabled": True,
        "emotion_sliders": sliders,
        "emotion_valence": args.valence,
        "emotion_arousal": args.arousal,
        "emotion_strength": args.emotion_strength,
    }
    req = parse_request(fields)
    if not req.requested:
        return emb, None
    if not args.emotion_directions_dir:
        raise ValueError("--emotion/--valence/--arousal need --emotion-directions-dir")
    try:
        return EmotionDirections.load(args.emotion_directions_dir).apply(emb, req, args.speaker_key)
    except EmotionError as e:
        raise ValueError(str(e)) from None


def cmd_speaker_embed(args: argparse.Namespace) -> None:
    """The speaker_encoder node as a tool: clip -> [enc_dim] float32 .npy (whatever --dtype the network ran in);
    with --emotion, the vector after emotion injection (of the clip's or of --speaker-embedding)."""
    from engine.frontend.audio import decode_audio

    src = _weights(args)
    info: dict = {}
    if args.audio:
        encoder = load_speaker_encoder(src, _device(args.device))
        if _DTYPES[args.dtype] != torch.float32:
            encoder = encoder.to(dtype=_DTYPES[args.dtype])
            encoder.frontend.float()  # the log-mel DSP always runs in float32
        wav, sr = decode_audio(Path(args.audio).read_bytes())
        emb = encoder.embed(wav, sr).float().cpu().numpy().astype(np.float32)
        info = {
            "seconds": round(len(wav) / sr, 3),
            "sample_rate": sr,
            "dtype": args.dtype,
            "encoder": src.describe()["speaker_encoder"],
        }
    else:
        emb = _read_embedding(args.speaker_embedding, None).numpy()
    emb, delta = _emotion(args, emb)
    if delta is not None:  # 'proj' directions: the embedding stays, the projected speaker row moves
        if not args.out_delta:
            raise ValueError(
                "these emotion directions move the projected speaker row ('proj' space), not the "
                "embedding: give --out-delta to write that delta"
            )
        np.save(args.out_delta, delta)
        info["out_delta"] = args.out_delta
    np.save(args.out, emb)
    print(json.dumps({"out": args.out, "dim": int(emb.shape[-1]), **info}))


def cmd_synthesize(args: argparse.Namespace) -> None:
    import soundfile as sf

    from engine.offline import synthesize

    device = _device(args.device)
    src = _weights(args)
    model = load_model(src, device)
    codec = load_codec(src, device)
    speaker = None
    if args.voice:
        from engine.frontend.audio import decode_audio

        wav, sr = decode_audio(Path(args.voice).read_bytes())
        speaker = load_speaker_encoder(src, device).embed(wav, sr).to(device)
    elif args.speaker_embedding:
        speaker = _read_embedding(args.speaker_embedding, model.cfg.speaker_embedding_dim).to(device)
    emotion = None
    if args.emotion or args.valence or args.arousal:
        if speaker is None:
            raise ValueError("--emotion needs a voice (--voice or --speaker-embedding): it moves the speaker vector")
        emb, delta = _emotion(args, speaker.float().cpu().numpy())
        if delta is not None:  # 'proj' directions (the reference's shipped folder): the projected speaker row moves
            if delta.shape != (model.cfg.dim,):
                raise ValueError(
                    f"the emotion directions are {delta.shape[0]}-dimensional; this model's projected "
                    f"speaker row has {model.cfg.dim} values"
                )
            emotion = torch.from_numpy(delta).to(device)
        speaker = torch.from_numpy(emb).to(device)
    text = args.text
    if args.language:
        from engine.frontend.textnorm import TextNormalizer

        text = TextNormalizer().normalize(text, args.language)
    params = SamplingParams(seed=args.seed)
    result = synthesize(model, codec, text, params, speaker=speaker, max_frames=args.max_frames, emotion=emotion)
    sf.write(args.output, result.audio, SAMPLE_RATE, subtype="PCM_16")
    print(
        json.dumps(
            {
                "out": args.output,
                "seconds": round(len(result.audio) / SAMPLE_RATE, 3),
                "frames": len(result.frames),
                "finish_reason": result.finish_reason,
                "weights": src.describe(),
            }
        )
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def weights_args(sp: argparse.ArgumentParser, model: bool = True, dac: bool = False, spk: bool = False) -> None:
        names = ("model_path",) * model + ("dac_weights",) * dac + ("speaker_weights",) * spk
        add_flags(sp, WeightSources, only=names)  # the gateway's flags of the same names
        sp.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")

    sp = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the release format")
    sp.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--format", choices=["pth", "safetensors"], default="pth")
    sp.add_argument("--device", help="where to generate the random tensors (cuda is much faster for full)")
    sp.set_defaults(func=cmd_make_checkpoint)

    sp = sub.add_parser("prompt", help="write the prompt ids [P, 10] of a text")
    sp.add_argument("text")
    sp.add_argument("--out", required=True)
    sp.add_argument("--model-path", help="take the conditioning layout from this checkpoint's params.json")
    sp.add_argument("--speaker", action="store_true", help="include the speaker slot and markers")
    sp.add_argument("--clean-background", action="store_true")
    sp.add_argument("--expressive", action="store_true", help="omit the accurate-mode marker")
    sp.add_argument("--speaking-rate-bucket", type=int)
    sp.add_argument("--quality-buckets", default='{"trailing_silence_s": 3}')
    sp.add_argument("--no-quality", action="store_true")
    sp.add_argument("--language", help="normalize the text first (en_us, de, ...)")
    sp.add_argument("--context-text", help="continuation: the transcript of --context-codes")
    sp.add_argument(
        "--context-codes",
        help="continuation: .npy [frames, 9] int, the context chunks' generated (delayed) frames, already trimmed",
    )
    sp.add_argument(
        "--non-final", action="store_true", help="a chunk more chunks follow: no trailing-silence conditioning"
    )
    sp.set_defaults(func=cmd_prompt)

    sp = sub.add_parser("logits", help="teacher-forced logits [T, 9, 1026] of a frame sequence")
    weights_args(sp)
    sp.add_argument("--input-ids", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--speaker-embedding")
    sp.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    sp.add_argument(
        "--cfg-scale",
        type=float,
        help="speaker CFG: write the guided logits [9, V] of the last frame (needs --speaker-embedding)",
    )
    sp.add_argument("--uncond-input-ids", help="prefix CFG: the unconditional twin's prompt ids (.npy)")
    sp.add_argument(
        "--prefix-cfg-scale",
        type=float,
        help="prefix CFG: write the guided logits [9, V] of the last frame (needs --uncond-input-ids)",
    )
    sp.set_defaults(func=cmd_logits)

    def emotion_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--emotion", action="append", metavar="NAME=WEIGHT", help="emotion slider (repeatable), e.g. happy=1.0"
        )
        sp.add_argument("--valence", type=float, default=0.0)
        sp.add_argument("--arousal", type=float, default=0.0)
        sp.add_argument("--emotion-strength", type=float, default=1.0)
        sp.add_argument("--emotion-directions-dir", help="folder in the reference's emotion_directions/ format")
        sp.add_argument("--speaker-key", help="the speaker's key in calibration.json (default: its defaults)")

    sp = sub.add_parser("speaker-embed", help="embed a reference clip with the speaker encoder")
    weights_args(sp, model=False, spk=True)
    src = sp.add_mutually_exclusive_group(required=True)
    src.add_argument("--audio", help="the clip to embed")
    src.add_argument("--speaker-embedding", help=".npy embedding to apply --emotion to")
    sp.add_argument("--out", required=True)
    sp.add_argument("--out-delta", help="'proj' emotion directions: where to write the projected-row delta")
    emotion_args(sp)
    sp.add_argument(
        "--dtype",
        choices=list(_DTYPES),
        default="float32",
        help="dtype the ECAPA network runs in (the log-mel frontend and the output stay float32)",
    )
    sp.set_defaults(func=cmd_speaker_embed)

    sp = sub.add_parser("synthesize", help="text to a 44.1 kHz WAV")
    weights_args(sp, dac=True, spk=True)
    sp.add_argument("text")
    sp.add_argument("-o", "--output", required=True)
    sp.add_argument("--voice", help="reference clip to clone")
    sp.add_argument("--speaker-embedding", help=".npy speaker embedding")
    sp.add_argument("--seed", type=int)
    sp.add_argument("--max-frames", type=int, default=MAX_FRAMES)
    sp.add_argument("--language", help="normalize the text first (en_us, de, ...)")
    emotion_args(sp)
    sp.set_defaults(func=cmd_synthesize)
    return p


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as e:  # bad input or weights (SpeakerCheckpointError, AudioDecodeError), bad path
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
