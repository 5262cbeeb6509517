"""The API page's Python examples, run as written against the served Qwen2.5-Omni graph.

Every fenced ``python`` block of docs/api.md that talks to the server (``OpenAI(base_url="http://127.0.0.1:8000/v1"``)
and the blocks that continue it run in order in one namespace, in a scratch directory holding the files they open
(``question.wav``, ``picture.png``, ``clip.mp4``), with the server's address put in place of
``http://127.0.0.1:8000``. They must run without an error and write what they say they write. (The ``bash`` blocks
are the same requests with curl; they are not run here.)
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import soundfile as sf
from PIL import Image

from tests.omni_cases import audio_clip, video_bytes

pytestmark = pytest.mark.integration
API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ADDRESS = "http://127.0.0.1:8000"


def python_blocks() -> list[str]:
    """The API page's python blocks from the first that makes a client to the last that uses one."""
    blocks = re.findall(r"```python\n(.*?)```", API_PAGE.read_text(), flags=re.S)
    first = next(i for i, b in enumerate(blocks) if f'OpenAI(base_url="{ADDRESS}/v1"' in b)
    return [b for b in blocks[first:] if "client." in b]


def test_the_api_page_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3  # chat (non-streaming and streamed), media input, speech and transcription
    text = "\n".join(blocks)
    for call in ("chat.completions.create", "audio.speech.create", "audio.speech.with_streaming_response",
                 "audio.transcriptions.create"):
        assert call in text


def test_the_api_page_python_examples_run(omni_app, tmp_path, monkeypatch, capsys):
    buf = io.BytesIO()
    sf.write(buf, audio_clip(), 16000, format="WAV")
    (tmp_path / "question.wav").write_bytes(buf.getvalue())
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "picture.png")
    (tmp_path / "clip.mp4").write_bytes(video_bytes())
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks():
        exec(compile(block.replace(ADDRESS, omni_app), "docs/api.md", "exec"), namespace)  # noqa: S102
    assert sf.info(str(tmp_path / "reply.wav")).samplerate == 24000
    assert (tmp_path / "hello.mp3").stat().st_size > 0 and sf.info(str(tmp_path / "hello.wav")).samplerate == 24000
    printed = capsys.readouterr().out
    assert "seconds of audio" in printed
