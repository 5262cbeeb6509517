"""Speech audio out: 24 kHz mono float samples in, the bytes of an audio file out, chunk by chunk.

Contract: ``SpeechEncoder(fmt, sample_rate, speed)`` turns successive sample chunks (``feed``) and the end
(``close``) into successive byte chunks whose concatenation is one complete file of format ``fmt``
(``SPEECH_FORMATS``: OpenAI's ``response_format`` values). Bytes are returned as soon as the codec emits them,
so a streamed reply starts before the speech is complete:
- ``pcm``: raw little-endian int16, no header;
- ``wav``: a RIFF header whose sizes are unknown while streaming (0xFFFFFFFF, as streaming servers write it;
  readers take the data up to the end of the file), then int16 samples; ``encode_whole`` writes exact sizes;
- ``mp3``, ``opus`` (in Ogg), ``aac`` (ADTS) and ``flac``: encoded with FFmpeg through PyAV, muxed to a
  non-seekable sink so nothing written is ever rewritten.
``speed`` (0.25-4.0) changes tempo without changing pitch (FFmpeg's ``atempo`` filter), before encoding.
Which formats this build can write is checked once (``writable_formats``); the others are a 400 upstream.
No torch here: the ingress imports it.
"""

from __future__ import annotations

import functools
import io
import struct
from typing import Iterable

import numpy as np

SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
# format -> (FFmpeg codec, FFmpeg muxer, sample format the codec takes)
_FFMPEG = {"mp3": ("libmp3lame", "mp3", "s16p"), "opus": ("libopus", "ogg", "s16"), "aac": ("aac", "adts", "fltp"),
           "flac": ("flac", "flac", "s16")}
MIN_SPEED, MAX_SPEED = 0.25, 4.0
_UNKNOWN = 0xFFFFFFFF


@functools.cache
def writable_formats() -> tuple[str, ...]:
    """The formats of ``SPEECH_FORMATS`` this installation can encode."""
    out = ["wav", "pcm"]
    try:
        import av
    except ImportError:
        return tuple(out)
    for fmt, (codec, _, _) in _FFMPEG.items():
        try:
            av.codec.Codec(codec, "w")
        except Exception:  # noqa: BLE001 - an FFmpeg build without this encoder
            continue
        out.append(fmt)
    return tuple(f for f in SPEECH_FORMATS if f in out)


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """A 44-byte PCM int16 mono WAV header (sizes 0xFFFFFFFF when ``num_samples`` is None)."""
    data = _UNKNOWN if num_samples is None else 2 * num_samples
    riff = _UNKNOWN if num_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                            2 * sample_rate, 2, 16)
            + b"data" + struct.pack("<I", data))


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(samples, dtype=np.float32), -1, 1) * 32767).astype("<i2")


class _Sink:
    """A write-only, non-seekable file for PyAV: muxers then never go back over bytes already sent."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class _SeekableSink(io.BytesIO):
    """A whole file in memory, handed out once it is closed."""

    def take(self) -> bytes:
        return self.getvalue() if self.closed_by_muxer else b""

    closed_by_muxer = False


class _Tempo:
    """FFmpeg's atempo (chained: one instance covers 0.5-2.0) over int16 mono chunks."""

    def __init__(self, speed: float, sample_rate: int):
        import av

        self.rate = sample_rate
        self.graph = av.filter.Graph()
        node = src = self.graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono")
        left = speed
        while left < 0.5 or left > 2.0:
            step = 0.5 if left < 0.5 else 2.0
            nxt = self.graph.add("atempo", str(step))
            node.link_to(nxt)
            node, left = nxt, left / step
        last = self.graph.add("atempo", f"{left:.6f}")
        node.link_to(last)
        sink = self.graph.add("abuffersink")
        last.link_to(sink)
        self.graph.configure()
        self.src, self.pts = src, 0

    def __call__(self, pcm: np.ndarray | None) -> np.ndarray:
        import av

        if pcm is None:
            self.graph.push(None)
        else:
            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.pts
            self.pts += pcm.size
            self.graph.push(frame)
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out).astype("<i2") if out else np.zeros(0, dtype="<i2")


class SpeechEncoder:
    """``streaming=False``: one whole file, returned by ``close`` (muxers may then seek back and fill in their
    headers: a FLAC's total sample count, a WAV's sizes)."""

    def __init__(self, fmt: str, sample_rate: int, speed: float = 1.0, streaming: bool = True):
        if fmt not in writable_formats():
            raise ValueError(f"cannot write {fmt!r} audio here (writable: {', '.join(writable_formats())})")
        self.fmt, self.rate = fmt, sample_rate
        self.tempo = _Tempo(speed, sample_rate) if speed != 1.0 else None
        self.started = False
        self.container = self.stream = None
        if fmt in _FFMPEG:
            import av

            codec, muxer, sample_format = _FFMPEG[fmt]
            self.sink = _Sink() if streaming else _SeekableSink()
            self.container = av.open(self.sink, mode="w", format=muxer)
            self.stream = self.container.add_stream(codec, rate=sample_rate, layout="mono")
            self.stream.format = sample_format
            # fixed-size codec frames (mp3 1152, aac 1024, opus 20 ms): a FIFO cuts the chunks to size
            self.fifo = av.AudioFifo()
            self.pts = 0

    def feed(self, samples: np.ndarray) -> bytes:
        """The bytes of the file that ``samples`` (float, [-1, 1]) complete."""
        pcm = to_pcm16(samples)
        if self.tempo is not None:
            pcm = self.tempo(pcm)
        return self._encode(pcm)

    def close(self) -> bytes:
        """The file's last bytes."""
        tail = self._encode(self.tempo(None)) if self.tempo is not None else b""
        if self.container is None:
            return tail + (b"" if self.started else self._header())
        for packet in self._packets(final=True):
            self.container.mux(packet)
        self.container.close()
        self.sink.closed_by_muxer = True
        return tail + self.sink.take()

    def _header(self) -> bytes:
        self.started = True
        return wav_header(self.rate, None) if self.fmt == "wav" else b""

    def _encode(self, pcm: np.ndarray) -> bytes:
        if self.container is None:
            head = b"" if self.started else self._header()
            return head + pcm.tobytes()
        if pcm.size:
            import av

            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self.rate
            frame.pts = None
            self.fifo.write(frame)
        for packet in self._packets(final=False):
            self.container.mux(packet)
        return self.sink.take()

    def _packets(self, final: bool) -> Iterable:
        ctx = self.stream.codec_context
        size = ctx.frame_size or 1024
        while self.fifo.samples >= size or (final and self.fifo.samples):
            frame = self.fifo.read(min(size, self.fifo.samples))
            frame.pts, self.pts = self.pts, self.pts + frame.samples
            yield from self.stream.encode(frame)
        if final:
            yield from self.stream.encode(None)


def encode_whole(samples: np.ndarray, sample_rate: int, fmt: str, speed: float = 1.0) -> bytes:
    """One complete file (a WAV with exact sizes)."""
    enc = SpeechEncoder(fmt, sample_rate, speed, streaming=False)
    if fmt == "wav":
        pcm = to_pcm16(samples)
        if enc.tempo is not None:
            pcm = np.concatenate([enc.tempo(pcm), enc.tempo(None)])
        return wav_header(sample_rate, pcm.size) + pcm.tobytes()
    return enc.feed(samples) + enc.close()
