"""Speech test helpers: the prompt the speech endpoint builds, and transformers' thinker forced to a reply.

``speech_prompt`` is what ``/v1/audio/speech`` builds (``omni_serve.kits.omni.audio_endpoints``): a
system turn and a user turn holding the text; the forced reply is the text's tokens and ``<|im_end|>``.
``ForcedThinker`` (the speech benchmark's, ``benchmarks.qwen2_5_omni.speech_baseline``) replaces a transformers Omni model's
``thinker.generate`` with one forward over the prompt and the forced reply, shaped as generate's output, so the
model's own ``generate`` drives its talker and vocoder from exactly those states.
"""

from __future__ import annotations

import torch

from benchmarks.qwen2_5_omni.speech_baseline import ForcedThinker


def speech_prompt(proc, text: str, system: str):
    """What the speech endpoint builds: the prompt (system + user turn with the text) and the forced reply."""
    turns = [{"role": "system", "content": [{"type": "text", "text": system}]},
             {"role": "user", "content": [{"type": "text", "text": text}]}]
    x = proc(turns, [], [])
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return x, proc.tokenizer.encode(text, add_special_tokens=False) + [im_end]


def qwen2_5_speech(model, x, forced, talker_tokens: int, steps: int, seed: int, voice: str = "Chelsie"):
    """(codec ids, waveform) of Qwen2.5-Omni's generate, greedy talker, thinker forced to ``forced``."""
    codes = []
    hook = model.token2wav.register_forward_pre_hook(lambda m, a: codes.append(a[0][0].tolist()))
    try:
        with ForcedThinker(model, forced):
            torch.manual_seed(seed)
            _, wav = model.generate(**x.reference_kwargs(), speaker=voice, talker_max_new_tokens=talker_tokens,
                                    talker_do_sample=False, token2wav_num_steps=steps)
    finally:
        hook.remove()
    return codes[0], wav.numpy()


def qwen3_speech(model, x, forced, talker_tokens: int, voice: str = "ethan"):
    """(codec frames, waveform) of Qwen3-Omni's generate, greedy talker, thinker forced to ``forced``."""
    caught = []
    decode = model.code2wav.chunked_decode
    model.code2wav.chunked_decode = lambda codes, **kw: (caught.append(codes), decode(codes, **kw))[1]
    try:
        with ForcedThinker(model, forced):
            _, wav = model.generate(**x.reference_kwargs(), speaker=voice, talker_do_sample=False,
                                    talker_max_new_tokens=talker_tokens)
    finally:
        del model.code2wav.chunked_decode
    return caught[0][0].T.tolist(), wav.reshape(-1).numpy()
