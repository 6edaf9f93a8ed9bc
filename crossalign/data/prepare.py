"""Build the shared dataset: tokenizer.json and a Megatron indexed dataset, reused when already complete.

Both training runs must read the same token ids (SPEC section 5). ``prepare_dataset`` trains a
byte-level BPE tokenizer on the shipped corpus and writes one indexed-dataset document per
corpus document, end-of-document token appended, with megatron-core's own
``IndexedDatasetBuilder`` (dtype chosen as Megatron does: uint16 below 65500 tokens).

Everything is written into a private staging folder inside ``out_dir`` and renamed into place,
``manifest.json`` last: an output is complete iff its manifest exists and every file still has
the digest it records, so an interrupted run is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy

from crossalign.data.corpus import CORPUS_SHA256, corpus_documents
from crossalign.data.files import DatasetFiles
from crossalign.data.mcore import quiet_megatron_import
from crossalign.data.tokenizer import EOD_TOKEN, eod_id, train_tokenizer

PREFIX_NAME = "corpus_text_document"
TOKENIZER_NAME = "tokenizer.json"
MANIFEST_NAME = "manifest.json"
CACHE_DIR_NAME = "cache"
MANIFEST_FORMAT = 1

# progress(stage, done, total): stages "tokenizer", "tokenize", "write"
PrepareProgress = Callable[[str, int, int], None]


def dataset_files(out_dir: Path) -> DatasetFiles:
    """Where ``prepare_dataset`` puts its outputs in ``out_dir``."""
    out_dir = Path(out_dir)
    return DatasetFiles(prefix=out_dir / PREFIX_NAME, tokenizer=out_dir / TOKENIZER_NAME)


def prepare_dataset(out_dir: Path, vocab_size: int, progress: PrepareProgress | None = None) -> DatasetFiles:
    """Tokenizer + indexed dataset of the shipped corpus in ``out_dir``; reuse a complete output."""
    out_dir = Path(out_dir)
    files = dataset_files(out_dir)
    if read_manifest(out_dir, vocab_size) is not None:
        return files

    report = progress or (lambda stage, done, total: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    try:
        manifest = _build(staging, vocab_size, report)
        # Megatron's index cache is keyed by path and settings, not content: drop the old one.
        shutil.rmtree(out_dir / CACHE_DIR_NAME, ignore_errors=True)
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        for name in manifest["files"]:
            os.replace(staging / name, out_dir / name)
        os.replace(staging / MANIFEST_NAME, out_dir / MANIFEST_NAME)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files


def read_manifest(out_dir: Path, vocab_size: int | None = None) -> dict | None:
    """The manifest of a complete output in ``out_dir`` (built for ``vocab_size`` if given), else None."""
    path = Path(out_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("corpus_sha256") != CORPUS_SHA256:
        return None
    if vocab_size is not None and manifest.get("vocab_size") != vocab_size:
        return None
    for name, entry in manifest.get("files", {}).items():
        file = Path(out_dir) / name
        if not file.is_file() or file.stat().st_size != entry["size"] or _sha256(file) != entry["sha256"]:
            return None
    return manifest


def _build(staging: Path, vocab_size: int, report: PrepareProgress) -> dict:
    """Write tokenizer, .bin/.idx and manifest into ``staging``; return the manifest."""
    # tokenizers: only data preparation needs it
    import tokenizers

    with quiet_megatron_import():
        # megatron-core: an optional framework (the local and gpu extras), needed only here
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    documents = corpus_documents()
    report("tokenizer", 0, 1)
    tokenizer = train_tokenizer(documents, vocab_size)
    tokenizer.save(str(staging / TOKENIZER_NAME), pretty=True)
    report("tokenizer", 1, 1)

    eod = eod_id(tokenizer)
    token_vocab = tokenizer.get_vocab_size()
    dtype = DType.optimal_dtype(token_vocab)
    builder = IndexedDatasetBuilder(str(staging / f"{PREFIX_NAME}.bin"), dtype=dtype)
    num_tokens = 0
    chunk = 512
    for start in range(0, len(documents), chunk):
        for encoding in tokenizer.encode_batch(documents[start:start + chunk], add_special_tokens=False):
            ids = encoding.ids + [eod]
            builder.add_document(numpy.array(ids, dtype=dtype), [len(ids)])
            num_tokens += len(ids)
        report("tokenize", min(start + chunk, len(documents)), len(documents))
    report("write", 0, 1)
    builder.finalize(str(staging / f"{PREFIX_NAME}.idx"))
    report("write", 1, 1)

    names = [f"{PREFIX_NAME}.bin", f"{PREFIX_NAME}.idx", TOKENIZER_NAME]
    manifest = {
        "format": MANIFEST_FORMAT,
        "vocab_size": vocab_size,
        "tokenizer_vocab_size": token_vocab,
        "eod_token": EOD_TOKEN,
        "eod_id": eod,
        "dtype": numpy.dtype(dtype).name,
        "documents": len(documents),
        "tokens": num_tokens,
        "corpus_sha256": CORPUS_SHA256,
        "tokenizers_version": tokenizers.__version__,
        "files": {name: {"size": (staging / name).stat().st_size, "sha256": _sha256(staging / name)}
                  for name in names},
    }
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
