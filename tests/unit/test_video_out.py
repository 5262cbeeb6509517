"""Generated videos encode to an MP4 that FFmpeg decodes back to the same frame count, size, rate and (H.264 being
lossy) nearly the same pixels; the stream is tagged BT.709 in tv range and its pixels were converted so; the thumbnail
is the first frame exactly; bad frames are a ValueError."""

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


def _blocks(count: int) -> np.ndarray:
    """Saturated colours (the colour bars' and some mixes) in 16 x 32 blocks, 128 x 64: where the YUV matrix shows."""
    colours = [[255, 255, 255], [255, 255, 0], [0, 255, 255], [0, 255, 0], [255, 0, 255], [255, 0, 0], [0, 0, 255],
               [0, 0, 0], [255, 128, 0], [128, 0, 255], [0, 128, 128], [230, 180, 150], [64, 64, 64],
               [190, 190, 190], [128, 255, 128], [40, 0, 90]]
    rows = np.asarray(colours, np.uint8).reshape(2, 8, 3).repeat(32, axis=0).repeat(16, axis=1)
    return np.repeat(rows[None], count, axis=0)


def _interiors(frames: np.ndarray) -> np.ndarray:
    """The blocks of ``_blocks`` without 4 pixels at their edges (4:2:0 chroma blurs colour edges)."""
    count = frames.shape[0]
    return frames.reshape(count, 2, 32, 8, 16, 3)[:, :, 4:-4, :, 4:-4]


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


def test_the_stream_is_tagged_bt709_tv_range_and_its_pixels_are_so():
    import av
    from av.video.reformatter import Colorspace

    frames = _blocks(4)
    data = encode_mp4(frames, fps=16)
    # the MP4's colr box: primaries, transfer and matrix 1 (BT.709), then the full-range flag off (tv range)
    assert b"colrnclx\x00\x01\x00\x01\x00\x01\x00" in data
    with av.open(io.BytesIO(data)) as container:
        codec = container.streams.video[0].codec_context
        assert (codec.color_primaries, codec.color_trc, codec.colorspace, codec.color_range) == (1, 1, 1, 1)
        decoded = list(container.decode(video=0))
    assert {(f.color_primaries, f.color_trc, f.colorspace, f.color_range) for f in decoded} == {(1, 1, 1, 1)}
    luma = np.stack([f.to_ndarray()[:64] for f in decoded]).astype(int)  # yuv420p: the Y plane's rows first
    assert np.abs(luma[:, 4:28, 4:12] - 235).max() <= 2 and np.abs(luma[:, 4:28, 116:124] - 16).max() <= 2
    got = np.stack([f.to_ndarray(format="rgb24") for f in decoded]).astype(int)  # as the tags say: BT.709
    error = np.abs(_interiors(got) - _interiors(frames))
    assert error.max() <= 6 and error.mean() < 1.5, (error.max(), error.mean())  # flat colours, crf 18
    as_601 = np.stack([f.to_ndarray(format="rgb24", src_colorspace=Colorspace.ITU601) for f in decoded]).astype(int)
    assert np.abs(_interiors(as_601) - _interiors(frames)).max() > 15  # the other matrix: the check can fail
