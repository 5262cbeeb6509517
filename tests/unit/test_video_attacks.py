"""Hostile videos (no Ray): a playlist that points FFmpeg at a URL, a header that understates the frame size, and
many videos that each pass their own limits but not the request's budget."""

from __future__ import annotations

import io
import socket
import threading
import time
from fractions import Fraction

import av
import numpy as np
import pytest

from omni_serve.api import video
from omni_serve.api.errors import OpenAIError
from omni_serve.api.video import NO_PROTOCOLS, VideoLimits, decode_videos


def sample_all(header) -> list[int]:
    return list(range(header.total_num_frames))


def h264_packets(width: int, height: int, frames: int, rate: int = 10):
    """H.264 packets of ``frames`` flat frames, each keyframe carrying its own SPS/PPS (so a decoder follows a
    size change mid-stream)."""
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
    codec.time_base, codec.framerate = Fraction(1, rate), rate
    codec.options = {"preset": "ultrafast", "x264-params": "repeat-headers=1"}
    packets = []
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), i * 20 % 255, np.uint8), format="rgb24")
        frame.pts = i
        packets += codec.encode(frame)
    return packets + codec.encode(None)


def mp4(parts: list[tuple[int, int, int]], declared: tuple[int, int] | None = None) -> bytes:
    """An MP4 of the (width, height, frames) parts in a row; its header declares ``declared`` (default: the
    first part's size)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=10)
        stream.width, stream.height = declared or parts[0][:2]
        stream.pix_fmt = "yuv420p"
        n = 0
        for width, height, frames in parts:
            for packet in h264_packets(width, height, frames):
                packet.stream, packet.pts, packet.dts, packet.time_base = stream, n, n, Fraction(1, 10)
                out.mux(packet)
                n += 1
    return buf.getvalue()


class Listener:
    """A TCP listener on localhost that counts the connections it gets."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port, self.connections, self.stop = self.sock.getsockname()[1], 0, threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> int:
        time.sleep(0.3)  # a connection FFmpeg made is accepted by now
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return self.connections


def playlist(url: str) -> bytes:
    return (f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:10.0,\n{url}\n"
            "#EXT-X-ENDLIST\n").encode()


@pytest.mark.parametrize("scheme", ["http", "file", "tcp"])
def test_an_hls_playlist_is_refused_and_fetches_nothing(scheme, tmp_path):
    listener = Listener()
    secret = tmp_path / "secret.ts"
    secret.write_bytes(b"\x47" * 188 * 10)
    url = {"http": f"http://127.0.0.1:{listener.port}/seg0.ts", "file": f"file:{secret}",
           "tcp": f"tcp://127.0.0.1:{listener.port}"}[scheme]
    with pytest.raises(OpenAIError) as info:
        decode_videos([(playlist(url), "messages[0].content[0]")], limits=VideoLimits(), sample=sample_all)
    assert info.value.status_code == 400 and "container of mov,mp4,matroska,webm,avi" in info.value.message
    assert listener.close() == 0


def test_the_protocol_whitelist_stops_a_demuxer_that_would_open_a_url():
    """Defence in depth below the container allowlist: even the HLS demuxer itself, forced, opens no URL with the
    options every request's container gets (the control, without them, connects)."""
    for options, expected in (({}, 1), (NO_PROTOCOLS, 0)):
        listener = Listener()
        with pytest.raises(av.FFmpegError):
            av.open(io.BytesIO(playlist(f"http://127.0.0.1:{listener.port}/seg0.ts")), format="hls",
                    options=dict(options))
        assert (listener.close() > 0) == bool(expected), options


def test_a_header_that_understates_the_frame_size_is_refused_at_the_first_larger_frame():
    raw = mp4([(64, 64, 5), (320, 240, 5)])  # the header says 64x64 throughout
    with av.open(io.BytesIO(raw)) as c:
        assert (c.streams.video[0].codec_context.width, c.streams.video[0].codec_context.height) == (64, 64)
    with pytest.raises(OpenAIError) as info:
        decode_videos([(raw, "v")], limits=VideoLimits(), sample=sample_all)
    assert "frame 5 is 320x240, larger than the 64x64 the video's header declares" in info.value.message


def test_the_request_budget_counts_every_video_before_any_is_decoded(monkeypatch):
    one = mp4([(64, 64, 20)])
    per_video = 20 * 64 * 64
    decoded = []
    monkeypatch.setattr(video, "_decode", lambda *a, **kw: decoded.append(a[3]))
    limits = VideoLimits(max_request_decoded_pixels=3 * per_video)
    with pytest.raises(OpenAIError) as info:
        decode_videos([(one, f"video {i}") for i in range(16)], limits=limits, sample=sample_all)
    assert info.value.param == "video 3" and "video.max_request_decoded_pixels" in info.value.message
    assert decoded == []  # judged from the headers alone
    decode_videos([(one, f"video {i}") for i in range(3)], limits=limits, sample=sample_all)
    assert decoded == ["video 0", "video 1", "video 2"]


def test_the_sampled_frames_budget_bounds_what_is_kept():
    one = mp4([(64, 64, 20)])
    limits = VideoLimits(max_request_sampled_pixels=30 * 64 * 64)
    with pytest.raises(OpenAIError, match="video.max_request_sampled_pixels"):
        decode_videos([(one, "a"), (one, "b")], limits=limits, sample=sample_all)
    (a,) = decode_videos([(one, "a")], limits=limits, sample=sample_all)
    assert a.frames.shape == (20, 64, 64, 3)
