"""The Qwen2.5-Omni graph spec: stages, edges and defaults (overridable from Python, CLI or YAML).

Two layouts of the thinker (``OmniGraphSpec.thinker_layout``), the same code either way:
``aggregated`` deploys one ``thinker`` stage; ``disaggregated`` deploys ``thinker_prefill`` (computes the
prompt's KV) and ``thinker_decode`` (generates), joined by the ``thinker_prefill.thinker_decode`` edge.
``deployed_stages()`` lists what ``build_app`` deploys; ``text_stage()`` names the stage whose outputs are
the response text and whose ``params`` hold the text-generation settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.graphs.spec import EdgeSpec, GraphSpecBase, IngressSpec, SpecModel, StageSpec
from omni_serve.transport.config import DataPlaneSpec


class ThinkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int = Field(256, ge=1, description="Text tokens generated when a request sets no limit.")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + output token limit; default: the model's.")
    default_temperature: float = Field(1.0, ge=0, le=2, description="Temperature when the request sets none.")


class TalkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_codec_tokens: int = Field(1024, ge=1, description="Codec tokens per response at most (50 per second of audio).")
    temperature: float = Field(0.9, ge=0, description="Codec sampling temperature (0: greedy). Requests with temperature 0 decode greedily.")
    top_k: int = Field(40, ge=0, description="Codec top-k (0: off).")
    top_p: float = Field(0.8, gt=0, le=1, description="Codec top-p.")
    repetition_penalty: float = Field(1.05, gt=0, description="Codec repetition penalty (as transformers' generate).")


class Code2WavParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_steps: int = Field(10, ge=1, le=64, description="Flow-matching ODE steps of the DiT.")
    guidance_scale: float = Field(0.5, ge=0, description="Classifier-free guidance scale of the DiT.")
    sway_coefficient: float = Field(-1.0, description="Sway sampling coefficient of the ODE time grid.")
    first_chunk_codes: int = Field(12, ge=1, description=(
        "Codec tokens in the first synthesized audio chunk (small = early first audio). Chunk sizes and "
        "contexts are multiples of the DiT block (block_size / repeats codes: 12 for Qwen2.5-Omni)."))
    chunk_codes: int = Field(96, ge=1, description="Codec tokens per later audio chunk.")
    left_context_codes: int = Field(12, ge=0, description="Codes before a chunk the DiT sees (seam accuracy).")
    right_context_codes: int = Field(12, ge=0, description=(
        "Codes after a chunk the DiT sees; a chunk waits for them (or the end of speech)."))
    vocoder_context_frames: int = Field(8, ge=0, description="Mel frames of context on each side of a vocoder chunk.")
    max_batch: int = Field(16, ge=1, description="Equally long windows of different requests solved in one batch.")


class EncoderStage(StageSpec):
    pass


class ThinkerStage(StageSpec):
    params: ThinkerParams = Field(default_factory=ThinkerParams, description="Thinker settings.")


class ThinkerPrefillStage(StageSpec):
    pass


class TalkerStage(StageSpec):
    params: TalkerParams = Field(default_factory=TalkerParams, description="Talker settings.")


class Code2WavStage(StageSpec):
    params: Code2WavParams = Field(default_factory=Code2WavParams, description="code2wav settings.")


class OmniStages(SpecModel):

    encoder: EncoderStage = Field(default_factory=lambda: EncoderStage(num_cpus=0.25), description="Audio + vision towers.")
    thinker: ThinkerStage = Field(default_factory=ThinkerStage, description=(
        "Text decoder (autoregressive): prompt and generation. Deployed in the aggregated thinker layout."))
    thinker_prefill: ThinkerPrefillStage = Field(
        default_factory=lambda: ThinkerPrefillStage(num_cpus=0.25), description=(
            "Disaggregated thinker layout: computes each prompt's KV cache (media embeddings from the encoder) "
            "and hands it to thinker_decode; never generates."))
    thinker_decode: ThinkerStage = Field(default_factory=ThinkerStage, description=(
        "Disaggregated thinker layout: adopts prefilled prompts and generates text and talker states. Its "
        "params are the text-generation settings in that layout."))
    talker: TalkerStage = Field(default_factory=TalkerStage, description="Codec decoder (autoregressive).")
    code2wav: Code2WavStage = Field(default_factory=lambda: Code2WavStage(num_cpus=0.25), description="DiT + BigVGAN vocoder.")


class OmniEdges(SpecModel):

    encoder_thinker: EdgeSpec = Field(default_factory=EdgeSpec, description="Media embeddings to the thinker.")
    thinker_talker: EdgeSpec = Field(default_factory=lambda: EdgeSpec(chunk_size=8, first_chunk_size=1),
                                     description="Thinker states to the talker (chunk = generated tokens).")
    thinker_prefill_thinker_decode: EdgeSpec = Field(default_factory=EdgeSpec, description=(
        "Disaggregated thinker layout: one prompt hand-off per request (prompt KV, embeddings, last logits, "
        "prompt states) from thinker_prefill to thinker_decode; chunk sizes do not apply."))
    talker_code2wav: EdgeSpec = Field(default_factory=lambda: EdgeSpec(chunk_size=12, first_chunk_size=24),
                                      description=("Codec tokens to code2wav (the first chunk covers code2wav's "
                                                   "first audio chunk and its right context)."))


class OmniGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local Qwen2.5-Omni checkpoint directory (Hugging Face layout).")
    model_name: str = Field("qwen2.5-omni", description="Model id served at /v1/models and accepted in requests.")
    default_voice: str = Field("Chelsie", description="Voice used when a request asks for audio without one.")
    system_prompt: str | None = Field(
        None, description="System prompt added when a request has none (default: the checkpoint's speech prompt).")
    max_audio_seconds: float = Field(60.0, gt=0, description="Longest input audio clip accepted.")
    max_image_pixels: int = Field(4096 * 4096, gt=0, description="Largest input image accepted (pixels).")
    data_timeout_s: float = Field(60.0, gt=0, description="How long a stage waits for an upstream chunk.")
    thinker_layout: Literal["aggregated", "disaggregated"] = Field("aggregated", description=(
        "'aggregated': one thinker stage runs prompt and generation. 'disaggregated': thinker_prefill computes "
        "the prompt's KV and hands it through the thinker_prefill_thinker_decode edge to thinker_decode, which "
        "generates (each scales and is placed on its own); outputs are identical."))
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="HTTP ingress deployment.")
    stages: OmniStages = Field(default_factory=OmniStages, description="One deployment per stage.")
    edges: OmniEdges = Field(default_factory=OmniEdges, description="Data-plane settings per edge.")
    data_plane: DataPlaneSpec = Field(default_factory=DataPlaneSpec, description=(
        "Settings of the data-plane backends the edges use (shared memory, Mooncake)."))

    def thinker_stages(self) -> list[str]:
        """The deployed thinker stages, in data-flow order."""
        return ["thinker"] if self.thinker_layout == "aggregated" else ["thinker_prefill", "thinker_decode"]

    def deployed_stages(self) -> list[str]:
        """Every stage ``build_app`` deploys for this layout, in data-flow order."""
        return ["encoder", *self.thinker_stages(), "talker", "code2wav"]

    def text_stage(self) -> str:
        """The stage whose outputs are the response's text tokens."""
        return self.thinker_stages()[-1]

    def thinker_params(self) -> ThinkerParams:
        """Text-generation settings (those of ``text_stage()``)."""
        return getattr(self.stages, self.text_stage()).params
