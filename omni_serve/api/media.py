"""Decoding of request media and encoding of response audio.

Contract:

* Every decoder validates untrusted client input and raises
  :class:`omni_serve.api.errors.OpenAIError` (400, ``invalid_request_error``)
  with ``param`` set to the caller-supplied field path and a message that names
  the problem. No other exception escapes a decoder for bad input.
* Audio comes back as mono ``float32`` in ``[-1, 1]`` (nominally) at the
  requested sample rate; images come back as fully loaded RGB ``PIL.Image``.
* Only inline ``data:`` image and video URLs are accepted; nothing is fetched remotely.
* Limits are checked from headers before anything is decoded: an audio file's
  sample rate, channels and length; an image's pixel count (``probe_image``, so
  a caller can also bound the pixels of all of a request's images); images
  open only in the formats the caller allows (``IMAGE_FORMATS`` by default).
* Decoding is CPU work: callers on an event loop run decoders in a thread.
* Encoders take float samples, clip to ``[-1, 1]`` and write 16-bit PCM.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import re
import struct
import warnings
from collections.abc import Sequence

import numpy as np
import soundfile as sf
from PIL import Image, UnidentifiedImageError

from omni_serve.api.errors import OpenAIError, bad_request

__all__ = [
    "PCM16_SAMPLE_RATE",
    "decode_base64",
    "decode_input_audio",
    "decode_audio_bytes",
    "audio_max_bytes",
    "read_upload",
    "decode_image_url",
    "decode_image_bytes",
    "image_url_bytes",
    "data_url_bytes",
    "probe_image",
    "IMAGE_FORMATS",
    "encode_wav",
    "encode_pcm16",
    "encode_audio",
]

PCM16_SAMPLE_RATE = 24_000
"""Sample rate assumed for raw ``pcm16`` input (OpenAI's convention)."""

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The image formats the API documents (PIL opens no other unless a caller allows it)."""

# Upper bound on encoded audio bytes per second of allowed duration (96 kHz,
# stereo, float32), plus slack for headers; guards memory before decoding.
_AUDIO_BYTES_PER_SECOND = 96_000 * 2 * 4
_AUDIO_HEADER_SLACK = 1 << 16

_WHITESPACE = re.compile(r"\s+")


def _human_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} bytes"


def decode_base64(data: str, *, param: str, max_bytes: int) -> bytes:
    """Strictly decode base64 (optionally behind a ``data:...;base64,`` prefix).

    Whitespace (line wrapping) is ignored; any other non-alphabet character,
    bad padding, an empty payload or more than ``max_bytes`` decoded bytes is a 400.
    """
    if not isinstance(data, str):
        raise bad_request(f"{param} must be a base64 string", param=param)
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(
                f"{param} is a data URL without ';base64,' encoding; only base64 data URLs are supported",
                param=param,
            )
    data = _WHITESPACE.sub("", data)
    if not data:
        raise bad_request(f"{param} is empty", param=param)
    # Cheap size bound before decoding: every 4 chars yield at most 3 bytes.
    if (len(data) // 4) * 3 > max_bytes + 3:
        raise bad_request(
            f"{param} is too large (about {_human_bytes(len(data) * 3 // 4)}; limit {_human_bytes(max_bytes)})",
            param=param,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param} is not valid base64: {exc}", param=param) from None
    if len(raw) > max_bytes:
        raise bad_request(
            f"{param} is too large ({_human_bytes(len(raw))}; limit {_human_bytes(max_bytes)})",
            param=param,
        )
    return raw


def _read_pcm16(raw: bytes, param: str) -> tuple[np.ndarray, int]:
    if len(raw) % 2:
        raise bad_request(
            f"{param}: pcm16 audio must have an even number of bytes (got {len(raw)})", param=param
        )
    samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return samples, PCM16_SAMPLE_RATE


def _too_long(param: str, seconds: float | None, max_seconds: float) -> OpenAIError:
    got = f"{seconds:.1f} s" if seconds is not None else f"more than {max_seconds:g} s"
    return bad_request(f"{param}: audio is too long ({got}; limit {max_seconds:g} s)", param=param)


class _Unreadable(OpenAIError):
    """A 400: soundfile cannot read the bytes (another reader may)."""

    def __init__(self, message: str, param: str):
        super().__init__(message, status_code=400, type="invalid_request_error", param=param)


def _read_container(raw: bytes, fmt: str, max_seconds: float, param: str, max_sample_rate: int,
                    max_channels: int) -> tuple[np.ndarray, int]:
    try:
        with sf.SoundFile(io.BytesIO(raw)) as f:
            sample_rate = int(f.samplerate)
            if sample_rate <= 0:
                raise bad_request(f"{param}: audio has an invalid sample rate", param=param)
            if sample_rate > max_sample_rate:
                raise bad_request(f"{param}: audio sample rate {sample_rate} Hz is above the limit of "
                                  f"{max_sample_rate} Hz", param=param)
            if f.channels > max_channels:
                raise bad_request(f"{param}: audio has {f.channels} channels; at most {max_channels} are "
                                  "accepted", param=param)
            declared = f.frames / sample_rate if 0 < f.frames < 2**62 else None
            if declared is not None and declared > max_seconds:
                raise _too_long(param, declared, max_seconds)
            # Read at most one frame past the limit so compressed "bombs" stay cheap.
            limit = int(math.floor(max_seconds * sample_rate)) + 1
            data = f.read(frames=limit, dtype="float32", always_2d=True)
    except OpenAIError:
        raise
    except (sf.SoundFileError, RuntimeError, ValueError, TypeError, EOFError) as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise _Unreadable(f"{param}: could not decode audio as {fmt}: {detail}", param=param) from None
    return data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0], sample_rate


def decode_input_audio(
    data_b64: str, fmt: str, *, target_sr: int, max_seconds: float, param: str,
    max_sample_rate: int = 48_000, max_channels: int = 2,
) -> np.ndarray:
    """Decode base64 audio to mono float32 at ``target_sr``.

    ``fmt`` is one of ``wav``/``mp3``/``flac``/``ogg`` (container detected by
    soundfile from the bytes) or ``pcm16`` (raw little-endian int16 mono, 24 kHz).
    Empty, undecodable, non-finite or longer-than-``max_seconds`` audio is a 400,
    and so is a header declaring more than ``max_sample_rate`` or ``max_channels``
    (checked before any sample is decoded).
    """
    if fmt not in ("wav", "mp3", "flac", "ogg", "pcm16"):
        raise bad_request(f"{param}: unsupported audio format {fmt!r}", param=param)
    if fmt == "pcm16":
        max_bytes = int(max_seconds * PCM16_SAMPLE_RATE) * 2 * 2  # 2x: just too long is "too long", not "too large"
    else:
        max_bytes = audio_max_bytes(max_seconds)
    raw = decode_base64(data_b64, param=param, max_bytes=max_bytes)
    return decode_audio_bytes(raw, fmt, target_sr=target_sr, max_seconds=max_seconds, param=param,
                              max_sample_rate=max_sample_rate, max_channels=max_channels)


def audio_max_bytes(max_seconds: float) -> int:
    """The most encoded bytes an audio file of ``max_seconds`` may take (checked before decoding)."""
    return int(max_seconds * _AUDIO_BYTES_PER_SECOND) + _AUDIO_HEADER_SLACK


def decode_audio_bytes(
    raw: bytes, fmt: str, *, target_sr: int, max_seconds: float, param: str,
    max_sample_rate: int = 48_000, max_channels: int = 2, other_reader=None,
) -> np.ndarray:
    """``decode_input_audio`` of bytes already decoded from base64 (or uploaded): ``fmt`` ``pcm16`` is raw int16,
    anything else a container soundfile recognises from the bytes (wav, mp3, flac, ogg). ``other_reader(raw)``, if
    given, reads what soundfile cannot (-> (mono samples, sample rate), with its own header checks); the checks
    below apply to what it returns too."""

    if fmt == "pcm16":
        samples, sample_rate = _read_pcm16(raw, param)
    else:
        try:
            samples, sample_rate = _read_container(raw, fmt, max_seconds, param, max_sample_rate, max_channels)
        except _Unreadable:
            if other_reader is None:
                raise
            samples, sample_rate = other_reader(raw)

    if samples.size == 0:
        raise bad_request(f"{param}: audio contains no samples", param=param)
    if samples.size / sample_rate > max_seconds:
        raise _too_long(param, samples.size / sample_rate if fmt == "pcm16" else None, max_seconds)
    if not np.all(np.isfinite(samples)):
        raise bad_request(f"{param}: audio contains non-finite samples", param=param)

    if sample_rate != target_sr:
        # imported here: scipy.signal costs ~0.8 s of start-up in every process that imports this module (each
        # stage replica imports it through its spec), and only audio at another rate needs it
        from scipy.signal import resample_poly

        g = math.gcd(int(target_sr), sample_rate)
        samples = resample_poly(samples, int(target_sr) // g, sample_rate // g)
    return np.ascontiguousarray(samples, dtype=np.float32)


_EXAMPLE_MIME = {"image": "image/png", "video": "video/mp4"}
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)


def decode_image_url(url: str, *, max_pixels: int, max_bytes: int, param: str,
                     formats: Sequence[str] = IMAGE_FORMATS) -> Image.Image:
    """Decode a ``data:image/...;base64,`` URL to a loaded RGB image.

    Remote (http/https) URLs, non-image media types, undecodable bytes, formats
    not in ``formats`` and images with more than ``max_pixels`` pixels are a 400.
    """
    raw = image_url_bytes(url, max_bytes=max_bytes, param=param)
    return decode_image_bytes(raw, max_pixels=max_pixels, param=param, formats=formats)


def image_url_bytes(url: str, *, max_bytes: int, param: str) -> bytes:
    """The encoded image of a ``data:image/...;base64,`` URL (not decoded: see ``probe_image``)."""
    return data_url_bytes(url, "image", max_bytes=max_bytes, param=param)


def data_url_bytes(url: str, kind: str, *, max_bytes: int, param: str) -> bytes:
    """The payload of a ``data:<kind>/...;base64,`` URL (``kind``: ``image`` or ``video``); remote URLs, other
    media types and non-base64 data URLs are a 400."""
    if not isinstance(url, str):
        raise bad_request(f"{param} must be a string", param=param)
    lowered = url[:8].lower()
    if lowered.startswith(("http://", "https://")):
        raise bad_request(
            f"remote {kind} URLs are not supported; send a data URL (data:{_EXAMPLE_MIME[kind]};base64,...)",
            param=param,
        )
    match = _DATA_URL.match(url)
    if match is None:
        raise bad_request(
            f"{param} must be a data URL of the form data:{kind}/<type>;base64,<data>", param=param
        )
    mime = match.group("mime").lower()
    if not mime.startswith(f"{kind}/"):
        raise bad_request(f"{param}: data URL media type must be {kind}/*, got {mime or 'none'!r}", param=param)
    if ";base64" not in match.group("params").lower():
        raise bad_request(f"{param}: {kind} data URL must be base64-encoded (';base64,')", param=param)
    return decode_base64(url[match.end():], param=param, max_bytes=max_bytes)


def probe_image(raw: bytes, *, max_pixels: int, param: str, formats: Sequence[str] = IMAGE_FORMATS) -> tuple[int, int]:
    """(width, height) of an encoded image, read from its header and checked (format, ``max_pixels``) without
    decoding its pixels."""
    with _image_errors(param, max_pixels, formats):
        with Image.open(io.BytesIO(raw), formats=list(formats)) as probe:
            width, height = probe.size
            if width * height > max_pixels:
                raise bad_request(_too_many_pixels(param, width, height, max_pixels), param=param)
            probe.verify()
            return width, height


def decode_image_bytes(raw: bytes, *, max_pixels: int, param: str, mode: str = "RGB",
                       formats: Sequence[str] = IMAGE_FORMATS) -> Image.Image:
    """Decode an encoded image (one of ``formats``, e.g. an uploaded file) to a loaded image in ``mode``
    (``RGB``, or ``RGBA`` to keep transparency). The pixel count is checked before the pixels are decoded."""
    probe_image(raw, max_pixels=max_pixels, param=param, formats=formats)
    with _image_errors(param, max_pixels, formats):
        image = Image.open(io.BytesIO(raw), formats=list(formats))
        image.load()
        return image.convert(mode)


@contextlib.contextmanager
def _image_errors(param: str, max_pixels: int, formats: Sequence[str]):
    """PIL's failures as 400s naming ``param``."""
    try:
        with warnings.catch_warnings():
            # Our own max_pixels check replaces PIL's bomb warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except OpenAIError:
        raise
    except Image.DecompressionBombError:
        raise bad_request(f"{param}: image has too many pixels (limit {max_pixels})", param=param) from None
    except UnidentifiedImageError:
        raise bad_request(f"{param}: data is not an image in an accepted format ({', '.join(formats)})",
                          param=param) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise bad_request(f"{param}: could not decode image: {detail}", param=param) from None


def _too_many_pixels(param: str, width: int, height: int, max_pixels: int) -> str:
    return f"{param}: image is too large ({width}x{height} = {width * height} pixels; limit {max_pixels})"


def _as_float_audio(samples: np.ndarray) -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float32)
    arr = np.nan_to_num(arr, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(arr, -1.0, 1.0)


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV bytes; ``samples`` is (frames,) or (frames, channels) float."""
    buf = io.BytesIO()
    sf.write(buf, _as_float_audio(samples), int(sample_rate), format="WAV", subtype="PCM_16")
    return buf.getvalue()


def encode_pcm16(samples: np.ndarray) -> bytes:
    """Raw little-endian int16 bytes (no header); floats are clipped to ``[-1, 1]``."""
    scaled = np.round(_as_float_audio(samples) * 32767.0)
    return scaled.astype("<i2").tobytes()


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode as ``"wav"`` (with header) or ``"pcm16"`` (raw; rate is the caller's concern)."""
    if fmt == "wav":
        return encode_wav(samples, sample_rate)
    if fmt == "pcm16":
        return encode_pcm16(samples)
    raise bad_request(f"unsupported audio output format {fmt!r}; use 'wav' or 'pcm16'", param="audio.format")


async def read_upload(upload, max_bytes: int, param: str) -> bytes:
    """The bytes of an uploaded file (FastAPI's ``UploadFile``), at most ``max_bytes`` (a 400 beyond)."""
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise bad_request(f"{param} is too large (more than {max_bytes} bytes).", param=param)
    if not data:
        raise bad_request(f"{param} is empty.", param=param)
    return data
