"""Encoding of generated videos (the Videos API's ``content``) with PyAV, whose wheel bundles FFmpeg and libx264.

Contract:

* ``encode_mp4(frames, fps, crf)``: uint8 RGB frames [F, H, W, 3] to an MP4 file's bytes: H.264 (libx264) in
  yuv420p, the pixel format every player decodes, at constant quality ``crf`` (lower is closer to the frames;
  18 is visually lossless), ``fps`` frames per second, the index at the front (``+faststart``) so a player starts
  before the whole file came. yuv420p halves the chroma resolution, so the height and width must be even: odd ones
  are a ``ValueError`` (the video graphs' sizes are multiples of 16). The frames are taken as sRGB-like RGB and
  converted with the BT.709 matrix to limited (tv) range YUV, and the stream is tagged so (primaries, transfer and
  matrix BT.709, range tv: in the H.264 stream and the MP4's ``colr`` box), so that players decode the pixels as
  they were encoded instead of guessing (an untagged stream is read as BT.601 by some and BT.709 by others).
* ``thumbnail_png(frames)``: the first frame as a PNG (the ``thumbnail`` variant), lossless.
* Encoding is CPU work: callers on an event loop run it in a thread.
"""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np

__all__ = ["encode_mp4", "thumbnail_png", "MP4_MEDIA_TYPE"]

MP4_MEDIA_TYPE = "video/mp4"
# FFmpeg's AVColorPrimaries, AVColorTransferCharacteristic and AVColorSpace values of BT.709, and AVColorRange's
# limited (tv, "MPEG") range: what the codec context's colour fields take
BT709 = 1
TV_RANGE = 1


def _check(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not frames.shape[0]:
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got {frames.dtype} {frames.shape}")


def encode_mp4(frames: np.ndarray, fps: int, crf: int = 18) -> bytes:
    import av
    from av.video.reformatter import ColorRange, Colorspace

    _check(frames)
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"H.264 in yuv420p needs an even height and width, got {width}x{height}")
    if fps < 1:
        raise ValueError(f"fps must be at least 1, got {fps}")
    # +faststart moves the index to the front in a second pass over the written file: FFmpeg reopens it by name,
    # so the MP4 is written to a temporary file, not to memory
    with tempfile.TemporaryDirectory(prefix="omni_serve_mp4_") as tmp:
        path = os.path.join(tmp, "video.mp4")
        with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": str(crf), "preset": "veryfast"}
            codec = stream.codec_context
            codec.color_primaries = codec.color_trc = codec.colorspace = BT709
            codec.color_range = TV_RANGE
            for frame in frames:
                image = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                # converted here, with the matrix and range the stream is tagged with (the encoder's own conversion
                # would use swscale's default, BT.601)
                yuv = image.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709,
                                     dst_color_range=ColorRange.MPEG)
                container.mux(stream.encode(yuv))
            container.mux(stream.encode())  # flush the encoder's delayed frames
        with open(path, "rb") as f:
            return f.read()


def thumbnail_png(frames: np.ndarray) -> bytes:
    from PIL import Image

    _check(frames)
    out = io.BytesIO()
    Image.fromarray(frames[0]).save(out, format="PNG")
    return out.getvalue()
