"""Training corpus: the installed Python standard library's .py sources (no download).

The file list is sorted, each file goes to train / validation / test by a hash of its
relative path (stable across machines and runs), and the sha256 of every split is recorded
so a run can say exactly what it trained on.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.tokenizer import TOKENIZER

SPLITS = ("train", "validation", "test")
# Out of 100 hash buckets: 0-89 train, 90-94 validation, 95-99 test.
_SPLIT_BOUNDS = ((0, 90), (90, 95), (95, 100))
_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """Stable split by file: the first byte pair of sha256(path) modulo 100."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:4], "big") % 100
    for name, (low, high) in zip(SPLITS, _SPLIT_BOUNDS, strict=True):
        if low <= bucket < high:
            return name
    raise AssertionError(bucket)


def list_files(root: Path) -> list[Path]:
    """Deterministic file list: sorted text sources, skipping third-party site-packages."""
    if root.is_file():
        return [root]
    suffixes = {".py"} if root == stdlib_root() else _TEXT_SUFFIXES
    files = [
        path
        for path in root.rglob("*")
        if path.is_file() and path.suffix in suffixes and "site-packages" not in path.parts
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class Corpus:
    """Token streams per split: every file as its bytes followed by EOS."""

    root: str
    splits: dict[str, np.ndarray]
    file_counts: dict[str, int]
    sha256: dict[str, str] = field(default_factory=dict)

    def text_bytes(self, split: str) -> bytes:
        """A split as raw bytes, file separators (EOS) dropped: for prompts and probes."""
        stream = self.splits[split]
        return stream[stream < 256].astype(np.uint8).tobytes()

    def describe(self) -> dict[str, object]:
        return {
            "root": self.root,
            "files": self.file_counts,
            "tokens": {name: len(tokens) for name, tokens in self.splits.items()},
            "sha256": self.sha256,
        }


def load_corpus(path: Path | None = None) -> Corpus:
    """Build the corpus from `path` (a file or folder), the standard library by default.

    A single file is split by position instead (90/5/5 of its bytes), since it has no files.
    """
    root = path or stdlib_root()
    files = list_files(root)
    if not files:
        raise ValueError(f"--corpus {root}: no text files found")
    parts: dict[str, list[bytes]] = {name: [] for name in SPLITS}
    if root.is_file():
        data = root.read_bytes()
        cut1, cut2 = int(len(data) * 0.90), int(len(data) * 0.95)
        parts["train"], parts["validation"], parts["test"] = [data[:cut1]], [data[cut1:cut2]], [data[cut2:]]
    else:
        for file in files:
            parts[split_of(file.relative_to(root).as_posix())].append(file.read_bytes())
    splits: dict[str, np.ndarray] = {}
    digests: dict[str, str] = {}
    for name, chunks in parts.items():
        digest = hashlib.sha256()
        streams = []
        for chunk in chunks:
            digest.update(hashlib.sha256(chunk).digest())
            tokens = np.frombuffer(chunk, dtype=np.uint8).astype(np.int16)
            streams.append(np.append(tokens, np.int16(TOKENIZER.eos_token_id)))
        splits[name] = np.concatenate(streams) if streams else np.zeros(0, dtype=np.int16)
        digests[name] = digest.hexdigest()
    return Corpus(str(root), splits, {k: len(v) for k, v in parts.items()}, digests)
