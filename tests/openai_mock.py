"""The official ``openai`` client pointed at an in-process ``httpx.MockTransport``: ``make_client(Recorder(reply))``
records the JSON bodies the client sends (``recorder.bodies``) and answers each with the canned ``reply``, which the
client must parse back."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai


class Recorder:
    """MockTransport handler: records request bodies, replies with a canned response."""

    def __init__(self, reply: httpx.Response) -> None:
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return self.reply


def make_client(recorder: Recorder) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url="http://omni.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(recorder)))
