"""``lm_data`` and ``torch_impl.data``: CS336-format token datasets, random training windows, fixed validation windows, corpora.

Windows are checked against a dataset whose every token is its own position (so a window names its start)
and against a plain Python loop; the built-in corpus is decoded back and compared with the standard
library's files read independently (``os.walk``); caches are built in temporary folders.
"""

from __future__ import annotations

import os
import secrets
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lm_data import (BYTE_VOCAB, SEPARATOR, builtin_corpus, global_batch_starts, prepare_data, sample_starts,
                     token_dtype, validation_starts, windows_at)
from torch_impl.data import batch_at, get_batch, validation_batches


def test_get_batch_windows_are_contiguous_and_shifted():
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    n, batch, context = 40, 7, 6
    dataset = np.arange(n, dtype=np.uint16)  # token i is i: a window's first token is its start
    seen = set()
    for _ in range(300):
        x, y = get_batch(dataset, batch, context, "cpu", rng)
        assert x.shape == y.shape == (batch, context) and x.dtype == y.dtype == torch.int64, seed
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            start = row_x[0]
            assert row_x == list(range(start, start + context)), (seed, row_x)
            assert row_y == list(range(start + 1, start + context + 1)), (seed, row_y)
            seen.add(start)
    # Every valid start (0 .. n - context - 1) is drawn, and no other.
    assert seen == set(range(n - context)), (seed, sorted(seen))


def test_get_batch_is_deterministic_and_matches_a_loop():
    seed = secrets.randbelow(2**31)
    data_rng = np.random.default_rng(seed)
    dataset = data_rng.integers(0, 500, size=1000).astype(np.uint16)
    x1, y1 = get_batch(dataset, 5, 16, "cpu", np.random.default_rng(seed))
    starts = sample_starts(len(dataset), 5, 16, np.random.default_rng(seed))
    ref = np.stack([dataset[s:s + 17] for s in starts]).astype(np.int64)  # the CS336 loop
    assert torch.equal(x1, torch.from_numpy(ref[:, :-1])) and torch.equal(y1, torch.from_numpy(ref[:, 1:])), seed
    with pytest.raises(ValueError, match="cannot hold"):
        get_batch(dataset[:10], 2, 10, "cpu", np.random.default_rng(0))


@pytest.mark.parametrize("world_size", [2, 3])
def test_validation_windows_fixed_and_independent_of_world_size(world_size):
    n, context, batch = 103, 8, 3
    dataset = np.arange(n, dtype=np.uint32)
    starts = validation_starts(n, context)
    assert starts.tolist() == [i * context for i in range((n - 1) // context)]
    assert starts[-1] + context + 1 <= n  # the last window fits, targets included
    whole = [x[:, 0].tolist() for x, _ in validation_batches(dataset, batch, context, 4)]
    assert [s for b in whole for s in b] == starts[:12].tolist()
    shared = []
    for rank in range(world_size):
        for x, y in validation_batches(dataset, batch, context, 4, rank=rank, world_size=world_size):
            assert torch.equal(y[:, :-1], x[:, 1:])
            shared += x[:, 0].tolist()
    assert sorted(shared) == starts[:12].tolist()
    # More batches than the split holds: all its windows, the last batch short.
    every = [x for x, _ in validation_batches(dataset, batch, context, 1000)]
    assert sum(len(x) for x in every) == len(starts) and len(every[-1]) == (len(starts) % batch or batch)


def _stdlib_sources() -> list[tuple[str, bytes]]:
    """The standard library's *.py files outside test and site-packages folders, by relative path (os.walk)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    out = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        if set(Path(rel).parts) & skip:
            continue
        for name in files:
            if name.endswith(".py"):
                out.append((Path(rel, name).as_posix().removeprefix("./"), Path(folder, name).read_bytes()))
    return sorted(out)


def _documents(tokens: np.ndarray) -> list[bytes]:
    ends = np.flatnonzero(tokens == SEPARATOR)
    assert len(ends) and ends[-1] == len(tokens) - 1, "every document ends with the separator"
    return [bytes(tokens[s:e].astype(np.uint8)) for s, e in zip(np.r_[0, ends[:-1] + 1], ends)]


def test_builtin_corpus_is_the_stdlib_as_bytes(tmp_path):
    limit = 200_000
    data = builtin_corpus(tmp_path, limit_bytes=limit, val_fraction=0.25)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    assert data.vocab_size == BYTE_VOCAB and int(data.train.max()) < BYTE_VOCAB
    sources, chosen, total = _stdlib_sources(), [], 0
    for _, content in sources:
        if chosen and total + len(content) > limit:
            break
        chosen.append(content)
        total += len(content)
    train, val = _documents(np.asarray(data.train)), _documents(np.asarray(data.val))
    assert val == chosen[3::4] and train == [c for i, c in enumerate(chosen) if i % 4 != 3]
    # Built once: the folder is reused (no rebuild), and no temporary folder is left behind.
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and not folders[0].name.startswith(".")
    mtime = (folders[0] / "train.npy").stat().st_mtime_ns
    again = prepare_data("builtin", tmp_path, builtin_bytes=limit, val_fraction=0.25)
    assert (folders[0] / "train.npy").stat().st_mtime_ns == mtime and np.array_equal(again.val, data.val)
    data.check_vocab(512)
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        data.check_vocab(256)


def test_text_and_npy_sources(tmp_path):
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    text = tmp_path / "corpus.txt"
    raw = bytes(rng.integers(0, 256, size=1000, dtype=np.uint8))
    text.write_bytes(raw)
    data = prepare_data(str(text), tmp_path / "cache", val_fraction=0.1)
    assert bytes(np.concatenate([data.train, data.val]).astype(np.uint8)) == raw, seed
    assert len(data.val) == 100 and data.vocab_size == BYTE_VOCAB

    ids = rng.integers(0, 70_000, size=5000).astype(np.uint32)
    np.save(tmp_path / "ids.npy", ids)
    data = prepare_data(str(tmp_path / "ids.npy"), tmp_path / "cache", val_fraction=0.2)
    assert isinstance(data.train, np.memmap) and data.vocab_size == int(ids.max()) + 1
    assert np.array_equal(data.train, ids[:4000]) and np.array_equal(data.val, ids[4000:]), seed
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32

    np.save(tmp_path / "bad.npy", ids.reshape(50, 100))
    with pytest.raises(ValueError, match="1-D integer"):
        prepare_data(str(tmp_path / "bad.npy"))
    with pytest.raises(ValueError, match="accepted: 'builtin'"):
        prepare_data(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data(str(text), tmp_path / "cache", val_fraction=1.5)


def test_batch_at_moves_to_device_and_keeps_values():
    dataset = np.arange(50, dtype=np.uint16)
    x, y = batch_at(dataset, np.array([0, 41]), 8, torch.device("cpu"))
    assert x.tolist() == [list(range(8)), list(range(41, 49))] and y.tolist() == [list(range(1, 9)),
                                                                                    list(range(42, 50))]


def test_global_batch_is_one_draw_laid_out_micro_rank_row():
    seed = secrets.randbelow(2**31)
    starts = global_batch_starts(1000, 3, 2, 4, 16, np.random.default_rng(seed))
    flat = sample_starts(1000, 24, 16, np.random.default_rng(seed))
    assert starts.shape == (3, 2, 4) and np.array_equal(starts.reshape(-1), flat), seed
    dataset = np.arange(50, dtype=np.uint16)
    assert windows_at(dataset, np.array([3, 40]), 9).tolist() == [list(range(3, 13)), list(range(40, 50))]
