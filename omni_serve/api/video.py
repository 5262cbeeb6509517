"""Decoding of request videos (``video_url`` content parts: ``data:video/...;base64,`` URLs) with PyAV.

Contract:

* ``video_url_bytes(url, max_bytes, param)`` returns the encoded video of a data URL; remote URLs, other media
  types and bad base64 are a 400 (``OpenAIError`` naming ``param``), as for images.
* ``decode_video(raw, limits, sample, param, audio_rate)`` opens the container and reads its header first: the
  video stream's frame count and rate, its duration and its frame size are checked against ``VideoLimits``
  before any frame is decoded. ``sample(metadata) -> frame indices`` picks the frames to keep (the frontend
  passes transformers' own ``sample_frames`` of the checkpoint's video processor, so the frames are those the
  reference processor samples); frames are decoded in order and only the sampled ones are kept, as
  transformers' PyAV reader (``read_video_pyav``) does, from the same header fields. With ``audio_rate`` set, the
  audio track (if any) is decoded to mono float32 at that rate (for Qwen-Omni's ``use_audio_in_video``).
* Unreadable, empty or oversized videos are a 400 that says what is wrong; nothing else escapes for bad input.
* Decoding is CPU work: callers on an event loop run it in a thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, Field

from omni_serve.api.errors import OpenAIError, bad_request
from omni_serve.api.media import data_url_bytes

__all__ = ["VideoLimits", "DecodedVideo", "VideoHeader", "video_url_bytes", "decode_video"]


class VideoLimits(BaseModel):
    """Bounds on one input video, checked from its container header before decoding."""

    max_seconds: float = Field(60.0, gt=0, description="Longest input video accepted (seconds, from the header).")
    max_frame_pixels: int = Field(1920 * 1080, gt=0, description="Largest frame accepted (width x height).")
    max_source_frames: int = Field(3600, gt=0, description=(
        "Most frames a video may have in all (every frame is decoded to reach the sampled ones)."))
    max_sampled_frames: int = Field(256, gt=0, description="Most frames sampled from one video for the model.")


@dataclass
class VideoHeader:
    """What the container says of its video stream (the fields transformers' ``VideoMetadata`` takes)."""

    total_num_frames: int
    fps: float
    width: int
    height: int
    duration: float
    has_audio: bool


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB: the sampled frames, in order
    header: VideoHeader
    audio: np.ndarray | None = None  # mono float32 at the requested rate (None: no track or not asked for)


def video_url_bytes(url: str, *, max_bytes: int, param: str) -> bytes:
    """The encoded video of a ``data:video/...;base64,`` URL (not decoded)."""
    return data_url_bytes(url, "video", max_bytes=max_bytes, param=param)


def _open(raw: bytes, param: str):
    import av

    try:
        return av.open(io.BytesIO(raw), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise bad_request(f"{param}: could not read the video: {_detail(exc)}", param=param) from None


def _detail(exc: Exception) -> str:
    return str(exc).strip() or type(exc).__name__


def read_header(container, limits: VideoLimits, param: str) -> VideoHeader:
    """The video stream's header fields, checked against ``limits`` (nothing decoded)."""
    if not container.streams.video:
        raise bad_request(f"{param}: the file has no video stream", param=param)
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if fps <= 0 or width <= 0 or height <= 0:
        raise bad_request(f"{param}: the video stream has no frame rate or frame size", param=param)
    if width * height > limits.max_frame_pixels:
        raise bad_request(f"{param}: video frames are too large ({width}x{height} = {width * height} pixels; limit "
                          f"{limits.max_frame_pixels})", param=param)
    total = int(stream.frames or 0)
    if total <= 0:  # not in the header (e.g. WebM): count the packets, which decodes nothing
        total = 0
        for packet in container.demux(stream):
            total += packet.size > 0
            if total > limits.max_source_frames:
                break
        container.seek(0)
    if total <= 0:
        raise bad_request(f"{param}: the video has no frames", param=param)
    if total > limits.max_source_frames:
        raise bad_request(f"{param}: the video has too many frames ({total}; limit {limits.max_source_frames})",
                          param=param)
    # the longer of the frames' span and the container's duration (microseconds) bounds the work
    longest = max(total / fps, (container.duration or 0) / 1e6)
    if longest > limits.max_seconds:
        raise bad_request(f"{param}: the video is too long ({longest:.1f} s; limit {limits.max_seconds:g} s)",
                          param=param)
    return VideoHeader(total_num_frames=total, fps=fps, width=width, height=height, duration=total / fps,
                       has_audio=bool(container.streams.audio))


def decode_video(raw: bytes, *, limits: VideoLimits, sample: Callable[[VideoHeader], list[int]], param: str,
                 audio_rate: int | None = None) -> DecodedVideo:
    """Decode the sampled frames (and the audio track, at ``audio_rate``) of an encoded video; see the module doc."""
    import av

    try:
        with _open(raw, param) as container:
            header = read_header(container, limits, param)
            indices = sorted({int(i) for i in sample(header)})
            if not indices or indices[0] < 0 or indices[-1] >= header.total_num_frames:
                raise bad_request(f"{param}: no frames could be sampled from the video", param=param)
            if len(indices) > limits.max_sampled_frames:
                raise bad_request(f"{param}: the video would be sampled to {len(indices)} frames; at most "
                                  f"{limits.max_sampled_frames} are accepted", param=param)
            frames = _frames(container, indices, param)
            audio = None
            if audio_rate is not None and header.has_audio:
                container.seek(0)
                audio = _audio_track(container, audio_rate, limits.max_seconds, param)
    except OpenAIError:
        raise
    except (av.FFmpegError, ValueError, OSError, RuntimeError) as exc:
        raise bad_request(f"{param}: could not decode the video: {_detail(exc)}", param=param) from None
    return DecodedVideo(frames=frames, header=header, audio=audio)


def _frames(container, indices: list[int], param: str) -> np.ndarray:
    wanted, last, kept = set(indices), indices[-1], []
    for i, frame in enumerate(container.decode(video=0)):
        if i > last:
            break
        if i in wanted:
            kept.append(frame.to_ndarray(format="rgb24"))
    if len(kept) != len(indices):
        raise bad_request(f"{param}: the video has fewer decodable frames ({len(kept)} of the sampled "
                          f"{len(indices)}) than its header says", param=param)
    shapes = {f.shape for f in kept}
    if len(shapes) != 1:
        raise bad_request(f"{param}: the video's frame size changes mid-stream", param=param)
    return np.stack(kept)


def _audio_track(container, rate: int, max_seconds: float, param: str) -> np.ndarray | None:
    """The first audio track as mono float32 at ``rate`` (at most ``max_seconds``), or None if it is empty."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    limit = int(math.ceil(max_seconds * rate))
    chunks, n = [], 0
    for frame in container.decode(audio=0):
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray().reshape(-1))
            n += chunks[-1].size
        if n >= limit:
            break
    else:
        for out in resampler.resample(None):  # flush
            chunks.append(out.to_ndarray().reshape(-1))
    if not chunks:
        return None
    samples = np.concatenate(chunks)[:limit].astype(np.float32, copy=False)
    if samples.size == 0:
        return None
    if not np.all(np.isfinite(samples)):
        raise bad_request(f"{param}: the video's audio track contains non-finite samples", param=param)
    return samples


def read_audio_container(raw: bytes, *, rate: int, max_seconds: float, param: str, max_sample_rate: int,
                         max_channels: int) -> tuple[np.ndarray, int]:
    """(mono float32 samples at ``rate``, ``rate``) of the first audio track of any container FFmpeg reads (m4a,
    mp4, webm, ...: what soundfile cannot), its sample rate, channels and duration checked from the header first."""
    import av

    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.audio:
                raise bad_request(f"{param}: the file has no audio track", param=param)
            stream = container.streams.audio[0]
            if (stream.sample_rate or 0) > max_sample_rate:
                raise bad_request(f"{param}: audio sample rate {stream.sample_rate} Hz is above the limit of "
                                  f"{max_sample_rate} Hz", param=param)
            if (stream.channels or 0) > max_channels:
                raise bad_request(f"{param}: audio has {stream.channels} channels; at most {max_channels} are "
                                  "accepted", param=param)
            if container.duration is not None and container.duration / 1e6 > max_seconds:
                raise bad_request(f"{param}: audio is too long ({container.duration / 1e6:.1f} s; limit "
                                  f"{max_seconds:g} s)", param=param)
            # one sample past the limit: a longer file is caught as too long by the caller
            samples = _audio_track(container, rate, max_seconds + 1 / rate, param)
    except OpenAIError:
        raise
    except (av.FFmpegError, ValueError, OSError, RuntimeError) as exc:
        raise bad_request(f"{param}: could not decode audio (wav, mp3, flac, ogg, m4a, mp4, webm, ...): "
                          f"{str(exc).strip() or type(exc).__name__}", param=param) from None
    if samples is None:
        raise bad_request(f"{param}: audio contains no samples", param=param)
    return samples, rate
