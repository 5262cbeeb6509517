"""Deterministic benchmark workload: N chat requests from a seed.

Contract: ``build_workload(WorkloadConfig) -> list[BenchRequest]`` is a pure function of the config: the
same config always gives the same prompts, lengths and per-request seeds (``random.Random(seed)``, no
global state). Prompt lengths are drawn uniformly in ``[min_words, max_words]`` words from a fixed word
list. ``BenchRequest.body(model)`` is the OpenAI chat-completions JSON body the HTTP client sends
(``stream: true`` with ``stream_options.include_usage`` so the server reports exact token counts;
``min_tokens``, omni_serve's vLLM-style extension, only when set, e.g. equal to ``max_tokens`` to fix
output lengths);
``BenchRequest.messages()`` is the user turn the in-process baselines feed through the same chat template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience effect "
    "class control care field development role effort rate heart drug show leader light voice wife police "
    "mind price report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official matter "
    "center couple site project activity star table need court oil situation cost industry figure street "
    "image phone data picture practice piece land product doctor wall patient worker news test movie north "
    "love support technology step baby computer type attention film tree source organization hair window "
    "evidence population site garden river mountain ocean island forest desert bridge train station"
).split()

PROMPT_LEADS = (
    "Tell me about", "Describe", "Explain briefly", "Write a sentence about", "What do you think of",
    "Summarize", "Say something about", "Give me a fact about",
)


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 16
    seed: int = 0
    max_tokens: int = 64
    min_tokens: int = 0  # > 0: sent as omni_serve's ``min_tokens`` (no stop token before that many tokens)
    audio: bool = True  # modalities ["text", "audio"] with audio {voice, format: pcm16}
    voice: str = "Chelsie"
    temperature: float = 0.0  # 0 = greedy (thinker and talker)
    top_p: float | None = None
    min_words: int = 4
    max_words: int = 48

    def __post_init__(self):
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 0 <= min_tokens <= max_tokens")
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError("need 1 <= min_words <= max_words")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    seed: int
    max_tokens: int
    temperature: float
    audio: bool
    voice: str
    top_p: float | None = None
    min_tokens: int = 0

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI messages (no system message: the server adds its default one)."""
        return [{"role": "user", "content": self.prompt}]

    def body(self, model: str, *, stream: bool = True, include_usage: bool = True,
             return_token_ids: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stream": stream,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.min_tokens:
            body["min_tokens"] = self.min_tokens
        if stream and include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.audio:
            body["modalities"] = ["text", "audio"]
            body["audio"] = {"voice": self.voice, "format": "pcm16"}
        else:
            body["modalities"] = ["text"]
        if return_token_ids:
            body["return_token_ids"] = True
        return body


def build_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.num_requests):
        n = rng.randint(cfg.min_words, cfg.max_words)
        lead = rng.choice(PROMPT_LEADS)
        words = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(BenchRequest(
            index=i, prompt=f"{lead} {words}.", seed=rng.randrange(2**31), max_tokens=cfg.max_tokens,
            temperature=cfg.temperature, audio=cfg.audio, voice=cfg.voice, top_p=cfg.top_p,
            min_tokens=cfg.min_tokens))
    return out
