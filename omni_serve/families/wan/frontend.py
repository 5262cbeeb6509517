"""Ingress side of the Wan graph: OpenAI's Videos API (``omni_serve.kits.diffusion.video_frontend``) with Wan's
size and frame rules, read from the checkpoint's configs (no model loaded here): sides a multiple of the VAE's
spatial compression times the transformer's patch (16), frame counts ``4k + 1`` (the VAE's temporal compression)."""

from __future__ import annotations

from omni_serve.kits.diffusion.video_frontend import VideoRequestChecks, VideosFrontend
from omni_serve.models.wan_layout import size_rules


class WanFrontend(VideosFrontend):
    def __init__(self, spec, stages):
        super().__init__(spec, stages)
        self.checks = VideoRequestChecks(spec, *size_rules(spec.checkpoint))
