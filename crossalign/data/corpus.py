"""The text corpus shipped with crossalign, so that every machine builds byte-identical datasets.

``corpus/tinyshakespeare.txt`` is the "tiny Shakespeare" collection (1,115,394 bytes of
speeches from Shakespeare's plays, public domain), as published in
``data/tinyshakespeare/input.txt`` of github.com/karpathy/char-rnn. It is pinned by its
sha256: a modified copy would silently change every token id and sample order, so it is
refused instead.

A corpus document is one speech: the speaker's line and what they say, separated from the
next speech by a blank line (7,222 documents).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent / "corpus" / "tinyshakespeare.txt"
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


class CorpusError(ValueError):
    """The shipped corpus is missing or not the pinned one."""


def corpus_bytes(path: Path = CORPUS_PATH) -> bytes:
    """The corpus file, checked against its pinned digest."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read the shipped corpus ({exc.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(f"{path}: sha256 {digest} is not the pinned {CORPUS_SHA256}; "
                          "reinstall crossalign to restore the corpus")
    return data


def corpus_documents(path: Path = CORPUS_PATH) -> list[str]:
    """The corpus split into documents (speeches), in file order, without surrounding blank lines."""
    text = corpus_bytes(path).decode("utf-8")
    return [block.strip("\n") for block in text.split("\n\n") if block.strip()]
