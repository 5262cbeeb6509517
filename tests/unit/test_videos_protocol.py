"""The Videos API's protocol models: what the official client's ``videos.create`` sends validates (and bad values
fail with the field named), frame counts follow the model's temporal rule, and job store records become job
objects, list pages and delete answers that the official client's own types parse."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_serve.api.videos import VideoCreateRequest, VideoDeleted, frame_count, video_list, video_object
from omni_serve.jobs import Job


def test_the_clients_fields_and_the_extensions_validate():
    r = VideoCreateRequest.model_validate({"prompt": "a cat", "model": "wan", "seconds": "4", "size": "832x480",
                                           "seed": 3, "num_inference_steps": 20, "guidance_scale": 5.0,
                                           "negative_prompt": "blurry", "fps": 16, "unknown": 1})
    assert (r.seconds, r.dimensions(), r.fps) == ("4", (832, 480), 16)
    assert VideoCreateRequest.model_validate({"prompt": "x", "seconds": 8}).seconds == "8"  # a JSON number too
    assert VideoCreateRequest.model_validate({"prompt": "x"}).dimensions() is None


@pytest.mark.parametrize("body, field", [
    ({"prompt": ""}, "prompt"), ({}, "prompt"), ({"prompt": "x", "size": "832*480"}, "size"),
    ({"prompt": "x", "seconds": "4.5"}, "seconds"), ({"prompt": "x", "seconds": "0"}, "seconds"),
    ({"prompt": "x", "seconds": True}, "seconds"), ({"prompt": "x", "guidance_scale": float("inf")}, "guidance_scale"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"), ({"prompt": "x", "fps": 0}, "fps"),
])
def test_bad_values_name_their_field(body, field):
    with pytest.raises(ValidationError) as info:
        VideoCreateRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("seconds, fps, temporal, frames", [
    (5, 16, 4, 81), (4, 16, 4, 65), (0.1, 16, 4, 1), (1, 24, 4, 25), (2, 15, 4, 29), (3, 10, 1, 30)])
def test_frame_counts_follow_the_temporal_rule(seconds, fps, temporal, frames):
    assert frame_count(seconds, fps, temporal) == frames


def _job(**kw) -> Job:
    base = dict(id="video_0123", kind="video", owner="k", status="queued", progress=0, created_at=1700000000,
                completed_at=None, expires_at=None, error=None, attempts=0, worker=None, lease_until=None,
                result_file=None, request={"model": "wan", "prompt": "a cat", "seconds": "4", "size": "1280x720"})
    return Job(**{**base, **kw})


def test_job_objects_parse_as_the_official_clients_types():
    from openai.types import Video, VideoDeleteResponse

    # strict validation of the client's type admits Sora's four sizes only (its responses parse leniently, any size)

    queued = Video.model_validate(video_object(_job()).model_dump())
    assert (queued.id, queued.object, queued.status, queued.seconds, queued.size) == \
        ("video_0123", "video", "queued", "4", "1280x720")
    failed = video_object(_job(status="failed", progress=30, completed_at=1700000100, expires_at=1700003700,
                               error={"code": "job_lost", "message": "its worker died"}))
    parsed = Video.model_validate(failed.model_dump())
    assert (parsed.error.code, parsed.completed_at, parsed.expires_at) == ("job_lost", 1700000100, 1700003700)
    page = video_list([_job(id="video_1"), _job(id="video_2")], has_more=True).model_dump()
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", "video_1", "video_2",
                                                                                       True)
    assert [Video.model_validate(v).id for v in page["data"]] == ["video_1", "video_2"]
    assert video_list([], has_more=False).model_dump()["first_id"] is None
    deleted = VideoDeleteResponse.model_validate(VideoDeleted(id="video_1").model_dump())
    assert (deleted.id, deleted.object, deleted.deleted) == ("video_1", "video.deleted", True)
