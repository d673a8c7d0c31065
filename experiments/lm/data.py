"""The language-model data: the CPython standard library's own ``.py`` source, which ships with Python.

Files: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except those in test
packages and installed packages (any directory named ``test``, ``tests``, ``idle_test``,
``site-packages``, ``dist-packages`` or ``__pycache__``: ``test/``, ``ctypes/test``,
``lib2to3/tests``, ``idlelib/idle_test`` ...), about 12 MB for Python 3.11. No download.

Split: by file, from a SHA-256 of its path relative to the stdlib root, so the split is the same
on every run, machine and Python build (never Python's salted ``hash``): about 10% of the files
are validation. The tokenizer (:mod:`experiments.lm.tokenizer`) is trained on the training files
only.

Batches: the training files' ids, concatenated in path order, are one stream; the batch of
``(step, rank)`` is ``batch`` windows at offsets drawn from a generator seeded with
``(seed, step, rank)``, so every run (and every method of one run) sees the same batches, and
the two ranks see different ones. Validation is a fixed set of evenly spaced windows of the
validation stream.

The tokenised corpus is cached (``.npz``, a few MB) under ``$DEEPREDUCE_CACHE`` or
``~/.cache/deepreduce``, keyed by the vocabulary size and the files' paths and sizes.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from .tokenizer import WordTokenizer

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
VALID_FRACTION = 0.1
DATA_VERSION = 1


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: Optional[str] = None) -> List[str]:
    """Relative paths (``/``-separated, sorted) of the corpus's ``.py`` files under ``root``."""
    root = root or stdlib_root()
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = os.path.relpath(here, root)
        for name in files:
            if name.endswith(".py"):
                found.append(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
    if not found:
        raise FileNotFoundError(f"no .py files under {root!r} (the standard library's directory)")
    return sorted(found)


def is_validation(path: str) -> bool:
    """Whether ``path`` (relative, ``/``-separated) is a validation file: SHA-256, not ``hash``."""
    digest = hashlib.sha256(path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < VALID_FRACTION * 2 ** 64


def split(paths: List[str]) -> Tuple[List[str], List[str]]:
    """``(train, validation)`` relative paths."""
    return [p for p in paths if not is_validation(p)], [p for p in paths if is_validation(p)]


def _read(root: str, paths: List[str]) -> List[bytes]:
    out = []
    for path in paths:
        with open(os.path.join(root, path), "rb") as handle:
            out.append(handle.read())
    return out


@dataclass
class LMData:
    """Tokenised training and validation streams and their tokenizer."""

    train: np.ndarray          # uint16 ids
    valid: np.ndarray
    tokenizer: WordTokenizer

    def batch(self, step: int, rank: int, batch: int, context: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """``(ids, targets)``, each ``(batch, context)`` int64: rank ``rank``'s batch of ``step``."""
        rng = np.random.default_rng([seed, step, rank])
        starts = rng.integers(0, self.train.size - context - 1, size=batch)
        windows = self.train[starts[:, None] + np.arange(context + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def validation(self, count: int, context: int) -> Tuple[np.ndarray, np.ndarray]:
        """``count`` evenly spaced, non-overlapping validation windows: ``(ids, targets)``."""
        if count * (context + 1) > self.valid.size:
            raise ValueError(f"{count} windows of {context + 1} tokens do not fit {self.valid.size} validation tokens")
        starts = np.linspace(0, self.valid.size - context - 1, count).astype(np.int64)
        windows = self.valid[starts[:, None] + np.arange(context + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def bytes_of(self, ids: np.ndarray) -> int:
        """How many bytes of source ``ids`` stand for (the denominator of bits per byte)."""
        return int(self.tokenizer.lengths[ids].sum())

    @staticmethod
    def bits_per_byte(loss_nats: float, tokens: int, nbytes: int) -> float:
        """Mean loss per token (nats) -> bits per byte of source."""
        return loss_nats * tokens / math.log(2) / nbytes


def build(vocab_size: int, root: Optional[str] = None) -> LMData:
    """Read, split and tokenise the corpus (a few seconds)."""
    root = root or stdlib_root()
    train_paths, valid_paths = split(source_files(root))
    train_texts = _read(root, train_paths)
    tokenizer = WordTokenizer.train(train_texts, vocab_size)
    train = np.concatenate([tokenizer.encode(t) for t in train_texts])
    valid = np.concatenate([tokenizer.encode(t) for t in _read(root, valid_paths)])
    return LMData(train, valid, tokenizer)


def cache_path(vocab_size: int, root: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """Where :func:`load` keeps the tokenised corpus of ``vocab_size`` for the files under ``root``."""
    from ..corpus import default_cache_dir

    root = root or stdlib_root()
    listing = hashlib.sha256(f"v{DATA_VERSION} {vocab_size}".encode())
    for path in source_files(root):
        listing.update(f"\n{path} {os.path.getsize(os.path.join(root, path))}".encode())
    return os.path.join(cache_dir or default_cache_dir(), f"lm-stdlib-{listing.hexdigest()[:12]}.npz")


def save(data: LMData, path: str) -> None:
    pieces = data.tokenizer.pieces
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.npz"
    np.savez_compressed(tmp, train=data.train, valid=data.valid,
                        pieces=np.frombuffer(b"".join(pieces), dtype=np.uint8),
                        piece_lengths=np.array([len(p) for p in pieces], dtype=np.int64))
    os.replace(tmp, path)


def read(path: str) -> LMData:
    with np.load(path) as npz:
        blob, ends = npz["pieces"].tobytes(), np.cumsum(npz["piece_lengths"])
        pieces = [blob[end - n:end] for n, end in zip(npz["piece_lengths"], ends)]
        return LMData(npz["train"], npz["valid"], WordTokenizer(pieces))


def load(vocab_size: int, root: Optional[str] = None, cache_dir: Optional[str] = None) -> Tuple[LMData, str]:
    """The corpus of ``vocab_size`` and its cache file: read from the cache, else built and cached."""
    path = cache_path(vocab_size, root, cache_dir)
    if os.path.isfile(path):
        try:
            return read(path), path
        except (OSError, ValueError, KeyError):
            pass        # a damaged cache file is rebuilt below
    data = build(vocab_size, root)
    save(data, path)
    return data, path
