"""VibeVoice's prompt, from its processor alone (no model code: the ingress builds it): a script's turns and each
speaker's voice length -> the prompt's token ids, as ``VibeVoiceProcessor`` renders and expands them.

Contract:
- ``parse_script(script)``: ``"Speaker 0: ...\\nSpeaker 1: ..."`` -> ``[("0", "..."), ("1", "...")]``; a line without
  a speaker continues the previous turn, and a script without any is one turn of speaker 0.
- ``speakers_of(turns)``: the speakers in first-appearance order (the order of the prompt's voice lines).
- ``prompt_ids(processor, turns, frames)``: the checkpoint's chat template over the turns (one ``Speaker <id>:`` line
  per turn, line breaks inside a turn made spaces; one voice line per speaker), each speaker's voice placeholder
  expanded to ``frames[speaker]`` rows (one per 3200 samples of its clip), tokenized. ``ValueError`` when a turn has
  no text, a speaker has no voice length or a voice no speaker.
- ``voice_frames(samples, hop)``: placeholder rows of a clip of ``samples`` samples.
"""

from __future__ import annotations

import math
import re

_SPEAKER_LINE = re.compile(r"^\s*Speaker\s+(\w+)\s*:\s*(.*)$")


def parse_script(script: str) -> list[tuple[str, str]]:
    turns: list[tuple[str, str]] = []
    for line in script.splitlines():
        if not line.strip():
            continue
        m = _SPEAKER_LINE.match(line)
        if m:
            turns.append((m.group(1), m.group(2).strip()))
        elif turns:
            turns[-1] = (turns[-1][0], f"{turns[-1][1]} {line.strip()}".strip())
        else:
            turns.append(("0", line.strip()))
    return turns


def speakers_of(turns: list[tuple[str, str]]) -> list[str]:
    return list(dict.fromkeys(str(s) for s, _ in turns))


def voice_frames(samples: int, hop: int = 3200) -> int:
    return math.ceil(samples / hop)


def prompt_ids(processor, turns: list[tuple[str, str]], frames: dict[str, int]) -> list[int]:
    # a turn is one template line: line breaks inside it become spaces, the rest of the text is kept as given
    turns = [(str(s), re.sub(r"\s*\n\s*", " ", str(t).strip())) for s, t in turns]
    if not turns or any(not t for _, t in turns):
        raise ValueError("the script needs at least one turn, and every turn some text")
    speakers = speakers_of(turns)
    frames = {str(k): v for k, v in frames.items()}
    missing, unused = [s for s in speakers if s not in frames], sorted(set(frames) - set(speakers))
    if missing or unused:
        raise ValueError(f"every speaker needs one voice: missing {missing}, not in the script {unused}")
    if any(frames[s] < 1 for s in speakers):
        raise ValueError("every voice needs some audio")
    seen, messages = set(), []
    for s, text in turns:
        content = [{"type": "text", "text": text}]
        if s not in seen:  # the template makes one voice line per speaker with an audio part
            content.append({"type": "audio", "audio": "voice"})
            seen.add(s)
        messages.append({"role": s, "content": content})
    text = processor.apply_chat_template(messages, tokenize=False)
    pad = processor.audio_token
    parts = text.split(pad)
    if len(parts) != len(speakers) + 1:
        raise ValueError(f"the template rendered {len(parts) - 1} voice placeholders for {len(speakers)} speakers")
    text = parts[0] + "".join(pad * frames[s] + rest for s, rest in zip(speakers, parts[1:]))
    return processor.tokenizer(text)["input_ids"]
