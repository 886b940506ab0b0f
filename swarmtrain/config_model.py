"""The run config's `[model]` and `[data]` sections: which network, which tokens; documented and validated as
config_sections.py's (`swarmtrain config reference` reads these field docstrings too)."""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.config_sections import check

__all__ = ["ARCHS", "BYTES_TOKENIZER", "DataConfig", "ModelConfig"]

ARCHS = ("gpt", "llama", "hf")  # model.arch
BYTES_TOKENIZER = "bytes"  # data.tokenizer: one token per byte, no file
_LLAMA_ONLY = ("n_kv_head", "intermediate_size")


@dataclass(frozen=True)
class ModelConfig:
    """Which network to train: a built-in architecture whose `preset` picks the shape (each shape field > 0
    overrides the preset's value), or any Hugging Face causal LM from a local `config.json` (docs/models.md)."""

    arch: str = "gpt"
    """`gpt` (the built-in GPT: learned positions, LayerNorm, GELU, tied embeddings), `llama` (the built-in
    Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention; parameter names and layout as
    `transformers.LlamaForCausalLM`) or `hf` (`transformers.AutoModelForCausalLM` built from `hf_path`; needs
    the `hf` extra)."""
    preset: str = "tiny"
    """Named shape of `gpt` or `llama` (swarmtrain/config_presets.py). gpt: `tiny` (~0.12M parameters),
    `small` (~0.85M), `base` (~4.8M), `medium` (~25M), `gpt2-124m` (~86M with the byte vocabulary). llama
    (counts without embeddings): `tiny` (~0.1M), `small` (~0.7M), `base` (~4.3M), `150m` (OpenDiLoCo's 150M
    shape) or `1b` (TinyLlama-1.1B's shape). Not used by `hf`."""
    n_layer: int = 0
    """Transformer blocks; 0 = the preset's."""
    n_head: int = 0
    """Attention (query) heads per block; 0 = the preset's. `n_embd` must be divisible by it."""
    n_kv_head: int = 0
    """`llama`: key/value heads per block (grouped-query attention; `n_head` must be a multiple); 0 = the
    preset's."""
    n_embd: int = 0
    """Width of the embeddings and the residual stream; 0 = the preset's."""
    intermediate_size: int = 0
    """`llama`: hidden width of each block's SwiGLU MLP; 0 = the preset's."""
    context_len: int = 0
    """Longest sequence in tokens (`gpt`: rows of the learned position embedding; `llama`: the RoPE table);
    0 = the preset's. At least `data.seq_len`."""
    vocab_size: int = 256
    """`gpt`/`llama`: rows of the token embedding and the output head; at least the tokenizer's vocabulary
    (256 for `data.tokenizer = "bytes"`). `hf` takes its config.json's."""
    rope_theta: float = 10000.0
    """`llama`: base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """`llama`: ε of the RMSNorms."""
    tie_embeddings: bool = False
    """`llama`: the output head shares the token embedding's matrix (`gpt` always ties; `hf` follows its
    config.json's `tie_word_embeddings`)."""
    dropout: float = 0.0
    """`gpt`: dropout probability on the embeddings, the attention weights and each MLP's output while
    training; 0 = off (`llama` and `hf` take none)."""
    init_from: str = ""
    """`gpt`/`llama`: a safetensors file of the model's state_dict (e.g. a pretrained or warm-start
    checkpoint) to start from instead of the seeded init; every peer must hold the same file. Empty = the
    seeded init. (`hf`: put the weights beside the config.json in `hf_path`.)"""
    hf_path: str = ""
    """`hf`: a local `config.json`, or a local directory holding one (and, to start from them, weights that
    `from_pretrained` reads); nothing is downloaded. Every peer must hold the same config: a peer whose
    model differs from the run's is refused, naming the field."""
    signature: tuple[str, ...] = ()
    """Filled in by the coordinator: the resolved model (`name=value` of every dimension, the HF config's
    fields, the initial weights' hash), which peers compare with their own to name what differs. Empty in
    a config file."""
    fingerprint: str = ""
    """Filled in by the coordinator: sha256 of `signature`; a peer whose own model gives another is
    refused. Empty in a config file."""

    def __post_init__(self) -> None:
        from swarmtrain.config_presets import presets_of

        check(self.arch in ARCHS, "model.arch", f"{self.arch!r} is not one of {ARCHS}")
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "context_len"):
            check(getattr(self, k) >= 0, f"model.{k}", "must be >= 0 (0 = the preset's value)")
        check(self.vocab_size >= 2, "model.vocab_size", "must be >= 2")
        check(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        check(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        check(self.norm_eps > 0, "model.norm_eps", "must be > 0")
        if self.arch == "hf":
            check(bool(self.hf_path), "model.hf_path", "must name a local config.json or directory with "
                  "model.arch = 'hf'")
            for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "context_len"):
                check(getattr(self, k) == 0, f"model.{k}", "is set by the config.json with model.arch = 'hf'")
            check(not self.init_from, "model.init_from", "is not used with model.arch = 'hf' (put the weights "
                  "in the model.hf_path directory)")
            check(self.dropout == 0, "model.dropout", "is set by the config.json with model.arch = 'hf'")
            return
        check(not self.hf_path, "model.hf_path", f"is only used with model.arch = 'hf', not {self.arch!r}")
        presets = presets_of(self.arch)
        check(self.preset in presets, "model.preset",
              f"unknown {self.arch} preset {self.preset!r}; one of {sorted(presets)}")
        base = presets[self.preset]
        n_embd, n_head = self.n_embd or base.n_embd, self.n_head or base.n_head
        check(n_embd % n_head == 0, "model.n_embd", f"{n_embd} must be divisible by model.n_head ({n_head})")
        if self.arch == "gpt":
            for k in _LLAMA_ONLY:
                check(getattr(self, k) == 0, f"model.{k}", "is a llama field (model.arch = 'gpt')")
            return
        n_kv = self.n_kv_head or getattr(base, "n_kv_head", n_head)
        check(n_head % n_kv == 0, "model.n_kv_head", f"{n_kv} must divide model.n_head ({n_head})")
        check((n_embd // n_head) % 2 == 0, "model.n_head", f"head width {n_embd // n_head} (model.n_embd / "
              "model.n_head) must be even for the rotary embedding")
        check(self.dropout == 0, "model.dropout", "llama takes no dropout")

    def shape_value(self, key: str) -> int:
        """A dimension of a built-in architecture: the field when > 0, else the preset's."""
        from swarmtrain.config_presets import presets_of

        own = getattr(self, key)
        return int(own) if own else int(getattr(presets_of(self.arch)[self.preset], key))


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from (text files tokenized at start, or shards `swarmtrain data prepare` wrote) and
    how peers divide the stream (docs/models.md#data)."""

    paths: tuple[str, ...] = ()
    """Text files to train on, read whole and tokenized at start (small corpora); empty (and no `shards`) =
    the `.py` files of the Python standard library of the machine."""
    shards: str = ""
    """A directory of token shards written by `swarmtrain data prepare` (its manifest.json): read from disk
    a window at a time, so a peer's memory does not grow with the dataset. Excludes `paths`."""
    tokenizer: str = BYTES_TOKENIZER
    """`bytes` (one token per UTF-8 byte), or a tokenizer file: a Hugging Face `tokenizer.json` (`swarmtrain
    tokenizer train` makes one), a SentencePiece `.model` or a tiktoken BPE file (`.tiktoken`). Every peer
    must hold the same file (its hash is the run's `tokenizer_hash`); with `shards`, the one they were
    tokenized with. Files need the `hf` extra."""
    tokenizer_hash: str = ""
    """Filled in by the coordinator: sha256 of the tokenizer file (`bytes` for the byte tokenizer); a peer
    whose file hashes otherwise is refused. Empty in a config file."""
    val_fraction: float = 0.1
    """Fraction held out for validation (`paths`): each file is held out with this probability, by a hash
    of its name (a single file: its last `val_fraction` of bytes). Shards carry their own split."""
    batch_size: int = 8
    """Sequences per inner step on each peer."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass: each step's `batch_size` sequences are split into passes of this
    many whose gradients add up (gradient accumulation; the same data order and resume); must divide
    `batch_size`. 0 = `batch_size` (one pass)."""
    seq_len: int = 128
    """Tokens per training sequence; at most the model's context length."""
    max_corpus_bytes: int = 0
    """`paths`: read at most this many bytes of the corpus (files in order, the last one cut); 0 = all. Tests
    and demos cap the standard-library corpus for speed."""
    num_shards: int = 0
    """How peers split the stream. 0: each peer reads its own seeded permutation (an open swarm, no
    roster). K > 0: one permutation of the run's seed cut into K disjoint slots; each peer reads the slot
    its `shard_index` names, so K peers together read what data-parallel training over K ranks reads, never
    a window twice in an epoch."""
    shard_index: int = -1
    """With `num_shards` > 0: the slot this peer reads (`swarmtrain peer --shard-index`); -1 = the slot of
    its checkpoint, else the lowest slot no live peer reads. A slot a live peer reads is refused."""
    start_step: int = 0
    """Steps of its stream a fresh peer skips: those a `model.init_from` checkpoint was trained on (a
    resumed peer continues from its checkpoint's position)."""

    def __post_init__(self) -> None:
        check(0.0 < self.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
        check(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        check(self.micro_batch_size >= 0, "data.micro_batch_size", "must be >= 0 (0 = data.batch_size)")
        check(self.micro_batch_size == 0 or self.batch_size % self.micro_batch_size == 0, "data.micro_batch_size",
              f"{self.micro_batch_size} does not divide data.batch_size ({self.batch_size})")
        check(self.seq_len >= 1, "data.seq_len", "must be >= 1")
        check(self.max_corpus_bytes >= 0, "data.max_corpus_bytes", "must be >= 0")
        check(not (self.shards and self.paths), "data.shards", "excludes data.paths: train on prepared shards "
              "or on text files, not both")
        check(bool(self.tokenizer), "data.tokenizer", "must be 'bytes' or a tokenizer file")
        check(self.num_shards >= 0, "data.num_shards", "must be >= 0 (0 = each peer its own permutation)")
        check(self.shard_index >= -1, "data.shard_index", "must be >= 0, or -1 for none")
        check(self.num_shards == 0 or self.shard_index < self.num_shards, "data.shard_index",
              f"{self.shard_index} is not below data.num_shards={self.num_shards}")
        check(self.start_step >= 0, "data.start_step", "must be >= 0")

    @property
    def pass_size(self) -> int:
        """Sequences per forward/backward pass (`micro_batch_size`, or the whole batch)."""
        return self.micro_batch_size or self.batch_size
