"""Tokenizers behind one small interface: bytes (built in), a HF `tokenizer.json`, SentencePiece, tiktoken BPE.

`load_tokenizer(spec)` takes `data.tokenizer`: "bytes" or a file. The file's kind comes from its name
(`.json`, `.model`, `.tiktoken`) or, for other names, from its contents; a file none of them reads is a
`TokenizerError` naming it. A tokenizer's `hash` (sha256 of its file) is what a run agrees on, and its
`eos_id` separates documents. The libraries are the `hf` extra, imported only when a file is used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from swarmtrain.config_model import BYTES_TOKENIZER
from swarmtrain.extras import require

__all__ = ["EOS_CANDIDATES", "BytesTokenizer", "Tokenizer", "TokenizerError", "TokenizerInfo", "encode_arrays",
           "file_sha256", "load_tokenizer"]

log = logging.getLogger(__name__)

# End-of-text tokens of the common tokenizer families, in the order they are looked for.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
# tiktoken files carry no split pattern: the one of the known encoding with the same number of ranks.
_R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                   r"""\s*[\r\n]|\s+(?!\S)|\s+""")
_TIKTOKEN_PATTERNS = {50256: _R50K_PATTERN, 50280: _R50K_PATTERN, 100256: _CL100K_PATTERN}


class TokenizerError(ValueError):
    """A tokenizer file is missing, of an unknown kind or unusable (no end-of-text token); names the file."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a run and a shard manifest record of a tokenizer."""

    kind: str  # bytes | hf | sentencepiece | tiktoken
    hash: str  # sha256 of the file; "bytes" for the byte tokenizer
    vocab_size: int
    eos_id: int
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "hash": self.hash, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "path": self.path}


class Tokenizer(Protocol):
    info: TokenizerInfo

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        ...


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class BytesTokenizer:
    """One token per UTF-8 byte (256 tokens). Its end-of-text is the NUL byte, which text does not hold."""

    info: TokenizerInfo = field(default_factory=lambda: TokenizerInfo(kind="bytes", hash=BYTES_TOKENIZER,
                                                                      vocab_size=256, eos_id=0))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` file (tokenizer.json)."""

    def __init__(self, path: Path, digest: str) -> None:
        tokenizers = require("tokenizers", purpose=f"the tokenizer {path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({e})") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise TokenizerError(f"{path}: the tokenizer has no end-of-text token (one of {', '.join(EOS_CANDIDATES)})")
        self.info = TokenizerInfo(kind="hf", hash=digest, vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
                                  eos_id=eos, path=str(path))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def eos_token(self) -> str:
        return str(self._tok.id_to_token(self.info.eos_id))


class SentencePieceTokenizer:
    """A SentencePiece model (.model)."""

    def __init__(self, path: Path, digest: str) -> None:
        spm = require("sentencepiece", purpose=f"the tokenizer {path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from e
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no end-of-sentence token (eos_id is -1)")
        self.info = TokenizerInfo(kind="sentencepiece", hash=digest, vocab_size=int(self._sp.get_piece_size()),
                                  eos_id=eos, path=str(path))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


class TiktokenTokenizer:
    """A tiktoken BPE ranks file (`<base64 token> <rank>` a line), with `<|endoftext|>` after the ranks."""

    def __init__(self, path: Path, digest: str, ranks: dict[bytes, int]) -> None:
        tiktoken = require("tiktoken", purpose=f"the tokenizer {path}")
        pattern = _TIKTOKEN_PATTERNS.get(len(ranks))
        if pattern is None:
            log.info("%s: %d ranks match no known tiktoken encoding: splitting with GPT-2's pattern", path, len(ranks))
            pattern = _R50K_PATTERN
        eos = len(ranks)
        self._enc = tiktoken.Encoding(name=path.stem, pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens={"<|endoftext|>": eos})
        self.info = TokenizerInfo(kind="tiktoken", hash=digest, vocab_size=eos + 1, eos_id=eos, path=str(path))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode([int(i) for i in ids]))


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int] | None:
    """The ranks of a tiktoken file, or None when it is not one."""
    try:
        text = path.read_text(encoding="ascii")
    except (UnicodeDecodeError, OSError):
        return None
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            return None
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError:
            return None
    return ranks or None


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "hf"
    if suffix == ".model":
        return "sentencepiece"
    if suffix == ".tiktoken":
        return "tiktoken"
    head = path.read_bytes()[:4096]
    if head.lstrip().startswith(b"{"):
        try:
            if "model" in json.loads(path.read_text(encoding="utf-8")):
                return "hf"
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    if _read_tiktoken_ranks(path) is not None:
        return "tiktoken"
    raise TokenizerError(f"{path}: unknown tokenizer file: not a Hugging Face tokenizer.json, a SentencePiece .model "
                         "or a tiktoken BPE file (name it .json, .model or .tiktoken)")


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `data.tokenizer` names ("bytes" or a file); TokenizerError naming the file otherwise."""
    if spec == BYTES_TOKENIZER:
        return BytesTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer: {path}: no such file (or 'bytes')")
    kind = _kind_of(path)
    digest = file_sha256(path)
    if kind == "hf":
        return HFTokenizer(path, digest)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path, digest)
    ranks = _read_tiktoken_ranks(path)
    if ranks is None:
        raise TokenizerError(f"{path}: not a tiktoken BPE file (each line: a base64 token and its rank)")
    return TiktokenTokenizer(path, digest, ranks)


def encode_arrays(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text as an int64 array (the byte tokenizer without a Python list per byte)."""
    if isinstance(tokenizer, BytesTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
