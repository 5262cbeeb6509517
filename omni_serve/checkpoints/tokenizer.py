"""Build small tokenizers locally (no hub access) for random-weight checkpoints.

Contract: ``build_qwen_tokenizer(special_tokens, vocab_size)`` returns a ``Qwen2TokenizerFast`` whose
special tokens occupy ids ``0..len(special_tokens)-1`` in the given order, followed by the 256 byte-level
symbols and learned merges. Byte-level pre-tokenization means any UTF-8 text encodes. ``build_t5_tokenizer(
vocab_size)`` returns a ``T5Tokenizer`` (a Unigram model with T5's whitespace and metaspace pre-tokenization, as
UMT5's: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``</s>`` appended to every text). The corpus is deterministic, so the
same arguments always give the same tokenizer.
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


def build_t5_tokenizer(vocab_size: int, model_max_length: int = 512):
    """Train a Unigram tokenizer with T5's pre-tokenization and wrap it as a transformers ``T5Tokenizer`` (backed by
    ``tokenizers`` in transformers 5: no sentencepiece model file), the special tokens in UMT5's ids."""
    import json

    from transformers import T5Tokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")])
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_corpus(4000), trainer=trainer)
    vocab = [tuple(piece) for piece in json.loads(tok.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


# The tool-calling part of Qwen's chat templates (Qwen2.5/Qwen3 and Qwen3-Omni's): the tools go at the end of the
# system turn, each as JSON on its own line; an assistant turn's calls follow its text as <tool_call> blocks; tool
# results come back in a user turn (consecutive ones together), each in a <tool_response> block.
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                  "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")


def omni_chat_template(audio: str, image: str, video: str) -> str:
    """The Omni checkpoints' chat template: string or list-of-parts content; each media part becomes its
    placeholder (``audio``, ``image``, ``video``: the bos + pad + eos tokens) that the processor expands to the
    right number of feature tokens. With ``tools``, Qwen's tool-calling layout (``TOOLS_PREAMBLE``): a conversation
    without tools renders as it would without that part."""
    content = (
        "{% macro render(content) %}"
        "{% if content is string %}{{ content }}"
        "{% else %}{% for part in content %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'audio' or part['type'] == 'input_audio' %}"
        f"{{{{ '{audio}' }}}}"
        "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}"
        f"{{{{ '{image}' }}}}"
        "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
        f"{{{{ '{video}' }}}}"
        "{% endif %}{% endfor %}{% endif %}"
        "{% endmacro %}"
    )
    tools = (
        "{% if tools %}{{ '<|im_start|>system\\n' }}"
        "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}{{ '\\n\\n' }}{% endif %}"
        "{{ preamble }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
        "{{ postamble }}{{ '<|im_end|>\\n' }}{% endif %}"
    ).replace("{{ preamble }}", "{{ " + _jinja_string(TOOLS_PREAMBLE) + " }}").replace(
        "{{ postamble }}", "{{ " + _jinja_string(TOOLS_POSTAMBLE) + " }}")
    messages = (
        "{% for message in messages %}"
        "{% if tools and loop.first and message['role'] == 'system' %}"
        "{% elif message['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' }}{{ render(message['content']) }}{{ '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ render(message['content']) }}"
        "{% if message['tool_calls'] %}{% set has_text = message['content'] %}"
        "{% for call in message['tool_calls'] %}"
        "{% if (loop.first and has_text) or not loop.first %}{{ '\\n' }}{% endif %}"
        "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
        "{{ '<tool_call>\\n{\"name\": \"' }}{{ call['name'] }}{{ '\", \"arguments\": ' }}"
        "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
        "{{ '}\\n</tool_call>' }}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return content + tools + messages


def _jinja_string(text: str) -> str:
    """``text`` as a Jinja string literal (a JSON string reads the same in Jinja)."""
    import json

    return json.dumps(text)
