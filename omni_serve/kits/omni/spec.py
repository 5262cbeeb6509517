"""The spec sections every Omni family shares: media input limits (``OmniMediaSpec``), the audio routes and the
chat stream format (``OmniAudioSpec``), and ``ThinkerTalkerSpec``, what the Omni frontend asks of a
thinker-talker spec. A family's graph spec mixes them in with its own fields and ``stages``/``edges`` sections.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from omni_serve.api.video import VideoLimits
from omni_serve.graph.graph import GraphDef
from omni_serve.kits.omni.messages import TextDelta, ThinkerCall
from omni_serve.kits.omni.params import ThinkerParams
from omni_serve.realtime_admission import AdmissionSpec


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


class PlaybackSpec(BaseModel):
    """What the graph promises a listening client, and what it assumes of it (docs/speech_under_load.md). The
    audio stages schedule their work by each stream's deadline: its first audio ``target_ttfp_s`` after the request
    arrived, then the moment the client's buffer would run dry."""

    target_ttfp_s: float = Field(1.0, gt=0, description=(
        "Time to first audio the audio stages aim for: the deadline of a stream's first chunk, and with admission "
        "'queue' the first audio a waiting request is held to (it waits only while it can still meet it). Lower "
        "puts new streams' first chunks further ahead of other streams' later ones, and sends more 429s."))
    client_buffer_s: float = Field(0.5, ge=0, description=(
        "Seconds a client waits after its first audio before it starts playing (its jitter buffer). A stream's "
        "next chunk is due when the audio sent so far would have played out; the served stall metrics assume "
        "the same client. Larger lets the server batch more, at the cost of the listener's delay."))
    talker_lead_s: float | None = Field(None, gt=0, description=(
        "How far ahead of its client's playback the talker keeps a stream its client plays as it comes (a streamed "
        "reply, speech, a realtime answer): below this lead the stream's talker steps are due, up to twice it they "
        "only join steps other streams run, beyond it they wait. Lower leaves more CPU to new streams' openings "
        "and code2wav; too low starves code2wav's next chunk (it needs a chunk and its right context ahead). Off "
        "(null) by default: admission by the delivered rate reads a paced stream's pace as the graph's capacity. "
        "null: the talker runs every stream as fast as it can. Replies that are not streamed are never paced."))
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec, description=(
        "Whether a new audio stream waits, or gets a 429, while the graph's measured real-time capacity cannot "
        "take it without slowing the streams it plays."))


class OmniAudioSpec(BaseModel):
    """How the Qwen-Omni graphs speak to clients: the chat stream's shape and the audio endpoints."""

    playback: PlaybackSpec = Field(default_factory=PlaybackSpec, description=(
        "Streamed speech: the first-audio target and the client buffer the audio stages schedule for."))

    chat_stream_format: Literal["openai", "vllm_omni"] = Field("openai", description=(
        "Shape of streamed chat replies: 'openai' (text of an audio reply as delta.audio.transcript pieces, "
        "pcm16 audio in delta.audio.data) or 'vllm_omni' (vLLM-Omni's: a modality on every chunk, each audio "
        "chunk a complete base64 WAV in delta.content). Requests choose per call with the X-Omni-Stream-Format "
        "header."))
    speech: SpeechSpec = Field(default_factory=SpeechSpec, description="POST /v1/audio/speech.")
    transcription: TranscriptionSpec = Field(default_factory=TranscriptionSpec,
                                             description="POST /v1/audio/transcriptions.")


class ThinkerTalkerSpec:
    """What the Omni frontend asks a thinker-talker spec (mixed into each Omni family's graph spec, which names
    its ``graph``): the stages deployed for the spec's ``layout()`` and which of them thinks."""

    graph: ClassVar[GraphDef]  # the family's graph declaration

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
