"""Chat messages + decoded media -> Qwen-Omni model inputs, through transformers' own processor.

Contract: ``OmniInputProcessor(checkpoint_dir, video_fps)(messages, audios, images, videos, use_audio_in_video,
tools) -> OmniInputs``. ``messages`` use the chat template's part types (``text``, ``audio``, ``image``, ``video``) in
order (``tools``: the functions the chat template shows the model, in OpenAI's shape; ``renders_tools`` says
whether the checkpoint's template shows them at all); ``audios`` are mono float32 clips at ``sampling_rate`` (16 kHz), ``images`` PIL images and ``videos``
``DecodedVideo``s (``omni_serve.api.video``: the sampled RGB frames and, for ``use_audio_in_video``, the audio
track), each in the order their parts appear. The work is done by the checkpoint's ``AutoProcessor`` —
``Qwen2_5OmniProcessor`` or ``Qwen3OmniMoeProcessor`` — as it is: its chat template, tokenizer, Whisper feature
extractor, Qwen2-VL image and video processors, placeholder expansion, and the interleaving of a video's audio
and video tokens in time (``load_audio_from_video``). CPU preprocessing only: no model weights.

What we hand the processor instead of letting it do it, and why (the outputs are those of its default call:
``tests/unit/test_omni_inputs.py`` checks each point against it):

- **Video decoding and frame sampling.** The processor decodes videos from paths or URLs; a request's video is
  an in-memory data URL whose limits must be checked before decoding. ``omni_serve.api.video`` decodes only
  the frames that the processor's own ``video_processor.sample_frames`` picks at ``video_fps`` (as
  transformers' PyAV reader does), and the processor is called with ``do_sample_frames=False`` and the same
  ``fps`` (which sets ``video_second_per_grid``).
- **A video's audio track.** The processor loads it only through torchcodec (not installable beside the CPU
  torch here); the decoded track is passed as the audio of that video's slot (``audio_from_video_indices``),
  which the processor supports for callers that decoded it.
- **Audio padding length (Qwen2.5-Omni).** Its processor pads every clip to the feature extractor's
  ``n_samples`` (300 s, a [128, 30000] tensor per clip: two short clips took ~420 ms against ~4 ms padded to the
  longest, ``benchmarks/qwen2_5_omni/omni_inputs_cost.py``). We pass ``max_length`` = the longest clip plus one FFT window:
  every frame the attention mask keeps is computed from the same samples and the same zero padding, so the kept
  frames are identical and the encoder (which reads only those) sees the same input. (Qwen3-Omni's processor
  pads to the longest clip already; the setting changes nothing there.)

torchvision (which transformers' image and video processors need) is the CPU-incompatible PyPI build: its
compiled ops do not load and are never called here; ``omni_serve.torchvision_compat`` lets it import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from omni_serve.torchvision_compat import install_hook

DEFAULT_VIDEO_FPS = 2.0  # frames sampled per second of video (Qwen-Omni's reference utilities sample at 2)


@dataclass
class OmniInputs:
    input_ids: torch.Tensor  # [1, L] long
    input_features: torch.Tensor | None = None  # [n_audio, mel, frames]
    feature_attention_mask: torch.Tensor | None = None  # [n_audio, frames]
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim]
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [patches, patch_dim]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    video_second_per_grid: torch.Tensor | None = None  # [n_videos] seconds per temporal patch
    use_audio_in_video: bool = False  # each video's audio tokens are interleaved with its video tokens

    @classmethod
    def from_batch(cls, batch: Any, use_audio_in_video: bool = False) -> "OmniInputs":
        """From a processor's output (``BatchFeature`` with ``return_tensors="pt"``)."""
        names = {f.name for f in fields(cls)} - {"use_audio_in_video"}
        return cls(**{k: batch[k] for k in names if k in batch}, use_audio_in_video=use_audio_in_video)

    @property
    def audio_seqlens(self) -> torch.Tensor | None:
        return None if self.feature_attention_mask is None else self.feature_attention_mask.sum(-1)

    @property
    def has_media(self) -> bool:
        return any(x is not None for x in (self.input_features, self.pixel_values, self.pixel_values_videos))

    def reference_kwargs(self) -> dict:
        """The keyword arguments transformers' ``generate`` takes for these inputs.

        Pixel values go with the ``thinker_`` prefix: transformers 5.23 otherwise also hands them to the
        talker, whose ``generate`` rejects them.
        """
        kw: dict = {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids)}
        if self.input_features is not None:
            kw.update(input_features=self.input_features, feature_attention_mask=self.feature_attention_mask)
        if self.pixel_values is not None:
            kw.update(thinker_pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        if self.pixel_values_videos is not None:
            kw.update(thinker_pixel_values_videos=self.pixel_values_videos, video_grid_thw=self.video_grid_thw,
                      video_second_per_grid=self.video_second_per_grid, use_audio_in_video=self.use_audio_in_video)
        return kw


class OmniInputProcessor:
    """The checkpoint's Qwen-Omni processor with the hand-overs of the module doc."""

    def __init__(self, checkpoint_dir: str, video_fps: float = DEFAULT_VIDEO_FPS):
        install_hook()
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(checkpoint_dir)
        self.tokenizer = self.processor.tokenizer
        self.feature_extractor = self.processor.feature_extractor
        self.sampling_rate = self.feature_extractor.sampling_rate
        self.video_fps = float(video_fps)
        probe = [{"role": "user", "content": [{"type": "text", "text": "?"}]}]
        tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
        self.renders_tools = self.render(probe, [tool]) != self.render(probe)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.processor.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)

    def sample_frames(self, header) -> list[int]:
        """The frame indices the processor samples from a video with this header (``api.video.VideoHeader``)."""
        from transformers.video_utils import VideoMetadata

        meta = VideoMetadata(total_num_frames=header.total_num_frames, fps=header.fps, width=header.width,
                             height=header.height, duration=header.duration)
        return [int(i) for i in self.processor.video_processor.sample_frames(meta, fps=self.video_fps)]

    def __call__(self, messages: list[dict], audios: list[np.ndarray] = (), images: list = (), videos: list = (),
                 use_audio_in_video: bool = False, tools: list[dict] | None = None) -> OmniInputs:
        if use_audio_in_video and any(v.audio is None for v in videos):
            raise ValueError("use_audio_in_video needs an audio track in every video")
        use_audio_in_video = use_audio_in_video and bool(videos)
        clips, slots = _audio_slots(messages, list(audios), list(videos), use_audio_in_video)
        kwargs: dict = {"return_tensors": "pt"}
        if clips:
            longest = max(len(c) for c in clips) + self.feature_extractor.n_fft
            kwargs["audio_kwargs"] = {"max_length": min(longest, self.feature_extractor.n_samples)}
        if videos:
            kwargs["videos_kwargs"] = {"do_sample_frames": False, "fps": self.video_fps}
            if use_audio_in_video:
                kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
        batch = self.processor(text=[self.render(messages, tools)], audio=clips or None, images=list(images) or None,
                               videos=[v.frames for v in videos] or None, **kwargs)
        return OmniInputs.from_batch(batch, use_audio_in_video)


def _audio_slots(messages: list[dict], audios: list, videos: list, use_audio_in_video: bool):
    """The clips in prompt order and, per clip, the video it comes from (None: a standalone clip)."""
    if not use_audio_in_video:
        return audios, None
    clips, slots, a, v = [], [], iter(audios), 0
    for msg in messages:
        for part in msg["content"] if isinstance(msg["content"], list) else ():
            if part["type"] == "audio":
                clips.append(next(a))
                slots.append(None)
            elif part["type"] == "video":
                clips.append(videos[v].audio)
                slots.append(v)
                v += 1
    return clips, slots
