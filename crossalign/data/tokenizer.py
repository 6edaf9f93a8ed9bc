"""A byte-level BPE tokenizer trained on the shipped corpus; both frameworks read the same tokenizer.json.

Byte-level BPE covers every byte, so no text is ever out of vocabulary. The end-of-document
token is the first special token (id 0); ``prepare`` appends it to every document, as
Megatron's ``preprocess_data.py --append-eod`` does.
"""

from __future__ import annotations

from pathlib import Path

EOD_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 byte symbols plus the end-of-document token


def train_tokenizer(documents: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer with at most ``vocab_size`` tokens (deterministic for the same input)."""
    # tokenizers: only data preparation needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size: {vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + the end-of-document token)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def load_tokenizer(path: Path):
    """The tokenizer saved by ``prepare``."""
    # tokenizers: only data preparation needs it
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def eod_id(tokenizer) -> int:
    """The id of the end-of-document token."""
    token_id = tokenizer.token_to_id(EOD_TOKEN)
    if token_id is None:
        raise ValueError(f"tokenizer has no end-of-document token {EOD_TOKEN!r}")
    return token_id
