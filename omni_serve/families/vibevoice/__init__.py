"""VibeVoice as a stage graph: text-to-speech with voice cloning, behind ``POST /v1/audio/speech``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``), the spec
(``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side code lives in
``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run omni_serve.families.vibevoice:build_app
checkpoint=DIR`` or ``omni-serve serve --graph vibevoice checkpoint=DIR``; see docs/vibevoice.md.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.families.vibevoice.graph import GRAPH
from omni_serve.families.vibevoice.spec import VibeVoiceGraphSpec
from omni_serve.graph.family import Family

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=VibeVoiceGraphSpec, frontend=f"{__name__}.frontend:VibeVoiceFrontend",
    checkpoint_marker="processor_config.json",
    checkpoint_writer="omni_serve.checkpoints.vibevoice:make_checkpoint",
    description=("VibeVoice text-to-speech: an LM whose every speech token is drawn by a diffusion head and decoded "
                 "to audio that feeds the next step; speaks a script in cloned reference voices, up to four "
                 "speakers."))

build_app = serve_builder(FAMILY)
