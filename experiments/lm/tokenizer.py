"""A word-level tokenizer with byte fallback, for Python source.

Why word level (and not bytes or BPE): the quality experiment needs a model whose largest
parameter is an embedding table with a row-sparse gradient, as in the language models and
recommenders that sparse gradient compression is made for. Splitting source into identifiers,
numbers, punctuation and indentation runs gives a Zipf-distributed vocabulary of several
thousand pieces, of which one batch touches only a few hundred: the other rows of the
embedding's gradient are exactly zero. Bytes alone would give a 256-row table (nothing to be
sparse), and training a BPE vocabulary in pure Python over 10 MB takes minutes where this one
pass takes seconds. Pieces missing from the vocabulary are spelled as their bytes (ids 0-255
are the 256 byte values), so every input round-trips exactly and bits per byte are well defined.

Pieces (a regular expression over bytes): an identifier or a number or a punctuation byte, each
with at most one leading space (``" self"``, ``" ="``), a newline with the indentation after it
(``"\\n        "``), a run of spaces or tabs, or any other single byte.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, List, Sequence

import numpy as np

PIECE = re.compile(rb" ?[A-Za-z_][A-Za-z0-9_]*| ?[0-9]+| ?[^A-Za-z0-9_\s]|\n[ \t]*|[ \t]+|.", re.S)
BYTES = 256


class WordTokenizer:
    """Ids ``0..255`` are single bytes; ids from 256 on are the vocabulary's multi-byte pieces."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        pieces = [bytes(p) for p in pieces]
        if pieces[:BYTES] != [bytes([b]) for b in range(BYTES)]:
            raise ValueError("WordTokenizer: the first 256 pieces must be the single bytes 0..255 in order")
        if len(set(pieces)) != len(pieces) or any(len(p) < 2 for p in pieces[BYTES:]):
            raise ValueError("WordTokenizer: pieces after the bytes must be distinct and at least 2 bytes long")
        if len(pieces) > 1 << 16:
            raise ValueError(f"WordTokenizer: {len(pieces)} pieces do not fit 16-bit ids")
        self.pieces: List[bytes] = pieces
        self.index = {p: i for i, p in enumerate(pieces)}
        self.lengths = np.array([len(p) for p in pieces], dtype=np.int64)   # bytes per id

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @classmethod
    def train(cls, texts: Iterable[bytes], vocab_size: int) -> "WordTokenizer":
        """The 256 bytes plus the ``vocab_size - 256`` most frequent multi-byte pieces of ``texts``.

        Ties are broken by the piece's bytes, so the vocabulary depends on the texts only.
        """
        if not BYTES < vocab_size <= 1 << 16:
            raise ValueError(f"WordTokenizer: vocab_size must be in (256, 65536], got {vocab_size}")
        counts: Counter = Counter()
        for text in texts:
            counts.update(p for p in PIECE.findall(text) if len(p) > 1)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([bytes([b]) for b in range(BYTES)] + [p for p, _ in ranked[:vocab_size - BYTES]])

    def encode(self, text: bytes) -> np.ndarray:
        """The ids of ``text`` (uint16): each piece's id, or its bytes where it is not in the vocabulary."""
        ids: List[int] = []
        lookup = self.index.get
        for piece in PIECE.findall(text):
            found = lookup(piece)
            if found is None:
                ids.extend(piece)          # bytes iterate as their values: the byte ids
            else:
                ids.append(found)
        return np.array(ids, dtype=np.uint16)

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes ``ids`` stand for (inverse of :meth:`encode`)."""
        return b"".join(self.pieces[int(i)] for i in ids)
