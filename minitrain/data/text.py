"""A character-level text corpus present on every machine: Python's own standard library sources.

load_text reads a fixed list of pure-Python stdlib modules (same text on every rank), builds
the character vocabulary (printable ASCII and newline), and returns a CharCorpus with train/validation token arrays and
get_batch for (B, T) next-character prediction.
"""
import os
import re
import sysconfig

import numpy as np

DEFAULT_MODULES = ("textwrap.py", "difflib.py", "fractions.py", "heapq.py", "bisect.py",
                   "shlex.py", "string.py", "glob.py", "fnmatch.py", "colorsys.py")


class CharCorpus:
    def __init__(self, text, val_fraction=0.1):
        self.text = text
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if all(ord(c) < 128 for c in self.chars):         # ASCII (load_text's): a table lookup of the bytes
            table = np.zeros(128, np.int64)
            table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
            data = table[np.frombuffer(text.encode("ascii"), np.uint8)]
        else:
            data = np.array([self.stoi[c] for c in text], dtype=np.int64)
        n_val = int(len(data) * val_fraction)
        self.train, self.val = data[:len(data) - n_val], data[len(data) - n_val:]

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, s):
        return np.array([self.stoi[c] for c in s], dtype=np.int64)

    def decode(self, tokens):
        return "".join(self.chars[int(t)] for t in tokens)

    def get_batch(self, split, batch_size, block_size, rng):
        """Random windows: x (B, T) and y = x shifted by one (the next character)."""
        data = self.train if split == "train" else self.val
        if len(data) <= block_size:
            raise ValueError(f"the {split} split has {len(data)} tokens, fewer than block_size+1")
        starts = rng.integers(0, len(data) - block_size - 1, size=batch_size)
        x = np.stack([data[s:s + block_size] for s in starts])
        y = np.stack([data[s + 1:s + block_size + 1] for s in starts])
        return x, y


def load_text(modules=DEFAULT_MODULES, max_chars=None, val_fraction=0.1):
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in modules:
        path = os.path.join(stdlib, name)
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    text = "\n".join(parts)
    text = re.sub("[^\n\x20-\x7e]", "", text)                   # printable ASCII and newline: ~96 symbols
    if max_chars is not None:
        text = text[:max_chars]
    return CharCorpus(text, val_fraction)
