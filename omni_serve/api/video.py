"""Decoding of request videos (``video_url`` content parts: ``data:video/...;base64,`` URLs) with PyAV.

Contract:

* ``video_url_bytes(url, max_bytes, param)`` returns the encoded video of a data URL; remote URLs, other media
  types and bad base64 are a 400 (``OpenAIError`` naming ``param``), as for images.
* ``decode_videos([(raw, param), ...], limits, sample, audio_rate)`` decodes all of one request's videos. First
  every container is opened and its header read: the video stream's frame count and rate, its duration and its
  frame size are checked against ``VideoLimits`` per video, and then against the request's budgets across all
  videos (``max_request_decoded_pixels``: every frame up to the last sampled one is decoded; and
  ``max_request_sampled_pixels``: the kept frames' memory) before any frame is decoded. ``sample(header) -> frame
  indices`` picks the frames to keep (the frontend passes transformers' own ``sample_frames`` of the checkpoint's
  video processor, so the frames are those the reference processor samples); frames are decoded in order and
  only the sampled ones are kept, as transformers' PyAV reader (``read_video_pyav``) does, from the same header
  fields. While decoding, each frame is charged at its real size: a frame larger than its header said (a stream
  that changes resolution, a lying header) is a 400 at once, and so is going over a budget. With
  ``audio_rate`` set, the audio track (if any) is decoded to mono float32 at that rate (for Qwen-Omni's
  ``use_audio_in_video``).
* FFmpeg opens a request's bytes only with a container allowlist (``VIDEO_CONTAINERS``, ``AUDIO_CONTAINERS``:
  no playlist, concat or image-sequence demuxer) and an empty protocol whitelist, so no demuxer can make it open
  a URL or a file (an HLS playlist pointing at ``http://`` or ``file:`` is refused, nothing is fetched).
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

__all__ = ["VideoLimits", "DecodedVideo", "VideoHeader", "video_url_bytes", "decode_videos", "decode_video"]

# Demuxers a request's bytes may be opened with (FFmpeg's format_whitelist; a demuxer matches when one of its
# names is listed). Probing picks among these only: no hls/dash playlists, concat, image2 sequences or tee.
VIDEO_CONTAINERS = "mov,mp4,matroska,webm,avi"
AUDIO_CONTAINERS = "wav,mp3,flac,ogg,aac,mov,mp4,m4a,matroska,webm"
# No protocol at all: PyAV hands FFmpeg the bytes through its own I/O context, so only a demuxer that opens a
# URL of its own would use one, and it must not. (An empty whitelist is "none allowed" to FFmpeg.)
NO_PROTOCOLS = {"protocol_whitelist": ""}


class VideoLimits(BaseModel):
    """Bounds on one input video, checked from its container header before decoding."""

    max_seconds: float = Field(60.0, gt=0, description="Longest input video accepted (seconds, from the header).")
    max_frame_pixels: int = Field(1920 * 1080, gt=0, description="Largest frame accepted (width x height).")
    max_source_frames: int = Field(3600, gt=0, description=(
        "Most frames a video may have in all (every frame is decoded to reach the sampled ones)."))
    max_sampled_frames: int = Field(256, gt=0, description="Most frames sampled from one video for the model.")
    max_request_decoded_pixels: int = Field(3600 * 1920 * 1080, gt=0, description=(
        "Most pixels decoded for all of one request's videos together (every frame up to the last sampled one "
        "is decoded): checked from the headers before decoding, and frame by frame while decoding. The default "
        "is one video at max_source_frames and max_frame_pixels."))
    max_request_sampled_pixels: int = Field(256 * 1920 * 1080, gt=0, description=(
        "Most pixels of the sampled (kept) frames of all of one request's videos together, 3 bytes each in "
        "memory. The default is one video at max_sampled_frames and max_frame_pixels."))


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


def open_container(raw: bytes, containers: str, param: str, what: str = "video"):
    """An input container over ``raw``, probed among ``containers`` only, with no protocol allowed."""
    import av

    try:
        return av.open(io.BytesIO(raw), mode="r", options={"format_whitelist": containers, **NO_PROTOCOLS})
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise bad_request(f"{param}: could not decode the {what}, which must be in a container of {containers}: "
                          f"{_detail(exc)}", param=param) from None


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


class _Budget:
    """What the request's videos have left to decode and keep, in pixels; charged frame by frame."""

    def __init__(self, limits: VideoLimits):
        self.decoded = self.sampled = 0
        self.limits = limits

    def charge(self, decoded: int, sampled: int, param: str) -> None:
        self.decoded += decoded
        self.sampled += sampled
        if self.decoded > self.limits.max_request_decoded_pixels:
            raise bad_request(f"{param}: the request's videos need {self.decoded} or more decoded pixels; at most "
                              f"{self.limits.max_request_decoded_pixels} are decoded for one request "
                              "(video.max_request_decoded_pixels)", param=param)
        if self.sampled > self.limits.max_request_sampled_pixels:
            raise bad_request(f"{param}: the request's videos would keep {self.sampled} or more pixels of sampled "
                              f"frames; at most {self.limits.max_request_sampled_pixels} are kept for one request "
                              "(video.max_request_sampled_pixels)", param=param)


def decode_videos(items: list[tuple[bytes, str]], *, limits: VideoLimits, sample: Callable[[VideoHeader], list[int]],
                  audio_rate: int | None = None) -> list[DecodedVideo]:
    """Decode a request's videos ((encoded bytes, param) each): every header and the request's budgets checked
    before any frame is decoded, then each frame charged as it is decoded; see the module doc."""
    import av

    containers, plans = [], []
    param = items[0][1] if items else "video"
    try:
        planned = _Budget(limits)
        for raw, param in items:  # headers only: the whole request is judged before any decoding
            containers.append(open_container(raw, VIDEO_CONTAINERS, param))
            header = read_header(containers[-1], limits, param)
            indices = _sampled(header, sample, limits, param)
            planned.charge((indices[-1] + 1) * header.width * header.height,
                           len(indices) * header.width * header.height, param)
            plans.append((containers[-1], header, indices, param))
        spent = _Budget(limits)
        decoded = []
        for container, header, indices, param in plans:
            decoded.append(_decode(container, header, indices, param, spent, limits, audio_rate))
        return decoded
    except OpenAIError:
        raise
    except (av.FFmpegError, ValueError, OSError, RuntimeError) as exc:
        raise bad_request(f"{param}: could not decode the video: {_detail(exc)}", param=param) from None
    finally:
        for container in containers:
            container.close()


def decode_video(raw: bytes, *, limits: VideoLimits, sample: Callable[[VideoHeader], list[int]], param: str,
                 audio_rate: int | None = None) -> DecodedVideo:
    """One video, as ``decode_videos`` decodes a request's."""
    return decode_videos([(raw, param)], limits=limits, sample=sample, audio_rate=audio_rate)[0]


def _sampled(header: VideoHeader, sample: Callable[[VideoHeader], list[int]], limits: VideoLimits,
             param: str) -> list[int]:
    indices = sorted({int(i) for i in sample(header)})
    if not indices or indices[0] < 0 or indices[-1] >= header.total_num_frames:
        raise bad_request(f"{param}: no frames could be sampled from the video", param=param)
    if len(indices) > limits.max_sampled_frames:
        raise bad_request(f"{param}: the video would be sampled to {len(indices)} frames; at most "
                          f"{limits.max_sampled_frames} are accepted", param=param)
    return indices


def _decode(container, header: VideoHeader, indices: list[int], param: str, budget: _Budget, limits: VideoLimits,
            audio_rate: int | None) -> DecodedVideo:
    frames = _frames(container, header, indices, param, budget)
    audio = None
    if audio_rate is not None and header.has_audio:
        container.seek(0)
        audio = _audio_track(container, audio_rate, limits.max_seconds, param)
    return DecodedVideo(frames=frames, header=header, audio=audio)


def _frames(container, header: VideoHeader, indices: list[int], param: str, budget: _Budget) -> np.ndarray:
    wanted, last, kept = set(indices), indices[-1], []
    declared = header.width * header.height
    for i, frame in enumerate(container.decode(video=0)):
        if i > last:
            break
        pixels = frame.width * frame.height
        if pixels > declared:
            raise bad_request(f"{param}: frame {i} is {frame.width}x{frame.height}, larger than the "
                              f"{header.width}x{header.height} the video's header declares", param=param)
        keep = i in wanted
        budget.charge(pixels, pixels if keep else 0, param)
        if keep:
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
        with open_container(raw, AUDIO_CONTAINERS, param, what="audio") as container:
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
