"""Prompts used by the Omni oracle tests: text only, with an audio clip, with an image."""

from __future__ import annotations

import io
import base64

import numpy as np


def audio_clip(seconds: float = 1.0, sr: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def image(w: int = 80, h: int = 64):
    import PIL.Image

    rng = np.random.default_rng(1)
    return PIL.Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))


def wav_b64(samples: np.ndarray, sr: int = 16000) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def template_messages(kind: str) -> tuple[list[dict], list, list]:
    """(messages for the chat template, audios, images) for a case."""
    if kind == "text":
        return [{"role": "user", "content": [{"type": "text", "text": "hello world cat"}]}], [], []
    if kind == "audio":
        return ([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what is this"}]}],
                [audio_clip()], [])
    if kind == "image":
        return ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}],
                [], [image()])
    raise ValueError(kind)


CASES = ("text", "audio", "image")


# -- video ---------------------------------------------------------------------------------------------------
VIDEO_CASES = ("video", "video_audio")  # a video part, heard without / with its audio track (use_audio_in_video)
ALL_CASES = CASES + VIDEO_CASES
VIDEO_FPS, VIDEO_SECONDS, VIDEO_SIZE = 10, 2.0, (64, 48)


def video_bytes(seconds: float = VIDEO_SECONDS, fps: int = VIDEO_FPS, size: tuple[int, int] = VIDEO_SIZE,
                audio: bool = True, container: str = "mov", vcodec: str = "mpeg4", acodec: str = "pcm_s16le",
                seed: int = 2) -> bytes:
    """An encoded test video (moving noise) with, if ``audio``, ``audio_clip(seconds)`` as its sound track; the
    default PCM track decodes to exactly the clip (quantised to int16)."""
    import av

    w, h = size
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        v = out.add_stream(vcodec, rate=fps)
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        a = out.add_stream(acodec, rate=16000, layout="mono") if audio else None
        for _ in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            for packet in v.encode(frame):
                out.mux(packet)
        for packet in v.encode():
            out.mux(packet)
        if a is not None:
            fmt = "s16" if acodec == "pcm_s16le" else "fltp"
            pcm = audio_clip(seconds)
            pcm = (pcm * 32768).astype(np.int16) if fmt == "s16" else pcm
            step = a.codec_context.frame_size or 1024
            for start in range(0, pcm.size, step):
                frame = av.AudioFrame.from_ndarray(pcm[None, start:start + step], format=fmt, layout="mono")
                frame.sample_rate, frame.pts = 16000, start
                for packet in a.encode(frame):
                    out.mux(packet)
            for packet in a.encode():
                out.mux(packet)
    return buf.getvalue()


def video_data_url(raw: bytes, mime: str = "video/quicktime") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def video_track(seconds: float = VIDEO_SECONDS) -> np.ndarray:
    """What the default test video's sound track decodes to: ``audio_clip`` quantised to int16."""
    return (audio_clip(seconds) * 32768).astype(np.int16).astype(np.float32) / 32768


def _messages(kind: str) -> list[dict]:
    if kind in CASES:
        return template_messages(kind)[0]
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]


def serve_inputs(proc, kind: str, prefix: tuple = ()):
    """The model inputs the server builds for a case (``OmniInputProcessor``; a video decoded as the frontend
    decodes it: ``omni_serve.api.video`` with the processor's frame sampling)."""
    from omni_serve.api.video import VideoLimits, decode_video

    if kind in CASES:
        messages, audios, images = template_messages(kind)
        return proc([*prefix, *messages], audios, images)
    hear = kind == "video_audio"
    video = decode_video(video_bytes(), limits=VideoLimits(), sample=proc.sample_frames, param="video",
                         audio_rate=proc.sampling_rate if hear else None)
    return proc([*prefix, *_messages(kind)], videos=[video], use_audio_in_video=hear)


def reference_inputs(checkpoint: str, kind: str, prefix: tuple = (), fps: float = 2.0):
    """The same case through transformers' own processor (``AutoProcessor``, default call): it decodes the video
    file itself (transformers' PyAV reader) and samples its frames at ``fps``; the sound track is given as
    decoded (transformers reads it only with torchcodec)."""
    import tempfile

    from transformers import AutoProcessor
    from transformers.video_utils import load_video

    from omni_serve.models.qwen2_5_omni_inputs import OmniInputs

    proc = AutoProcessor.from_pretrained(checkpoint)
    messages = [*prefix, *_messages(kind)]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if kind in CASES:
        _, audios, images = template_messages(kind)
        batch = proc(text=[text], audio=audios or None, images=images or None, return_tensors="pt")
        return OmniInputs.from_batch(batch)
    with tempfile.NamedTemporaryFile(suffix=".mov") as f:
        f.write(video_bytes())
        f.flush()
        frames, meta = load_video(f.name, backend="pyav")
    hear = kind == "video_audio"
    extra = {"audio": [video_track()], "load_audio_from_video": True, "audio_from_video_indices": [0]} if hear else {}
    batch = proc(text=[text], videos=[frames], video_metadata=[meta],
                 videos_kwargs={"do_sample_frames": True, "fps": fps}, return_tensors="pt", **extra)
    return OmniInputs.from_batch(batch, use_audio_in_video=hear)


# -- the same cases as OpenAI requests ------------------------------------------------------------------------
def http_content(kind: str) -> list[dict]:
    """The user turn of a case as OpenAI content parts (media as data URLs; the same prompt text)."""
    text = {"type": "text", "text": _messages(kind)[0]["content"][-1]["text"]}
    if kind == "audio":
        return [{"type": "input_audio", "input_audio": {"data": wav_b64(audio_clip()), "format": "wav"}}, text]
    if kind == "image":
        return [{"type": "image_url", "image_url": {"url": png_data_url(image())}}, text]
    if kind in VIDEO_CASES:
        return [{"type": "video_url", "video_url": {"url": video_data_url(video_bytes())}}, text]
    return [text]


def http_extras(kind: str) -> dict:
    """Request fields a case needs besides its messages (whether a video is heard with its sound track)."""
    if kind in VIDEO_CASES:
        return {"mm_processor_kwargs": {"use_audio_in_video": kind == "video_audio"}}
    return {}
