"""Unit tests for omni_serve.api.media: base64, audio and image codecs."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni_serve.api.errors import OpenAIError
from omni_serve.api.media import (
    PCM16_SAMPLE_RATE,
    decode_base64,
    decode_image_bytes,
    decode_image_url,
    decode_input_audio,
    encode_audio,
    encode_pcm16,
    encode_wav,
)

PARAM = "messages[0].content[1].input_audio.data"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def tone(seconds: float, sr: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def expect_400(exc_info: pytest.ExceptionInfo[OpenAIError], param: str, *words: str) -> None:
    err = exc_info.value
    assert err.status_code == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    for word in words:
        assert word in err.message, (word, err.message)


# ----------------------------------------------------------------------------- base64


def test_decode_base64_plain_and_data_url() -> None:
    raw = bytes(range(256))
    assert decode_base64(b64(raw), param="p", max_bytes=1000) == raw
    assert decode_base64("data:audio/wav;base64," + b64(raw), param="p", max_bytes=1000) == raw
    wrapped = "\n".join(b64(raw)[i : i + 76] for i in range(0, len(b64(raw)), 76))
    assert decode_base64(wrapped, param="p", max_bytes=1000) == raw


@pytest.mark.parametrize("bad", ["abc", "ab$d", "@@@@", "YWJj=ZGVm"])
def test_decode_base64_rejects_invalid(bad: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_base64(bad, param="x.data", max_bytes=1000)
    expect_400(info, "x.data", "not valid base64")


def test_decode_base64_rejects_empty_too_large_and_non_base64_data_url() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_base64("", param="p", max_bytes=10)
    expect_400(info, "p", "empty")
    with pytest.raises(OpenAIError) as info:
        decode_base64(b64(b"x" * 100), param="p", max_bytes=99)
    expect_400(info, "p", "too large")
    with pytest.raises(OpenAIError) as info:
        decode_base64(b64(b"x" * 10_000), param="p", max_bytes=10)  # rejected before decoding
    expect_400(info, "p", "too large")
    with pytest.raises(OpenAIError) as info:
        decode_base64("data:text/plain,hello", param="p", max_bytes=10)
    expect_400(info, "p", "base64")


# ----------------------------------------------------------------------------- audio


def test_wav_round_trip_resamples_to_target_rate() -> None:
    samples = tone(1.0, 24_000)
    wav = encode_wav(samples, 24_000)
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"
    info = sf.info(io.BytesIO(wav))
    assert (info.samplerate, info.channels, info.subtype) == (24_000, 1, "PCM_16")

    out = decode_input_audio(b64(wav), "wav", target_sr=16_000, max_seconds=5, param=PARAM)
    assert out.dtype == np.float32 and out.ndim == 1
    assert out.shape == (16_000,)
    # Still a 440 Hz tone of the same amplitude after resampling.
    spectrum = np.abs(np.fft.rfft(out))
    assert abs(np.argmax(spectrum) * 16_000 / out.size - 440) < 2
    assert abs(np.max(np.abs(out[1000:-1000])) - 0.5) < 0.02


def test_decode_same_rate_is_lossless_to_16_bit_precision() -> None:
    samples = tone(0.25, 16_000)
    out = decode_input_audio(b64(encode_wav(samples, 16_000)), "wav", target_sr=16_000, max_seconds=1, param=PARAM)
    assert out.shape == samples.shape
    np.testing.assert_allclose(out, samples, atol=1.0 / 32767 + 1e-6)


def test_stereo_is_mixed_to_mono_and_odd_rates_resample() -> None:
    left = tone(0.5, 44_100, amp=0.4)
    stereo = np.stack([left, -left * 0.5], axis=1)  # mono mix = 0.25 * left
    wav = encode_wav(stereo, 44_100)
    assert sf.info(io.BytesIO(wav)).channels == 2
    out = decode_input_audio(b64(wav), "wav", target_sr=16_000, max_seconds=1, param=PARAM)
    assert out.shape == (int(np.ceil(left.size * 16_000 / 44_100)),)
    assert abs(np.max(np.abs(out[500:-500])) - 0.1) < 0.01


def test_flac_and_data_url_prefix_decode() -> None:
    buf = io.BytesIO()
    sf.write(buf, tone(0.5, 48_000), 48_000, format="FLAC")
    data_url = "data:audio/flac;base64," + b64(buf.getvalue())
    out = decode_input_audio(data_url, "flac", target_sr=16_000, max_seconds=1, param=PARAM)
    assert out.shape == (8_000,)


def test_pcm16_input_is_24khz_mono() -> None:
    samples = tone(0.5, PCM16_SAMPLE_RATE)
    raw = encode_pcm16(samples)
    out = decode_input_audio(b64(raw), "pcm16", target_sr=16_000, max_seconds=1, param=PARAM)
    assert out.shape == (8_000,)
    same = decode_input_audio(b64(raw), "pcm16", target_sr=PCM16_SAMPLE_RATE, max_seconds=1, param=PARAM)
    np.testing.assert_allclose(same, samples, atol=2.0 / 32768)


def test_pcm16_odd_byte_count_rejected() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_input_audio(b64(b"\x00\x01\x02"), "pcm16", target_sr=16_000, max_seconds=1, param=PARAM)
    expect_400(info, PARAM, "even number of bytes")


def test_not_audio_bytes_rejected() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_input_audio(b64(b"this is definitely not a wav file" * 10), "wav", target_sr=16_000, max_seconds=5, param=PARAM)
    expect_400(info, PARAM, "could not decode audio as wav")


def test_bad_base64_audio_rejected() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_input_audio("not*base64", "wav", target_sr=16_000, max_seconds=5, param=PARAM)
    expect_400(info, PARAM, "base64")


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
def test_too_long_audio_rejected(fmt: str) -> None:
    samples = tone(2.0, PCM16_SAMPLE_RATE)
    raw = encode_wav(samples, PCM16_SAMPLE_RATE) if fmt == "wav" else encode_pcm16(samples)
    with pytest.raises(OpenAIError) as info:
        decode_input_audio(b64(raw), fmt, target_sr=16_000, max_seconds=1.5, param=PARAM)
    expect_400(info, PARAM, "too long", "limit 1.5 s")


def test_empty_audio_rejected() -> None:
    wav = encode_wav(np.zeros(0, dtype=np.float32), 16_000)
    with pytest.raises(OpenAIError) as info:
        decode_input_audio(b64(wav), "wav", target_sr=16_000, max_seconds=1, param=PARAM)
    expect_400(info, PARAM, "no samples")


def test_non_finite_float_audio_rejected() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.array([0.0, np.nan, 0.1], dtype=np.float32), 16_000, format="WAV", subtype="FLOAT")
    with pytest.raises(OpenAIError) as info:
        decode_input_audio(b64(buf.getvalue()), "wav", target_sr=16_000, max_seconds=1, param=PARAM)
    expect_400(info, PARAM, "non-finite")


def test_encode_pcm16_clips_and_is_little_endian() -> None:
    raw = encode_pcm16(np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5], dtype=np.float32))
    assert len(raw) == 12
    values = np.frombuffer(raw, dtype="<i2").tolist()
    assert values == [0, 32767, -32767, 32767, -32767, 16384]
    assert raw[2:4] == b"\xff\x7f"


def test_encode_audio_dispatch() -> None:
    samples = tone(0.1, 24_000)
    assert encode_audio(samples, 24_000, "wav") == encode_wav(samples, 24_000)
    assert encode_audio(samples, 24_000, "pcm16") == encode_pcm16(samples)
    with pytest.raises(OpenAIError) as info:
        encode_audio(samples, 24_000, "mp3")
    expect_400(info, "audio.format", "mp3")


def test_encode_wav_clips_out_of_range() -> None:
    wav = encode_wav(np.array([2.0, -2.0, 0.0], dtype=np.float32), 8_000)
    data, _ = sf.read(io.BytesIO(wav), dtype="int16")
    assert data[0] == 32767 and data[1] in (-32767, -32768) and data[2] == 0


# ----------------------------------------------------------------------------- images

IMG_PARAM = "messages[0].content[0].image_url.url"


def png_data_url(width: int, height: int, mode: str = "RGBA") -> str:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color=(10, 20, 30, 255)[: len(mode)]).save(buf, format="PNG")
    return "data:image/png;base64," + b64(buf.getvalue())


def test_png_data_url_decodes_to_rgb() -> None:
    img = decode_image_url(png_data_url(32, 16), max_pixels=10_000, max_bytes=1 << 20, param=IMG_PARAM)
    assert img.mode == "RGB"
    assert img.size == (32, 16)
    assert img.getpixel((5, 5)) == (10, 20, 30)


def test_uploaded_image_bytes_decode_keeping_alpha_when_asked() -> None:
    buf = io.BytesIO()
    Image.new("RGBA", (6, 4), color=(1, 2, 3, 0)).save(buf, format="PNG")
    rgba = decode_image_bytes(buf.getvalue(), max_pixels=100, param="mask", mode="RGBA")
    assert rgba.mode == "RGBA" and rgba.getpixel((0, 0)) == (1, 2, 3, 0)
    assert decode_image_bytes(buf.getvalue(), max_pixels=100, param="image").mode == "RGB"
    with pytest.raises(OpenAIError) as info:
        decode_image_bytes(buf.getvalue(), max_pixels=23, param="image")
    expect_400(info, "image", "image is too large (6x4 = 24 pixels; limit 23)")
    with pytest.raises(OpenAIError) as info:
        decode_image_bytes(b"not an image", max_pixels=100, param="image")
    expect_400(info, "image", "not an image in an accepted format")


def test_jpeg_data_url_decodes() -> None:
    buf = io.BytesIO()
    Image.new("L", (8, 8), color=128).save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + b64(buf.getvalue())
    img = decode_image_url(url, max_pixels=100, max_bytes=1 << 20, param=IMG_PARAM)
    assert img.mode == "RGB" and img.size == (8, 8)


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png", "HTTPS://x/y"])
def test_remote_image_url_rejected(url: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_image_url(url, max_pixels=100, max_bytes=1000, param=IMG_PARAM)
    expect_400(info, IMG_PARAM, "remote image URLs are not supported; send a data URL")


@pytest.mark.parametrize(
    ("url", "word"),
    [
        ("data:image/png;base64," + b64(b"garbage bytes, not an image"), "not an image in an accepted format"),
        ("data:image/png;base64,!!!!", "base64"),
        ("data:text/plain;base64," + b64(b"hi"), "image/*"),
        ("data:image/png,rawbytes", "base64"),
        ("file:///etc/passwd", "data URL"),
    ],
)
def test_bad_image_urls_rejected(url: str, word: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_image_url(url, max_pixels=100, max_bytes=1 << 20, param=IMG_PARAM)
    expect_400(info, IMG_PARAM, word)


def test_truncated_png_rejected() -> None:
    full = base64.b64decode(png_data_url(64, 64, "RGB").split(",", 1)[1])
    url = "data:image/png;base64," + b64(full[: len(full) // 2])
    with pytest.raises(OpenAIError) as info:
        decode_image_url(url, max_pixels=10_000, max_bytes=1 << 20, param=IMG_PARAM)
    expect_400(info, IMG_PARAM)


def test_too_many_pixels_rejected() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_image_url(png_data_url(100, 100), max_pixels=9_999, max_bytes=1 << 20, param=IMG_PARAM)
    expect_400(info, IMG_PARAM, "100x100", "limit 9999")


def test_image_bytes_limit() -> None:
    with pytest.raises(OpenAIError) as info:
        decode_image_url(png_data_url(100, 100), max_pixels=1 << 20, max_bytes=50, param=IMG_PARAM)
    expect_400(info, IMG_PARAM, "too large")


@pytest.mark.parametrize(("fmt", "container", "subtype"), [("mp3", "MP3", "MPEG_LAYER_III"), ("ogg", "OGG", "VORBIS")])
def test_compressed_formats_decode(fmt: str, container: str, subtype: str) -> None:
    buf = io.BytesIO()
    try:
        sf.write(buf, tone(1.0, 48_000, amp=0.3), 48_000, format=container, subtype=subtype)
    except (sf.LibsndfileError, ValueError, TypeError) as exc:  # libsndfile built without the codec
        pytest.skip(f"libsndfile cannot write {container}/{subtype}: {exc}")
    out = decode_input_audio(b64(buf.getvalue()), fmt, target_sr=16_000, max_seconds=2, param=PARAM)
    assert out.dtype == np.float32
    assert abs(out.size - 16_000) <= 16_000 * 0.1  # codec padding/priming may shift the length a bit
    assert 0.2 < float(np.max(np.abs(out))) < 0.45


def _m4a(seconds: float, sr: int = 16000) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        stream = c.add_stream("aac", rate=sr, layout="mono")
        x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * sr)) / sr)).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = sr
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            c.mux(packet)
    return buf.getvalue()


def test_uploaded_audio_soundfile_cannot_read_goes_to_ffmpeg_with_the_same_limits():
    """Transcription uploads: m4a (AAC in MP4) is read by the FFmpeg reader; its header is checked first, and
    bytes neither reader takes are a 400 naming the file."""
    from omni_serve.api.media import decode_audio_bytes
    from omni_serve.api.video import read_audio_container

    def decode(raw, max_seconds=5.0):
        checks = dict(max_seconds=max_seconds, param="file", max_sample_rate=48000, max_channels=2)
        return decode_audio_bytes(raw, "wav", target_sr=16000, **checks,
                                  other_reader=lambda d: read_audio_container(d, rate=16000, **checks))

    samples = decode(_m4a(1.0))
    assert samples.dtype == np.float32 and 16000 <= samples.size < 16000 * 1.2 and np.abs(samples).max() > 0.2
    for raw, words in ((_m4a(1.0), "too long"), (b"not audio at all", "could not decode")):
        with pytest.raises(OpenAIError) as info:
            decode(raw, max_seconds=0.5)
        assert info.value.status_code == 400 and info.value.param == "file" and words in info.value.message
