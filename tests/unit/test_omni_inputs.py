"""The Omni graphs' model inputs are transformers' own processor's, and video parts decode, sample and fail as
documented (``omni_serve.models.qwen2_5_omni_inputs``, ``omni_serve.api.video``, the frontend's ``video_url``).

The served inputs (``OmniInputProcessor``: our video decoding, frame sampling through the processor's
``sample_frames``, the audio track handed over, Qwen2.5-Omni's shorter audio padding) must equal what
``AutoProcessor``'s default call builds from the same media (transformers decoding the video file itself) in
every field the models read; a negative control shows a sampling mix-up fails the comparison.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from omni_serve.api import protocol as P
from omni_serve.api.errors import OpenAIError
from omni_serve.api.video import VideoLimits, decode_video
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.omni_cases import ALL_CASES, audio_clip, reference_inputs, serve_inputs, video_bytes, video_data_url

FIELDS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
          "video_second_per_grid", "audio_seqlens")
FAMILIES = ("qwen2_5_omni", "qwen3_omni")


@pytest.fixture(scope="module")
def checkpoints(omni_tiny_dir, qwen3_omni_tiny_dir):
    return {"qwen2_5_omni": omni_tiny_dir, "qwen3_omni": qwen3_omni_tiny_dir}


def assert_same_inputs(got, want) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    assert got.use_audio_in_video == want.use_audio_in_video
    if want.input_features is not None:  # the frames the attention mask keeps (what the audio tower reads)
        for i, n in enumerate(want.audio_seqlens.tolist()):
            assert torch.equal(got.input_features[i, :, :n], want.input_features[i, :, :n])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ALL_CASES)
def test_served_inputs_are_the_processors(checkpoints, family, kind):
    ckpt = checkpoints[family]
    assert_same_inputs(serve_inputs(OmniInputProcessor(ckpt), kind), reference_inputs(ckpt, kind))


def test_a_frame_sampling_mix_up_fails_the_comparison(omni_tiny_dir):
    """Negative control: frames sampled at another rate than the reference's must not pass."""
    got = serve_inputs(OmniInputProcessor(omni_tiny_dir, video_fps=1.0), "video")
    with pytest.raises(AssertionError):
        assert_same_inputs(got, reference_inputs(omni_tiny_dir, "video"))


def test_qwen2_5_omni_audio_is_padded_to_the_longest_clip_not_300_s(omni_tiny_dir):
    x = serve_inputs(OmniInputProcessor(omni_tiny_dir), "audio")
    assert x.input_features.shape[-1] < 200  # a 1 s clip: ~100 frames, not the processor's 30000


# -- the decoder -------------------------------------------------------------------------------------------
def sample_all(header):
    return list(range(header.total_num_frames))


def test_mp4_h264_aac_decodes_frames_and_the_sound_track():
    raw = video_bytes(container="mp4", vcodec="libx264", acodec="aac")
    v = decode_video(raw, limits=VideoLimits(), sample=lambda h: [0, 5, 19], param="v", audio_rate=16000)
    assert v.frames.shape == (3, 48, 64, 3) and v.frames.dtype == np.uint8
    assert v.header.total_num_frames == 20 and v.header.fps == 10 and v.header.has_audio
    assert v.audio is not None and abs(v.audio.size - 32000) < 2048  # AAC priming/padding
    # the track is the clip (lossy): it correlates with it
    n = min(v.audio.size, 32000)
    assert np.corrcoef(v.audio[:n], audio_clip(2.0)[:n])[0, 1] > 0.5


def test_the_pcm_sound_track_decodes_exactly():
    v = decode_video(video_bytes(), limits=VideoLimits(), sample=sample_all, param="v", audio_rate=16000)
    want = (audio_clip(2.0) * 32768).astype(np.int16).astype(np.float32) / 32768
    np.testing.assert_array_equal(v.audio, want)


def test_a_silent_video_has_no_track():
    v = decode_video(video_bytes(audio=False), limits=VideoLimits(), sample=sample_all, param="v", audio_rate=16000)
    assert v.audio is None and not v.header.has_audio


@pytest.mark.parametrize("limits, words", [
    ({"max_seconds": 1.0}, "too long"),
    ({"max_frame_pixels": 1000}, "too large (64x48"),
    ({"max_source_frames": 10}, "too many frames (20"),
    ({"max_sampled_frames": 2}, "sampled to 20 frames"),
])
def test_limits_are_checked_from_the_header(limits, words, monkeypatch):
    import av

    decoded = []
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda *a, **k: decoded.append(1))
    with pytest.raises(OpenAIError) as info:
        decode_video(video_bytes(), limits=VideoLimits(**limits), sample=sample_all, param="p")
    assert info.value.status_code == 400 and info.value.param == "p" and words in info.value.message
    assert not decoded  # refused before any frame was decoded


@pytest.mark.parametrize("raw, words", [
    (b"not a video at all" * 10, "could not decode the video"),
    (b"", "could not decode the video"),
])
def test_unreadable_bytes_are_a_400(raw, words):
    with pytest.raises(OpenAIError) as info:
        decode_video(raw, limits=VideoLimits(), sample=sample_all, param="p")
    assert info.value.status_code == 400 and words in info.value.message


def test_a_file_without_a_video_stream_is_a_400():
    from tests.unit.test_api_media import _m4a

    raw = _m4a(0.5)  # AAC in MP4: a video container holding only audio
    with pytest.raises(OpenAIError) as info:
        decode_video(raw, limits=VideoLimits(), sample=sample_all, param="p")
    assert "no video stream" in info.value.message


def test_a_container_outside_the_allowlist_is_refused_unprobed():
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio_clip(0.5), 16000, format="WAV")  # FFmpeg reads WAV, but not as a video
    with pytest.raises(OpenAIError) as info:
        decode_video(buf.getvalue(), limits=VideoLimits(), sample=sample_all, param="p")
    assert "must be in a container of mov,mp4,matroska,webm,avi" in info.value.message


def test_a_truncated_video_is_a_400():
    raw = video_bytes(container="mp4")
    with pytest.raises(OpenAIError) as info:
        decode_video(raw[: len(raw) // 3], limits=VideoLimits(), sample=sample_all, param="p")
    assert info.value.status_code == 400 and "video" in info.value.message


# -- the frontend ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frontend(omni_tiny_dir):
    from omni_serve.families.qwen2_5_omni.frontend import Qwen25OmniFrontend as OmniFrontend
    from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

    spec = OmniGraphSpec.model_validate({"checkpoint": omni_tiny_dir, "video": {"max_seconds": 5}})
    return OmniFrontend(spec, stages=None)  # prepare() calls no stage


def prepare(frontend, content, **extra):
    req = P.ChatCompletionRequest.model_validate(
        {"model": "qwen2.5-omni", "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra})
    try:
        return asyncio.run(frontend.prepare(req))
    except OpenAIError as err:
        return err


def video_part(raw: bytes | None = None, url: str | None = None) -> dict:
    return {"type": "video_url", "video_url": {"url": url or video_data_url(raw or video_bytes())}}


PARAM = "messages[0].content[0].video_url.url"


def test_a_video_part_is_prepared_with_its_sound_by_default(frontend):
    p = prepare(frontend, [video_part(), {"type": "text", "text": "what happens"}])
    assert not isinstance(p, OpenAIError), p
    assert p.thinker.media_layout.use_audio_in_video and p.thinker.media_layout.video_grid_thw
    assert p.media.pixel_values_videos is not None and p.media.input_features is not None


def test_use_audio_in_video_can_be_turned_off_per_request(frontend):
    p = prepare(frontend, [video_part()], mm_processor_kwargs={"use_audio_in_video": False})
    assert not p.thinker.media_layout.use_audio_in_video and p.media.input_features is None


def test_a_silent_video_is_seen_only_unless_its_sound_is_asked_for(frontend):
    silent = video_part(video_bytes(audio=False))
    p = prepare(frontend, [silent])
    assert not p.thinker.media_layout.use_audio_in_video
    err = prepare(frontend, [silent], mm_processor_kwargs={"use_audio_in_video": True})
    assert isinstance(err, OpenAIError) and err.status_code == 400 and "no audio track" in err.message


@pytest.mark.parametrize("url, words", [
    ("https://example.com/a.mp4", "remote video URLs are not supported"),
    ("data:image/png;base64,AAAA", "media type must be video/*"),
    ("data:video/mp4;base64,@@@@", "not valid base64"),
    ("data:video/mp4;base64," + base64.b64encode(b"garbage" * 20).decode(), "could not decode the video"),
])
def test_bad_video_urls_are_400s_naming_the_part(frontend, url, words):
    err = prepare(frontend, [video_part(url=url)])
    assert isinstance(err, OpenAIError) and err.status_code == 400, err
    assert err.param == PARAM and words in err.message, err.message


def test_a_video_over_the_spec_limit_is_refused(frontend):
    err = prepare(frontend, [video_part(video_bytes(seconds=6.0, audio=False))])
    assert isinstance(err, OpenAIError) and err.param == PARAM and "too long" in err.message


def test_only_user_messages_may_carry_video(frontend):
    req = P.ChatCompletionRequest.model_validate({"model": "qwen2.5-omni", "messages": [
        {"role": "assistant", "content": [video_part()]}, {"role": "user", "content": "hi"}]})
    with pytest.raises(OpenAIError) as info:
        asyncio.run(frontend.prepare(req))
    assert "Only user messages may contain audio, images or video" in info.value.message
