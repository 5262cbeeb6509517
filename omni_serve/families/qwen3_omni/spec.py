"""The Qwen3-Omni graph spec: request limits and defaults, the thinker layout, and the ``stages``/``edges``
sections derived from the graph declaration (overridable from Python, CLI or YAML).

The same surface as Qwen2.5-Omni's spec (``ThinkerTalkerSpec``): ``deployed_stages()``, ``thinker_stages()``,
``text_stage()`` and ``thinker_params()`` answer the same questions for this graph.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from omni_serve.graph.graph import GraphDef
from omni_serve.families.qwen3_omni.graph import AGGREGATED, DISAGGREGATED, GRAPH
from omni_serve.kits.omni.spec import OmniAudioSpec, OmniMediaSpec, ThinkerTalkerSpec
from omni_serve.graph.spec import GraphSpecBase

# The system prompt Qwen3-Omni's model card uses for spoken answers.
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen-Omni, a smart voice assistant created by Alibaba Qwen. You are a virtual voice assistant with "
    "no gender or age. Interact with users in a warm, natural tone; keep answers short and conversational."
)

Qwen3OmniStages = GRAPH.stages_model("Qwen3OmniStages")
Qwen3OmniEdges = GRAPH.edges_model("Qwen3OmniEdges")


class Qwen3OmniGraphSpec(ThinkerTalkerSpec, OmniAudioSpec, OmniMediaSpec, GraphSpecBase):
    graph: ClassVar[GraphDef] = GRAPH

    checkpoint: str = Field(..., description="Local Qwen3-Omni (MoE) checkpoint directory (Hugging Face layout).")
    model_name: str = Field("qwen3-omni", description="Model id served at /v1/models and accepted in requests.")
    default_voice: str = Field("Ethan", description=(
        "Voice used when a request asks for audio without one (a voice of the checkpoint's talker_config."
        "speaker_id, matched case-insensitively)."))
    system_prompt: str | None = Field(
        None, description="System prompt added when a request has none (default: Qwen3-Omni's speech prompt).")
    thinker_layout: Literal[AGGREGATED, DISAGGREGATED] = Field(AGGREGATED, description=(
        "'aggregated': one thinker stage runs prompt and generation. 'disaggregated': thinker_prefill computes "
        "the prompt's KV and hands it through the thinker_prefill_thinker_decode edge to thinker_decode, which "
        "generates (each scales and is placed on its own); outputs are identical."))
    stages: Qwen3OmniStages = Field(default_factory=Qwen3OmniStages, description="One deployment per stage.")
    edges: Qwen3OmniEdges = Field(default_factory=Qwen3OmniEdges, description="Data-plane settings per edge.")

    def layout(self) -> str:
        return self.thinker_layout

    def thinker_backend(self) -> str:
        return "native"
