"""The VibeVoice graph spec: voices (presets, uploaded references), request limits and defaults, plus the
``stages``/``edges`` sections derived from the graph declaration."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.families.vibevoice.graph import GRAPH
from omni_serve.families.vibevoice.params import LMParams, LMStage  # noqa: F401 - the spec's section types
from omni_serve.graph.spec import GraphSpecBase

VOICES_URL_ENV = "OMNI_SERVE_VOICES_URL"


class VoiceStoreSpec(BaseModel):
    """Where registered voices (``POST /v1/audio/voices``) are kept."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Serve the voices routes (false: presets only; the routes answer 404).")
    url: str | None = Field(None, description=(
        "SQLAlchemy URL of the voice database: default the environment's OMNI_SERVE_VOICES_URL, else a SQLite file "
        "under dir (one node only). Several ingress replicas share a PostgreSQL database "
        "('postgresql://user:password@host:5432/db')."))
    dir: str = Field("~/.omni_serve", description="Directory of the default SQLite database (voices.sqlite3).")
    max_voices_per_key: int = Field(32, ge=1, description="Voices an API key may register; one more is a 400.")

    def resolved_url(self) -> str:
        url = self.url or os.environ.get(VOICES_URL_ENV)
        if url:
            return url
        return "sqlite:///" + os.path.join(os.path.abspath(os.path.expanduser(self.dir)), "voices.sqlite3")


VibeVoiceStages = GRAPH.stages_model("VibeVoiceStages")
VibeVoiceEdges = GRAPH.edges_model("VibeVoiceEdges")


class VibeVoiceGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local VibeVoice checkpoint directory (transformers' layout).")
    model_name: str = Field("vibevoice", description="Model id served at /v1/models and accepted in requests.")
    voices_dir: str | None = Field(None, description=(
        "Directory of preset voices: one audio file (wav, flac, mp3, ogg) per voice, named by its file name without "
        "the extension; null: the checkpoint's voices/ directory, if it has one."))
    default_voice: str | None = Field(None, description=(
        "The voice of a request whose `voice` names none of the presets (null: such a request is a 400)."))
    max_voice_seconds: float = Field(30.0, gt=0, description="Longest reference clip accepted (seconds).")
    max_voice_bytes: int = Field(8 * 2**20, ge=1024, description="Largest reference clip accepted (bytes, decoded).")
    max_speakers: int = Field(4, ge=1, le=8, description="Most speakers in one script.")
    max_speech_seconds: float = Field(120.0, gt=0, description=(
        "Longest speech one request may produce (seconds; 7.5 speech tokens a second): its max_new_tokens."))
    voices: VoiceStoreSpec = Field(default_factory=VoiceStoreSpec, description=(
        "Registered voices: a reference clip uploaded once (POST /v1/audio/voices) and named in `voice` after."))
    stages: VibeVoiceStages = Field(default_factory=VibeVoiceStages, description="One deployment per stage.")
    edges: VibeVoiceEdges = Field(default_factory=VibeVoiceEdges, description="Data-plane settings per edge.")
