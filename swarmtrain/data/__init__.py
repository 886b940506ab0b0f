"""Corpora and sharding. corpus.py: stdlib/user text as byte tokens; sharding.py: disjoint batches."""

from swarmtrain.data.corpus import VOCAB_SIZE, Corpus, CorpusError, load_corpus, stdlib_files
from swarmtrain.data.sharding import ShardedBatches, eval_batches

__all__ = ["VOCAB_SIZE", "Corpus", "CorpusError", "ShardedBatches", "eval_batches", "load_corpus", "stdlib_files"]
