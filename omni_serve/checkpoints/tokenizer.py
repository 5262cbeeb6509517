"""Build a small byte-level BPE tokenizer locally (no hub access) for random-weight checkpoints.

Contract: ``build_qwen_tokenizer(special_tokens, vocab_size)`` returns a ``Qwen2TokenizerFast`` whose
special tokens occupy ids ``0..len(special_tokens)-1`` in the given order, followed by the 256 byte-level
symbols and learned merges. Byte-level pre-tokenization means any UTF-8 text encodes; the corpus is
deterministic, so the same arguments always give the same tokenizer.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part sound voice image picture audio speech music listen speak hello world thanks "
    "please answer question model serve stage graph token stream batch cache fast small tiny random test "
    "red green blue cat dog bird tree sky sun moon rain snow wind river sea mountain city road house car"
).split()


def _corpus(lines: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(sentence + " " + str(rng.randint(0, 999)))
    return out


def build_qwen_tokenizer(
    special_tokens: list[str], vocab_size: int, extra_special: dict[str, str], chat_template: str,
    extra_corpus: list[str] | None = None,
):
    """Train a byte-level BPE tokenizer and wrap it as a transformers ``Qwen2TokenizerFast``.

    ``extra_corpus``: more training lines (e.g. a prompt template, so that its words become single tokens
    as they are in the real tokenizer)."""
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000) + list(extra_corpus or ()), trainer=trainer)
    for i, t in enumerate(special_tokens):
        assert tok.token_to_id(t) == i, f"special token {t} should have id {i}"
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        extra_special_tokens=extra_special,
        chat_template=chat_template,
        model_max_length=32768,
    )


def omni_chat_template(audio: str, image: str, video: str) -> str:
    """The Omni checkpoints' chat template: string or list-of-parts content; each media part becomes its
    placeholder (``audio``, ``image``, ``video``: the bos + pad + eos tokens) that the processor expands to the
    right number of feature tokens."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'audio' or part['type'] == 'input_audio' %}"
        f"{{{{ '{audio}' }}}}"
        "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}"
        f"{{{{ '{image}' }}}}"
        "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
        f"{{{{ '{video}' }}}}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
