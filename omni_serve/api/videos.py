"""OpenAI Videos API protocol models (``/v1/videos``: a job API), pydantic v2.

Contract:

* ``VideoCreateRequest`` accepts what the official ``openai`` client's ``videos.create`` sends (``prompt``,
  ``model``, ``seconds`` as a string such as ``"4"``, ``size`` as ``"WIDTHxHEIGHT"``; ``input_reference`` comes as a
  multipart file and is the frontend's), plus omni_serve extensions for diffusion models (``seed``,
  ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``fps``, ``num_frames``, ``output_format``).
  Unknown fields are ignored. Static rules (an empty prompt, a malformed ``size`` or ``seconds``, values below their
  minimum, a guidance scale that is not finite) fail validation and become 400s via ``omni_serve.api.errors``;
  limits that depend on the served graph (sizes, frames, steps) are the graph frontend's, also 400s.
* ``frame_count(seconds, fps, temporal)`` is the frame count a video of ``seconds`` at ``fps`` gets from a model
  whose VAE compresses ``temporal`` frames into one latent frame (the first alone): the nearest ``temporal * k + 1``.
* ``Video`` is OpenAI's job object; ``video_object(job)`` builds it from a job store record
  (``omni_serve.jobs.Job``, whose ``request`` holds the validated create body). ``VideoList`` is the list page,
  ``VideoDeleted`` the answer to ``DELETE``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from omni_serve.jobs import Job

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_GUIDANCE_SCALE = 100.0  # finite and bounded, as the image API's: JSON's Infinity would reach the denoising loop


class VideoCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, description="What the video shows.")
    model: str | None = Field(default=None, description="Served model name (default: the served one).")
    seconds: str | None = Field(default=None, description=(
        "Clip length in seconds, a whole number as a string (OpenAI's form, e.g. '4'); default: the graph's."))
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT' in pixels; default: the graph's.")
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Noise seed (random when absent).")
    num_inference_steps: int | None = Field(default=None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                         description="Classifier-free guidance scale (none at 1 or below).")
    negative_prompt: str | None = Field(default=None, description="What the video should not show (with guidance).")
    fps: int | None = Field(default=None, ge=1, le=120, description="Frames per second of the video.")
    num_frames: int | None = Field(default=None, ge=1, description=(
        "Frames to generate, instead of seconds times fps (the model's rule applies, e.g. 4k + 1 for Wan)."))
    output_format: Literal["mp4", "npz"] | None = Field(default=None, description=(
        "'mp4' (H.264, the default) or 'npz': the exact uint8 frames [F, H, W, 3] and the final latents the VAE "
        "decoded, as a NumPy archive (for checking a model against its reference; the content's media type is "
        "application/octet-stream)."))

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.match(value):
            raise ValueError(f"size must be 'WIDTHxHEIGHT' in pixels (e.g. '832x480'), got {value!r}")
        return value

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value) -> str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < 1:
            raise ValueError(f"seconds must be a whole number of seconds, at least 1 (e.g. '4'), got {value!r}")
        return str(int(value))

    def dimensions(self) -> tuple[int, int] | None:
        """(width, height) of ``size``, or None when absent."""
        if self.size is None:
            return None
        width, height = _SIZE.match(self.size).groups()
        return int(width), int(height)


def frame_count(seconds: float, fps: int, temporal: int) -> int:
    """The ``temporal * k + 1`` frames nearest to ``seconds * fps`` (at least one)."""
    return max(0, round((seconds * fps - 1) / temporal)) * temporal + 1


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """OpenAI's video job object."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str
    size: str
    remixed_from_video_id: str | None = None
    error: VideoError | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


def video_object(job: "Job") -> Video:
    """The job object of a job store record whose ``request`` is the resolved create body (``model``, ``prompt``,
    ``seconds`` and ``size`` filled in with the graph's defaults by the frontend)."""
    request = job.request
    stamp = (lambda t: None if t is None else int(t))
    error = VideoError(code=job.error.get("code", "error"), message=job.error.get("message", "")) \
        if job.error else None
    return Video(id=job.id, model=request["model"], status=job.status, progress=job.progress,
                 created_at=int(job.created_at), completed_at=stamp(job.completed_at),
                 expires_at=stamp(job.expires_at), prompt=request.get("prompt"), seconds=str(request["seconds"]),
                 size=request["size"], error=error)


def video_list(jobs: list["Job"], has_more: bool) -> VideoList:
    data = [video_object(j) for j in jobs]
    return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=has_more)
