"""The request limits and defaults of a video graph (``VideoGraphSpec``), shared by the video families, and where
its jobs are kept (``jobs``: ``omni_serve.jobs.JobStoreSpec``).

A family's spec subclasses ``VideoGraphSpec``, redeclaring ``checkpoint`` and ``model_name`` and adding its
``stages``/``edges`` sections derived from its graph declaration.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from omni_serve.graph.spec import GraphSpecBase
from omni_serve.jobs import JobStoreSpec
from omni_serve.kits.diffusion.spec import size_dimensions


class VideoGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local checkpoint directory (diffusers layout).")
    model_name: str = Field(..., description="Model id served at /v1/models and accepted in requests.")
    default_size: str = Field("832x480", description="Video size when a request gives none ('WIDTHxHEIGHT').")
    max_side: int = Field(1280, ge=16, description="Largest width or height accepted (pixels).")
    max_pixels: int = Field(1280 * 720, ge=256, description="Largest width x height accepted.")
    default_seconds: int = Field(5, ge=1, description="Clip length when a request gives none (seconds).")
    default_fps: int = Field(16, ge=1, le=120, description="Frames per second when a request gives none.")
    max_frames: int = Field(121, ge=1, description="Most frames a video may have (seconds x fps, or num_frames).")
    default_steps: int = Field(50, ge=1, description="Denoising steps when a request gives none.")
    max_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    default_guidance_scale: float = Field(5.0, ge=0, description=(
        "Classifier-free guidance scale when a request gives none (none at 1 or below), as diffusers' default."))
    job_timeout_s: float = Field(3600.0, gt=0, description=(
        "Longest a job may run once a replica took it; past it, it is retried or failed."))
    max_running_jobs: int = Field(1, ge=1, description=(
        "Jobs one ingress replica runs at once (each is one request in the graph's stages; the DiT batches "
        "the steps of every running job, from every replica)."))
    jobs: JobStoreSpec = Field(default_factory=JobStoreSpec, description=(
        "Where job records and results are kept: a SQLite file on one node, PostgreSQL (and a shared results "
        "directory) for several ingress replicas."))

    @model_validator(mode="after")
    def _check(self) -> "VideoGraphSpec":
        if self.default_steps > self.max_steps:
            raise ValueError("default_steps must be <= max_steps")
        if self.default_dimensions() is None:
            raise ValueError("default_size must be 'WIDTHxHEIGHT'")
        width, height = self.default_dimensions()
        if max(width, height) > self.max_side or width * height > self.max_pixels:
            raise ValueError(f"default_size {self.default_size} is over max_side ({self.max_side}) or max_pixels "
                             f"({self.max_pixels})")
        return self

    def default_dimensions(self) -> tuple[int, int]:
        """(width, height) of ``default_size``."""
        return size_dimensions(self.default_size)
