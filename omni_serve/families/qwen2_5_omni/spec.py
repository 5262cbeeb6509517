"""The Qwen2.5-Omni graph spec: request limits and defaults, the thinker layout, and the ``stages``/``edges``
sections derived from the graph declaration (overridable from Python, CLI or YAML).

``deployed_stages()`` lists what the builder deploys for the spec's ``thinker_layout``; ``text_stage()`` names
the stage whose outputs are the response text and whose ``params`` hold the text-generation settings.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from omni_serve.api.video import VideoLimits
from omni_serve.graph.graph import GraphDef
from omni_serve.families.qwen2_5_omni.graph import AGGREGATED, AGGREGATED_VLLM, DISAGGREGATED, GRAPH
from omni_serve.families.qwen2_5_omni.messages import TextDelta, ThinkerCall
from omni_serve.families.qwen2_5_omni.params import (  # noqa: F401 - the spec's section types, importable from here
    Code2WavParams, Code2WavStage, EncoderStage, TalkerParams, TalkerStage, ThinkerParams, ThinkerPrefillStage,
    ThinkerStage,
)
from omni_serve.graph.spec import GraphSpecBase

# Qwen2.5-Omni's system prompt, which the model needs to answer with speech (Qwen's model card).
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)

OmniStages = GRAPH.stages_model("OmniStages")
OmniEdges = GRAPH.edges_model("OmniEdges")


class OmniVideoSpec(VideoLimits):
    """Video input (``video_url`` content parts) of the Qwen-Omni graphs: how frames are sampled, whether the audio
    track is heard, and the limits checked from the container header before decoding."""

    fps: float = Field(2.0, gt=0, le=30, description=(
        "Frames sampled per second of video, by the checkpoint video processor's own sample_frames (2: Qwen-Omni's "
        "reference utilities)."))
    use_audio_in_video: bool = Field(True, description=(
        "Hear each video's audio track too (its tokens interleaved with the video's in time, as Qwen-Omni's "
        "use_audio_in_video). Requests override it with mm_processor_kwargs.use_audio_in_video; with the default, "
        "a request whose videos are not all with sound is processed without."))


class OmniMediaSpec(BaseModel):
    """The media settings both Qwen-Omni specs take (limits checked at the ingress before decoding)."""

    max_audio_seconds: float = Field(60.0, gt=0, description="Longest input audio clip accepted.")
    max_image_pixels: int = Field(4096 * 4096, gt=0, description="Largest input image accepted (pixels).")
    video: OmniVideoSpec = Field(default_factory=OmniVideoSpec, description="Video input: sampling and limits.")


class SpeechSpec(BaseModel):
    """``POST /v1/audio/speech``: the given text is forced as the thinker's reply and spoken by talker and code2wav."""

    system_prompt: str | None = Field(None, description=(
        "System turn of the prompt the text is spoken after (default: the graph's system_prompt, else the model's "
        "speech prompt)."))


class TranscriptionSpec(BaseModel):
    """``POST /v1/audio/transcriptions``: the thinker answers an audio prompt asking for its transcript."""

    system_prompt: str = Field("You are a speech recognition model.", description=(
        "System turn of the transcription prompt (Qwen-Omni's ASR prompt)."))
    instruction: str = Field("Transcribe the audio into text.", description=(
        "The user turn's text after the audio; the request's language and prompt are appended to it."))
    max_file_bytes: int = Field(25 * 1024 * 1024, gt=0, description="Largest uploaded file accepted (OpenAI: 25 MB).")
    max_tokens: int = Field(448, ge=1, description="Most transcript tokens generated per request.")


class OmniAudioSpec(BaseModel):
    """How the Qwen-Omni graphs speak to clients: the chat stream's shape and the audio endpoints."""

    chat_stream_format: Literal["openai", "vllm_omni"] = Field("openai", description=(
        "Shape of streamed chat replies: 'openai' (text of an audio reply as delta.audio.transcript pieces, "
        "pcm16 audio in delta.audio.data) or 'vllm_omni' (vLLM-Omni's: a modality on every chunk, each audio "
        "chunk a complete base64 WAV in delta.content). Requests choose per call with the X-Omni-Stream-Format "
        "header."))
    speech: SpeechSpec = Field(default_factory=SpeechSpec, description="POST /v1/audio/speech.")
    transcription: TranscriptionSpec = Field(default_factory=TranscriptionSpec,
                                             description="POST /v1/audio/transcriptions.")


class ThinkerTalkerSpec:
    """What the Qwen-Omni frontends ask a thinker-talker spec (mixed into ``OmniGraphSpec`` and Qwen3-Omni's spec,
    each naming its ``graph``): the stages deployed for the spec's ``layout()`` and which of them thinks."""

    graph: ClassVar[GraphDef] = GRAPH

    def deployed_stages(self) -> list[str]:
        """Every stage the builder deploys for this layout, in data-flow order."""
        return [s.name for s in self.graph.deployed(self.layout())]

    def thinker_stages(self) -> list[str]:
        """The deployed thinker stages (those taking the thinker's call), in data-flow order."""
        return [s.name for s in self.graph.deployed(self.layout()) if s.call is ThinkerCall]

    def text_stage(self) -> str:
        """The stage whose outputs are the response's text tokens."""
        (stage,) = [s.name for s in self.graph.deployed(self.layout()) if TextDelta in s.outputs]
        return stage

    def thinker_params(self) -> ThinkerParams:
        """Text-generation settings (those of ``text_stage()``)."""
        return self.stage_spec(self.text_stage()).params


class OmniGraphSpec(ThinkerTalkerSpec, OmniAudioSpec, OmniMediaSpec, GraphSpecBase):
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

