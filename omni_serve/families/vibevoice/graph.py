"""The VibeVoice graph, declared once: one stage.

    ingress -> lm

Why the acoustic decoder is not a stage of its own: VibeVoice feeds each speech token's *decoded audio* back into
the LM (the semantic encoder re-encodes it into the next input row), so the lm stage runs the acoustic decoder for
every token whatever a downstream stage does. A decoder stage would decode every latent a second time (about a
fifth of a token's compute on the small checkpoint) to produce the samples the lm stage already holds; the lm stage
sends those samples instead, in order, one 3200-sample chunk per speech token (the decode is causal, one frame per
call through its padding cache, so the chunks join exactly). The ingress encodes them to the response format.
"""

from __future__ import annotations

from omni_serve.families.vibevoice import messages as M
from omni_serve.families.vibevoice.params import LMStage
from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef

GRAPH = GraphDef(
    name="vibevoice",
    stages=(
        StageDef("lm", "Script and reference voices -> speech: the Qwen2 LM with its per-token diffusion head, "
                 "acoustic decoder and semantic re-encoding, continuous batching over a paged KV cache (every "
                 "token's side passes, diffusion, decode and encode batched across the step's requests).",
                 "omni_serve.families.vibevoice.replica.runners:LMRunner", EngineKind.AR,
                 "omni_serve.models.vibevoice:VibeVoiceLM", call=M.SpeakCall,
                 outputs=(M.SpeechAudio, M.SpeechFinished), reads=("ingress_lm",), spec=LMStage,
                 defaults={"num_cpus": 1.0, "engine": {"torch_threads": 2}}),
    ),
    edges=(
        EdgeDef("ingress_lm", M.VoiceClips, "Each speaker's reference clip (24 kHz float32) to the lm stage."),
    ),
    ingress_writes=("ingress_lm",),
)
