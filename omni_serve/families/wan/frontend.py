"""Ingress side of the Wan graph: OpenAI's Videos API (``omni_serve.kits.diffusion.video_frontend``) with Wan's
size and frame rules, read from the checkpoint's configs (no model loaded here): sides a multiple of the VAE's
spatial compression times the transformer's patch (16), frame counts ``4k + 1`` (the VAE's temporal compression)."""

from __future__ import annotations

import json
import os

from omni_serve.kits.diffusion.video_frontend import VideoRequestChecks, VideosFrontend


def _config(checkpoint: str, part: str) -> dict:
    with open(os.path.join(checkpoint, part, "config.json")) as f:
        return json.load(f)


class WanFrontend(VideosFrontend):
    def __init__(self, spec, stages):
        super().__init__(spec, stages)
        vae, transformer = _config(spec.checkpoint, "vae"), _config(spec.checkpoint, "transformer")
        multiple = vae.get("scale_factor_spatial", 8) * transformer.get("patch_size", [1, 2, 2])[1]
        self.checks = VideoRequestChecks(spec, multiple, vae.get("scale_factor_temporal", 4))
