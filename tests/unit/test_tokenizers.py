"""Tokenizers: bytes, a trained BPE, real GPT-2 tiktoken ranks and a real SentencePiece model; clear errors."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from swarmtrain.data.readers import iter_texts
from swarmtrain.data.tokenizer import TokenizerError, file_sha256, load_tokenizer
from swarmtrain.extras import MissingExtraError

pytestmark = pytest.mark.unit

ASSETS = Path(os.environ.get("SWARMTRAIN_TOKENIZER_ASSETS", "/nonexistent"))
needs_assets = pytest.mark.skipif(not ASSETS.is_dir(), reason="scripts/fetch_tokenizer_assets.sh (dev.sh runs it)")
TEXT = "def f(x):\n    return x * 2  # héllo wörld\n"


def _stdlib_sample(tmp_path: Path) -> Path:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path / "sample.txt"
    out.write_text("".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:15]), encoding="utf-8")
    return out


def test_bytes_tokenizer() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.info.vocab_size, tok.info.eos_id, tok.info.hash) == (256, 0, "bytes")
    (ids,) = tok.encode_batch([TEXT])
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT


def test_trained_bpe_round_trips_and_has_an_end_of_text(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from swarmtrain.data.tokenizer_train import train_bpe

    out = tmp_path / "tok.json"
    assert train_bpe(iter_texts([str(_stdlib_sample(tmp_path))]), vocab_size=600, out=out) == 600
    tok = load_tokenizer(str(out))
    assert (tok.info.kind, tok.info.vocab_size, tok.info.eos_id, tok.info.hash) == ("hf", 600, 0, file_sha256(out))
    (ids,) = tok.encode_batch([TEXT])
    assert tok.decode(ids) == TEXT and len(ids) < len(TEXT.encode())  # merges learned from Python source
    assert not list(tmp_path.glob(".*tmp*")), "no temp file left"
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(iter([TEXT]), vocab_size=100, out=tmp_path / "x.json")


@needs_assets
def test_gpt2_tiktoken_ranks_give_gpt2_ids() -> None:
    pytest.importorskip("tiktoken")
    tok = load_tokenizer(str(ASSETS / "gpt2.tiktoken"))
    assert (tok.info.kind, tok.info.vocab_size, tok.info.eos_id) == ("tiktoken", 50257, 50256)
    assert tok.encode_batch(["Hello world"]) == [[15496, 995]]  # GPT-2's published ids
    (ids,) = tok.encode_batch([TEXT])
    assert tok.decode(ids) == TEXT


@needs_assets
def test_sentencepiece_model_matches_its_library(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    path = ASSETS / "mistral-v1.model"
    tok = load_tokenizer(str(path))
    own = spm.SentencePieceProcessor(model_file=str(path))
    assert (tok.info.kind, tok.info.vocab_size, tok.info.eos_id) == ("sentencepiece", 32000, own.eos_id())
    assert tok.encode_batch([TEXT, "Hello"]) == own.encode([TEXT, "Hello"])
    # Named otherwise, a SentencePiece file is not guessed at: an unknown file, named in the error.
    odd = tmp_path / "tokenizer.bin"
    odd.write_bytes(path.read_bytes())
    with pytest.raises(TokenizerError, match=rf"{odd}: unknown tokenizer file"):
        load_tokenizer(str(odd))


def test_bad_tokenizer_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"missing\.json: no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    junk = tmp_path / "vocab.dat"
    junk.write_bytes(b"\x00\x01binary")
    with pytest.raises(TokenizerError, match=rf"{junk}: unknown tokenizer file"):
        load_tokenizer(str(junk))
    pytest.importorskip("tokenizers")
    not_tok = tmp_path / "config.json"
    not_tok.write_text('{"model_type": "llama"}')
    with pytest.raises(TokenizerError, match=rf"{not_tok}: not a Hugging Face tokenizer.json"):
        load_tokenizer(str(not_tok))


def test_a_missing_extra_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tok.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"needs the 'tokenizers' package.*pip install 'swarmtrain\[hf\]'"):
        load_tokenizer(str(path))
