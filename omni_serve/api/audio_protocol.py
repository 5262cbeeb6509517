"""OpenAI's audio endpoints: ``POST /v1/audio/speech`` and ``POST /v1/audio/transcriptions`` (pydantic v2).

Contract: request models accept what the official ``openai`` client sends (``audio.speech.create``: JSON;
``audio.transcriptions.create``: multipart form with the file), unknown fields ignored; a bad field is a 400 naming
it (``omni_serve.api.errors``). Replies:
- speech: the audio file's bytes (``stream_format="audio"``, streamed as they are encoded), or server-sent events
  (``stream_format="sse"``): ``SpeechAudioDelta`` per chunk (``audio``: base64 of the file's next bytes), then one
  ``SpeechAudioDone`` with the usage;
- transcriptions: ``Transcription`` (``json``), the text alone (``text``), ``TranscriptionVerbose``
  (``verbose_json``: one segment spanning the file), or with ``stream=true`` ``TranscriptTextDelta`` events then
  one ``TranscriptTextDone``.
"""

from __future__ import annotations

from typing import Literal

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field

from omni_serve.api.speech_audio import MAX_SPEED, MIN_SPEED, SPEECH_FORMATS

MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit on `input`


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SpeechRequest(_Lenient):
    model: str = Field(description="Served model name.")
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT_CHARS, description="The text to speak.")
    voice: str = Field(description="A voice of the checkpoint (GET /v1/models does not list them; a 400 names them).")
    instructions: str | None = Field(default=None, description="Accepted and ignored (the Qwen-Omni talker has no "
                                                               "style control).")
    response_format: Literal[SPEECH_FORMATS] = Field(default="mp3", description=(
        "mp3, opus (in Ogg), aac (ADTS), flac, wav or pcm (raw int16 little-endian, 24 kHz mono)."))
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED, description=(
        "Tempo of the speech, 0.25-4.0 (pitch kept: FFmpeg's atempo)."))
    stream_format: Literal["audio", "sse"] = Field(default="audio", description=(
        "'audio': the file's bytes, streamed as they are encoded; 'sse': speech.audio.delta events, then "
        "speech.audio.done."))
    seed: int | None = Field(default=None, ge=0, lt=2**31, description=(
        "omni_serve extension: seed of the talker's sampling (reproducible speech)."))
    temperature: float | None = Field(default=None, ge=0, le=2, description=(
        "omni_serve extension: 0 draws the codec tokens greedily; otherwise (the default) the talker samples with "
        "its stage's settings (stages.talker.params)."))
    voice_reference: str | None = Field(default=None, max_length=16 << 20, description=(
        "omni_serve extension, voice-cloning models (VibeVoice): base64 of an audio file (wav, mp3, flac, ogg) whose "
        "speaker the speech takes, instead of a named voice; its graph bounds its size and duration."))
    speaker_voices: dict[str, str] | None = Field(default=None, max_length=8, description=(
        "omni_serve extension, multi-speaker models (VibeVoice): speaker id -> voice name, for an input written as "
        "'Speaker 0: ...' lines; `voice` then names no one's voice."))


class SpeechUsage(BaseModel):
    input_tokens: int = Field(description="Tokens of the spoken text.")
    output_tokens: int = Field(description="Codec tokens (frames) generated.")
    total_tokens: int = Field(description="input_tokens + output_tokens.")


class SpeechAudioDelta(BaseModel):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str = Field(description="Base64 of the audio file's next bytes.")


class SpeechAudioDone(BaseModel):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage


class TranscriptionRequest(_Lenient):
    """The multipart form of ``audio.transcriptions.create``."""

    file: UploadFile = Field(description="The audio file: wav, mp3, flac, ogg, or any container FFmpeg reads (m4a, "
                                         "mp4, webm, ...).")
    model: str = Field(description="Served model name.")
    language: str | None = Field(default=None, max_length=64, description=(
        "The audio's language (a name or an ISO-639-1 code), told to the model."))
    prompt: str | None = Field(default=None, max_length=4096, description=(
        "Text that precedes the audio or spells its words, given to the model as context."))
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = Field(default="json", description=(
        "json, text or verbose_json (srt and vtt need timestamps this model does not produce: a 400)."))
    temperature: float = Field(default=0.0, ge=0, le=1, description="Sampling temperature (0: greedy).")
    stream: bool = Field(default=False, description=(
        "Stream transcript.text.delta events, then transcript.text.done."))
    timestamp_granularities: list[str] | None = Field(default=None, alias="timestamp_granularities[]",
                                                      description="Accepted; only 'segment' is answered.")


class TranscriptionUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Transcription(BaseModel):
    text: str
    usage: TranscriptionUsage | None = None


class TranscriptionSegment(BaseModel):
    id: int = 0
    seek: int = 0
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class TranscriptionVerbose(BaseModel):
    task: Literal["transcribe"] = "transcribe"
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: dict | None = None


class TranscriptTextDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TranscriptionUsage | None = None


# -- registered voices (omni_serve's voices routes, voice-cloning graphs) ------------------------------------------
VOICE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class VoiceCreateForm(_Lenient):
    """The multipart form of ``POST /v1/audio/voices``."""

    name: str = Field(pattern=VOICE_NAME, description="The voice's name (letters, digits, '_', '.', '-'; names "
                                                      "match case-insensitively).")
    file: UploadFile = Field(description="The reference clip: an audio file (wav, mp3, flac, ogg) of one speaker.")


class VoiceRef(_Lenient):
    name: str = Field(pattern=VOICE_NAME, description="The voice's name.")


class VoicePage(_Lenient):
    """``GET /v1/audio/voices`` takes no parameters."""


class Voice(BaseModel):
    object: Literal["audio.voice"] = "audio.voice"
    id: str = Field(description="The name to give as `voice`.")
    created_at: int | None = Field(default=None, description="Unix seconds it was registered (None: a preset).")
    seconds: float = Field(description="Duration of its reference clip.")
    preset: bool = Field(description="A preset of the deployment (not deletable), or registered by this key.")


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Voice]


class VoiceDeleted(BaseModel):
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    id: str
    deleted: bool = True
