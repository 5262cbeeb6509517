"""Generated videos encode to an MP4 that FFmpeg decodes back to the same frame count, size, rate and (H.264 being
lossy) nearly the same pixels; the thumbnail is the first frame exactly; bad frames are a ValueError."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni_serve.api.video_out import encode_mp4, thumbnail_png


def _frames(count: int, height: int, width: int) -> np.ndarray:
    """A smooth moving gradient (what a codec is for, unlike noise)."""
    t, y, x = np.meshgrid(np.arange(count), np.arange(height), np.arange(width), indexing="ij")
    rgb = np.stack([x * 255 / width, y * 255 / height, (t * 20 + x + y) % 256], axis=-1)
    return rgb.round().astype(np.uint8)


def _decode(data: bytes):
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        return frames, stream.codec_context.name, float(stream.average_rate), container.format.name


def test_an_mp4_decodes_back_to_the_frames():
    frames = _frames(9, 32, 48)
    got, codec, fps, fmt = _decode(encode_mp4(frames, fps=16))
    assert got.shape == frames.shape and codec == "h264" and fps == 16 and "mp4" in fmt
    error = np.abs(got.astype(int) - frames).mean()
    assert error < 3, error  # crf 18: a few levels at most on a smooth picture
    other = _frames(9, 32, 48)[::-1]  # the same frames reversed: the comparison can fail
    assert np.abs(got.astype(int) - other).mean() > 5 * max(error, 1)


def test_one_frame_and_the_thumbnail():
    frames = _frames(5, 16, 16)
    assert _decode(encode_mp4(frames[:1], fps=24))[0].shape == (1, 16, 16, 3)
    thumb = np.asarray(Image.open(io.BytesIO(thumbnail_png(frames))))
    assert np.array_equal(thumb, frames[0])


@pytest.mark.parametrize("frames, words", [
    (np.zeros((3, 15, 16, 3), np.uint8), "even height and width"),
    (np.zeros((3, 16, 16, 3), np.float32), "uint8"),
    (np.zeros((0, 16, 16, 3), np.uint8), "F >= 1"),
    (np.zeros((16, 16, 3), np.uint8), "uint8 \\[F, H, W, 3\\]"),
])
def test_bad_frames_are_a_value_error(frames, words):
    with pytest.raises(ValueError, match=words):
        encode_mp4(frames, fps=16)
