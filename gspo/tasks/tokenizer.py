"""A tiny character-level tokenizer for the built-in tasks and the tiny model presets.

One token per character keeps the vocabulary under 100 entries, so a randomly initialised
model of a few hundred thousand parameters can learn the arithmetic tasks on a CPU.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PUNCTUATION = "+-*=#;:,.()?!"
# Order fixes the ids: specials first so <pad> is 0, then the printable characters.
CHARACTERS = string.digits + PUNCTUATION + " \n" + string.ascii_lowercase + string.ascii_uppercase

# Messages are rendered as their bare contents, one per line. The generation prompt adds
# nothing, so a chat prompt made of one user message is the same text as the plain prompt
# and a model trained on either format reads the other.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{- message['content'] -}}"
    "{%- endfor -%}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id for the character tokenizer (specials, then one entry per character)."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer():
    """Build the character tokenizer as a `transformers.PreTrainedTokenizerFast`.

    Encoding never adds <bos>/<eos> (the trainer decides where they go); decoding joins
    characters with nothing in between, so `decode(encode(s)) == s` for any string made of
    vocabulary characters. Unknown characters map to <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<unk>"))
    # `[\s\S]` matches any single character, newline included (a bare `.` would not).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the token strings; the default would join them with spaces.
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        # Cleanup would rewrite " ." into "." and break the exact round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
