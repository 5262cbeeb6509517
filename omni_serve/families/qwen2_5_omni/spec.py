"""The Qwen2.5-Omni graph spec: request limits and defaults, the thinker layout, and the ``stages``/``edges``
sections derived from the graph declaration (overridable from Python, CLI or YAML).

``deployed_stages()`` lists what the builder deploys for the spec's ``thinker_layout``; ``text_stage()`` names
the stage whose outputs are the response text and whose ``params`` hold the text-generation settings.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from omni_serve.families.qwen2_5_omni.graph import AGGREGATED, AGGREGATED_VLLM, DISAGGREGATED, GRAPH
from omni_serve.families.qwen2_5_omni.params import (  # noqa: F401 - the spec's section types, importable from here
    Code2WavParams, Code2WavStage, EncoderStage, TalkerParams, TalkerStage, ThinkerParams, ThinkerPrefillStage,
    ThinkerStage,
)
from omni_serve.graph.graph import GraphDef
from omni_serve.graph.spec import GraphSpecBase
from omni_serve.kits.omni.spec import OmniAudioSpec, OmniMediaSpec, ThinkerTalkerSpec

# Qwen2.5-Omni's system prompt, which the model needs to answer with speech (Qwen's model card).
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)

OmniStages = GRAPH.stages_model("OmniStages")
OmniEdges = GRAPH.edges_model("OmniEdges")


class OmniGraphSpec(ThinkerTalkerSpec, OmniAudioSpec, OmniMediaSpec, GraphSpecBase):
    graph: ClassVar[GraphDef] = GRAPH

    checkpoint: str = Field(..., description="Local Qwen2.5-Omni checkpoint directory (Hugging Face layout).")
    model_name: str = Field("qwen2.5-omni", description="Model id served at /v1/models and accepted in requests.")
    default_voice: str = Field("Chelsie", description="Voice used when a request asks for audio without one.")
    system_prompt: str | None = Field(
        None, description="System prompt added when a request has none (default: Qwen2.5-Omni's speech prompt).")
    thinker_layout: Literal[AGGREGATED, DISAGGREGATED] = Field(AGGREGATED, description=(
        "'aggregated': one thinker stage runs prompt and generation. 'disaggregated': thinker_prefill computes "
        "the prompt's KV and hands it through the thinker_prefill_thinker_decode edge to thinker_decode, which "
        "generates (each scales and is placed on its own); outputs are identical. With "
        "stages.thinker.engine.backend 'vllm' the thinker is aggregated (vLLM runs the media towers too)."))
    stages: OmniStages = Field(default_factory=OmniStages, description="One deployment per stage.")
    edges: OmniEdges = Field(default_factory=OmniEdges, description="Data-plane settings per edge.")

    @model_validator(mode="after")
    def _vllm_thinker_is_aggregated(self):
        if self.stages.thinker.engine.backend == "vllm" and self.thinker_layout != AGGREGATED:
            raise ValueError(
                "stages.thinker.engine.backend 'vllm' needs thinker_layout 'aggregated': the disaggregated thinker "
                "hands decode the prompt's KV and the talker's prompt states; vLLM's KV connectors move the KV but "
                "not the hidden states, and that pairing is not built yet (see docs/vllm.md)")
        return self

    def layout(self) -> str:
        if self.stages.thinker.engine.backend == "vllm":
            return AGGREGATED_VLLM
        return self.thinker_layout

    def thinker_backend(self) -> str:
        return self.stage_spec(self.text_stage()).engine.backend

