"""Tokens for training. corpus.py: stdlib/user text as tokens, or prepared shards; sharding.py: disjoint,
resumable batches; order.py: a window order that needs no memory; shards.py: reading token shards from disk;
tokenizer.py: bytes, HF, SentencePiece, tiktoken; tokenizer_train.py: a byte-level BPE trained locally;
readers.py: documents of text/jsonl/parquet/HF datasets inputs; prepare.py: `swarmtrain data prepare`;
evaluation.py: perplexity and bits per byte.

Names are imported on first use, so `swarmtrain data prepare` and `tokenizer train` run without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["VOCAB_SIZE", "Corpus", "CorpusError", "ShardedBatches", "eval_batches", "load_corpus", "stdlib_files"]

_HOME = {"VOCAB_SIZE": "corpus", "Corpus": "corpus", "CorpusError": "corpus", "load_corpus": "corpus",
         "stdlib_files": "corpus", "ShardedBatches": "sharding", "eval_batches": "sharding"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'swarmtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarmtrain.data.{_HOME[name]}"), name)
