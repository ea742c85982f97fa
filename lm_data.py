"""Token datasets in the CS336 format, framework-free (stdlib + numpy): both trainers (``torch_impl.train``,
``jax_impl.trainer``) import them, so given one seed they read the same tokens.

A dataset is a flat 1-D array of token ids, memory-mapped from a ``.npy`` file.

* ``sample_starts(n_tokens, count, context_length, generator)``: ``count`` random window starts (CS336's
  ``get_batch`` draw); ``global_batch_starts(...)``: one optimizer step's global batch of starts laid out as
  (micro-batch, rank, row), drawn at once from one generator; ``windows_at(dataset, starts, context_length)``:
  the windows of ``context_length + 1`` tokens at those starts, (B, T + 1) int64 (inputs ``[:, :-1]``,
  targets ``[:, 1:]``). The backends put them on their devices (``torch_impl.data.batch_at``,
  ``jax_impl.train.ShardedTrainer.place_batch``).
* ``validation_starts`` / ``validation_batch_starts``: fixed, deterministic, non-overlapping windows (window i
  starts at ``i * context_length``), in batches, so the validation set does not depend on the number of ranks.
* ``prepare_data(source, cache_dir)`` returns a ``TokenData`` (train and validation arrays, vocabulary size):

  - ``"builtin"``: a corpus on every machine, needing no download: the Python standard library's own source
    files (``sysconfig.get_paths()["stdlib"]``, ``*.py`` outside ``site-packages`` and test folders,
    sorted by relative path, taken in that order until ``builtin_bytes``), encoded as bytes (ids 0-255) with
    ``SEPARATOR`` = 256 after each file (vocabulary 257). Every ``round(1 / val_fraction)``-th file goes to
    validation (the last file, when there are fewer), so both splits span the whole subset.
  - a ``.npy`` file of token ids (1-D, integer): memory-mapped as it is; the last ``val_fraction`` of it is
    the validation split (views, nothing copied). Its ``digest`` hashes the file's content and the split
    (``_content_digest``), so a resumed run refuses another file of the same size.
  - any other file: its bytes are the tokens (vocabulary 257, as the built-in corpus); tail split.

  Byte corpora are written once into ``cache_dir`` (``train.npy``, ``val.npy``, ``meta.json``) in a
  temporary folder that is renamed into place (``os.replace``), so concurrent builders (ranks of one job)
  never see half a dataset; the folder's name carries a hash of the inputs, so a changed source rebuilds.
  Ids are stored as ``uint16`` when the vocabulary fits (< 65,536), else ``uint32``.

Caveats: byte-level tokens make sequences ~4x longer than BPE tokens of the same text (honest, and enough
for systems work); the built-in corpus depends on the Python version (its name and hash go into the
records). ``check_vocab`` must be called with the model's vocabulary: an id >= it is a ValueError.

References: CS336 (Stanford, 2025) assignment 1, sections 5.1 (data loading: ``np.memmap`` / ``mmap_mode``,
random windows, ``get_batch``) and 7 (validation loss).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = 256  # ends every document of a byte corpus
BYTE_VOCAB = 257  # 256 byte values + SEPARATOR
DEFAULT_BUILTIN_BYTES = 8 * 2**20
DEFAULT_VAL_FRACTION = 0.05
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class TokenData:
    """A dataset's two splits (1-D integer arrays, usually memory-mapped) and its vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int  # every id is < vocab_size
    name: str  # "stdlib-py3.12-...", a file name
    digest: str  # hash of the inputs (provenance)

    def describe(self) -> dict:
        return {"name": self.name, "digest": self.digest, "vocab_size": self.vocab_size,
                "train_tokens": int(len(self.train)), "val_tokens": int(len(self.val))}

    def check_vocab(self, model_vocab: int) -> None:
        if self.vocab_size > model_vocab:
            raise ValueError(f"data {self.name!r} has token ids up to {self.vocab_size - 1}, but the model's "
                             f"vocabulary is {model_vocab}: use a model with vocab_size >= {self.vocab_size}")

    def check_windows(self, context_length: int, *, validation: bool) -> None:
        """Each split used (the validation one only if ``validation``) must hold one window of
        ``context_length + 1`` tokens."""
        if len(self.train) < context_length + 1 or (validation and len(self.val) < context_length + 1):
            raise ValueError(f"data {self.name!r} ({len(self.train)} training, {len(self.val)} validation tokens) "
                             f"is too small for --seq-len {context_length}: each split needs {context_length + 1} "
                             "tokens")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size}; accepted: 1 to 2**32")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ----------------------------------------------------------------------------- batches


def sample_starts(n_tokens: int, count: int, context_length: int, generator: np.random.Generator) -> np.ndarray:
    """``count`` uniform window starts in [0, n_tokens - context_length) (each window has context + 1 tokens)."""
    if context_length < 1 or count < 1:
        raise ValueError(f"context_length={context_length} and count={count} must be >= 1")
    if n_tokens < context_length + 1:
        raise ValueError(f"{n_tokens} tokens cannot hold one window of {context_length} + 1 tokens")
    return generator.integers(0, n_tokens - context_length, size=count)


def global_batch_starts(n_tokens: int, grad_accum: int, world_size: int, batch_size: int, context_length: int,
                        generator: np.random.Generator) -> np.ndarray:
    """One optimizer step's window starts, (grad_accum, world_size, batch_size): one draw of the whole global
    batch, so it depends only on the generator and the global batch size; rank r's micro-batch j is ``[j, r]``
    (one JAX program over a mesh is one rank whose micro-batch is ``world_size x batch_size`` rows)."""
    starts = sample_starts(n_tokens, grad_accum * world_size * batch_size, context_length, generator)
    return starts.reshape(grad_accum, world_size, batch_size)


def windows_at(dataset: np.ndarray, starts: np.ndarray, context_length: int) -> np.ndarray:
    """Windows ``dataset[s : s + context_length + 1]`` for each start, (B, T + 1) int64: inputs ``[:, :-1]``,
    targets ``[:, 1:]``."""
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(context_length + 1)  # (B, T + 1)
    return np.asarray(dataset[index], dtype=np.int64)


def validation_starts(n_tokens: int, context_length: int) -> np.ndarray:
    """Starts of the non-overlapping windows 0, T, 2T, ... that fit ``n_tokens`` (each T + 1 tokens long)."""
    count = max(0, (n_tokens - 1) // context_length)
    return np.arange(count, dtype=np.int64) * context_length


def validation_batch_starts(n_tokens: int, batch_size: int, context_length: int, n_batches: int) -> list[np.ndarray]:
    """The window starts of the first ``n_batches`` validation batches, every rank's (the last batch may be short
    when the split has fewer windows)."""
    starts = validation_starts(n_tokens, context_length)[:n_batches * batch_size]
    if len(starts) == 0:
        raise ValueError(f"the validation split ({n_tokens} tokens) holds no window of {context_length} + 1")
    return [starts[b:b + batch_size] for b in range(0, len(starts), batch_size)]


# ----------------------------------------------------------------------------- corpora


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """A 1-D integer ``.npy`` token array, memory-mapped read-only."""
    array = np.load(path, mmap_mode="r")
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{path}: a token file must be a 1-D integer array, got {array.dtype} {array.shape}")
    return array


def stdlib_files(limit_bytes: int = DEFAULT_BUILTIN_BYTES) -> tuple[Path, list[Path]]:
    """(the stdlib folder, its ``*.py`` files sorted by relative path, outside test / site-packages folders,
    taken in order while the total stays within ``limit_bytes`` (at least one file))."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py") if not _EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if chosen and total + size > limit_bytes:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise ValueError(f"no *.py files under the standard library folder {root}")
    return root, chosen


def encode_documents(documents: list[bytes]) -> np.ndarray:
    """Bytes of each document followed by ``SEPARATOR``, concatenated: (sum of lengths + count,) uint16."""
    dtype = token_dtype(BYTE_VOCAB)
    parts = []
    for doc in documents:
        parts += [np.frombuffer(doc, dtype=np.uint8).astype(dtype), np.array([SEPARATOR], dtype=dtype)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _val_every(val_fraction: float) -> int:
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    return max(2, round(1 / val_fraction))


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    _val_every(val_fraction)  # validates
    cut = len(tokens) - math.ceil(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def _write_atomically(final: Path, train: np.ndarray, val: np.ndarray, meta: dict) -> None:
    """Write the three files into a temporary sibling folder, then rename it to ``final`` in one step; if
    another process got there first, keep theirs (same inputs, same content)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cached(folder: Path, build) -> TokenData:
    if not (folder / "meta.json").exists():
        train, val, meta = build()
        _write_atomically(folder, train, val, meta)
    meta = json.loads((folder / "meta.json").read_text())
    return TokenData(load_tokens(folder / "train.npy"), load_tokens(folder / "val.npy"), meta["vocab_size"],
                     meta["name"], meta["digest"])


def builtin_corpus(cache_dir: str | os.PathLike, limit_bytes: int = DEFAULT_BUILTIN_BYTES,
                   val_fraction: float = DEFAULT_VAL_FRACTION) -> TokenData:
    """The standard library's source as bytes (see the module docstring), built once into ``cache_dir``."""
    every = _val_every(val_fraction)
    root, files = stdlib_files(limit_bytes)
    listing = [(p.relative_to(root).as_posix(), p.stat().st_size) for p in files]
    digest = hashlib.sha256(json.dumps([str(root), listing, every]).encode()).hexdigest()[:12]
    name = f"stdlib-py{sysconfig.get_python_version()}-{sum(s for _, s in listing)}B"

    def build():
        docs = [p.read_bytes() for p in files]
        if len(docs) < 2:
            raise ValueError(f"the built-in corpus needs 2 files or more; raise its size ({limit_bytes} bytes)")
        # Every `every`-th file, or the last one when there are fewer than `every`.
        is_val = [i % every == every - 1 for i in range(len(docs))] if len(docs) >= every else \
            [i == len(docs) - 1 for i in range(len(docs))]
        train = encode_documents([d for d, v in zip(docs, is_val) if not v])
        val = encode_documents([d for d, v in zip(docs, is_val) if v])
        meta = {"name": name, "digest": digest, "vocab_size": BYTE_VOCAB, "files": len(files),
                "val_every": every, "stdlib": str(root)}
        return train, val, meta

    return _cached(Path(cache_dir) / f"{name}-{digest}", build)


def _content_digest(path: Path, val_fraction: float) -> str:
    """What identifies a file's data set: a SHA-256 of every byte (streamed, 1 MiB at a time) and the split, 12
    hex digits. The whole file, not a sample: reading it costs what the ``min()`` / ``max()`` scan of a token
    file costs already, and a sample would miss an edit between its chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return hashlib.sha256(f"{h.hexdigest()} {val_fraction}".encode()).hexdigest()[:12]


def prepare_data(source: str, cache_dir: str | os.PathLike = ".cache/data", *,
                 builtin_bytes: int = DEFAULT_BUILTIN_BYTES,
                 val_fraction: float = DEFAULT_VAL_FRACTION) -> TokenData:
    """``"builtin"``, a ``.npy`` token file, or a text file (bytes): see the module docstring."""
    if source == "builtin":
        return builtin_corpus(cache_dir, builtin_bytes, val_fraction)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"--data {source!r}: accepted: 'builtin', a .npy token file, or a text file")
    if path.suffix == ".npy":
        tokens = load_tokens(path)
        if len(tokens) == 0:
            raise ValueError(f"{path}: empty token file")
        if int(tokens.min()) < 0:
            raise ValueError(f"{path}: negative token ids")
        train, val = _tail_split(tokens, val_fraction)
        return TokenData(train, val, int(tokens.max()) + 1, path.name, _content_digest(path, val_fraction))
    digest = _content_digest(path, val_fraction)

    def build():
        tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(token_dtype(BYTE_VOCAB))
        if len(tokens) == 0:
            raise ValueError(f"{path}: empty file")
        train, val = _tail_split(tokens, val_fraction)
        return train, val, {"name": path.name, "digest": digest, "vocab_size": BYTE_VOCAB, "source": str(path)}

    return _cached(Path(cache_dir) / f"{path.stem}-{digest}", build)
