"""`swarmtrain tokenizer train`: a byte-level BPE (GPT-2's scheme) trained on local files, as a tokenizer.json."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from swarmtrain.data.tokenizer import load_tokenizer
from swarmtrain.extras import require

__all__ = ["EOS_TOKEN", "train_bpe"]

EOS_TOKEN = "<|endoftext|>"  # id 0: the documents' separator


def train_bpe(texts: Iterable[str], *, vocab_size: int, out: str | os.PathLike[str], min_frequency: int = 2) -> int:
    """Train a byte-level BPE of `vocab_size` tokens (256 bytes + merges + the end-of-text token) on `texts`,
    write it to `out` (atomically: a temp file renamed) and return its vocabulary size."""
    if vocab_size < 257:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes and EOS)")
    tokenizers = require("tokenizers", purpose="swarmtrain tokenizer train")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tok.save(str(tmp))
        load_tokenizer(str(tmp))  # what `data.tokenizer` will read: an end-of-text token, a known kind
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return int(tok.get_vocab_size())
