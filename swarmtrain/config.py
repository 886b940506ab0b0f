"""Typed, validated run configuration: defaults < TOML file < `section.key=value` overrides.

Each component owns one frozen dataclass (a *section*). `RunConfig` composes them. Unknown
sections or keys and values of the wrong type are `ConfigError`s (a `ValueError`) naming the
offending `section.key`, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AveragingConfig",
    "CheckpointConfig",
    "CompressConfig",
    "ConfigError",
    "DataConfig",
    "DilocoConfig",
    "DiscoveryConfig",
    "InnerConfig",
    "ModelConfig",
    "OuterConfig",
    "RpcConfig",
    "RunConfig",
    "TrainConfig",
    "load_config",
    "public_dict",
    "to_dict",
    "to_toml",
]


BYTE_VOCAB_SIZE = 256  # the data's tokens are bytes (swarmtrain.data.VOCAB_SIZE; no torch import here)


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names which."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    """Which GPT to build. `preset` picks the shape; explicit fields > 0 override it."""

    preset: str = "tiny"
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    context_len: int = 0
    vocab_size: int = 256
    dropout: float = 0.0
    # Start from these weights (a safetensors file of the model's state_dict, e.g. a pretrained or
    # warm-start checkpoint) instead of the seeded init. Every peer must hold the same file.
    init_from: str = ""

    def __post_init__(self) -> None:
        from swarmtrain.models.presets import PRESETS

        _check(self.preset in PRESETS, "model.preset", f"unknown preset {self.preset!r}; one of {sorted(PRESETS)}")
        for k in ("n_layer", "n_head", "n_embd", "context_len"):
            _check(getattr(self, k) >= 0, f"model.{k}", "must be >= 0 (0 = the preset's value)")
        _check(self.vocab_size >= 2, "model.vocab_size", "must be >= 2")
        _check(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        n_embd, n_head = self.n_embd or PRESETS[self.preset].n_embd, self.n_head or PRESETS[self.preset].n_head
        _check(n_embd % n_head == 0, "model.n_embd", f"{n_embd} must be divisible by model.n_head ({n_head})")


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Empty `paths` = the embedded Python-stdlib corpus."""

    paths: tuple[str, ...] = ()
    val_fraction: float = 0.1
    batch_size: int = 8
    seq_len: int = 128
    max_corpus_bytes: int = 0  # 0 = no cap; tests and demos cap the stdlib corpus for speed
    # How peers split the stream. 0: each peer reads its own seeded permutation (an open swarm, no
    # roster). K > 0: one permutation of the run's seed cut into K disjoint slots, and each peer reads
    # the slot its own (local) `shard_index` names, so K peers together read what data-parallel
    # training over K ranks reads, never a window twice in an epoch.
    num_shards: int = 0
    shard_index: int = -1  # a peer's own setting; -1 = its checkpoint's slot, else the lowest free one
    # Steps of its stream a fresh peer skips: those a `model.init_from` checkpoint was trained on.
    start_step: int = 0

    def __post_init__(self) -> None:
        _check(0.0 < self.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
        _check(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        _check(self.seq_len >= 1, "data.seq_len", "must be >= 1")
        _check(self.max_corpus_bytes >= 0, "data.max_corpus_bytes", "must be >= 0")
        _check(self.num_shards >= 0, "data.num_shards", "must be >= 0 (0 = each peer its own permutation)")
        _check(self.shard_index >= -1, "data.shard_index", "must be >= 0, or -1 for none")
        _check(self.num_shards == 0 or self.shard_index < self.num_shards, "data.shard_index",
               f"{self.shard_index} is not below data.num_shards={self.num_shards}")
        _check(self.start_step >= 0, "data.start_step", "must be >= 0")


@dataclass(frozen=True)
class InnerConfig:
    """The inner (local) optimizer each worker runs between syncs."""

    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 = off
    momentum: float = 0.0  # for optimizer = "sgd"

    def __post_init__(self) -> None:
        _check(self.optimizer in ("adamw", "sgd"), "inner.optimizer", f"{self.optimizer!r} is not 'adamw' or 'sgd'")
        _check(self.lr > 0, "inner.lr", "must be > 0")
        _check(self.weight_decay >= 0, "inner.weight_decay", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1/beta2", "must be in [0, 1)")
        _check(self.warmup_steps >= 0, "inner.warmup_steps", "must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", "must be in [0, 1]")
        _check(self.grad_clip >= 0, "inner.grad_clip", "must be >= 0")
        _check(0 <= self.momentum < 1, "inner.momentum", "must be in [0, 1)")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer applied to θ_global with the averaged pseudo-gradient."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        _check(self.lr > 0, "outer.lr", "must be > 0")
        _check(0 <= self.momentum < 1, "outer.momentum", "must be in [0, 1)")
        _check(not (self.nesterov and self.momentum == 0), "outer.nesterov", "needs outer.momentum > 0")


@dataclass(frozen=True)
class DilocoConfig:
    """The outer loop: H inner steps per round, rounds to run."""

    inner_steps: int = 50
    rounds: int = 10
    eval_batches: int = 8
    # The peer daemon scores θ_global on eval_batches after every this many committed rounds (its round
    # lines' val_loss); 0 = never (a benchmark that evaluates the final weights itself). `simulate`
    # evaluates every round.
    eval_every_rounds: int = 1
    # Average round r's Δ while the first inner steps of round r+1 run (communication hidden behind
    # compute): θ_local starts round r+1 from the outer step applied to its own Δ, and the swarm's
    # mean corrects it when it lands. Off = classic DiLoCo (train, then wait for the average).
    overlap: bool = False
    # At most this many inner steps of round r+1 run before round r's mean has landed; a peer that
    # gets there waits for it. A longer lag made the correction overshoot (see README). Simulations
    # land every mean exactly here, the worst case.
    overlap_max_steps: int = 3
    # "steps": every peer takes inner_steps steps per round, and the round waits for the slowest.
    # "time": every peer trains for the same span per round, sized from the last round's group so
    # that the swarm takes inner_steps steps per peer on average (inner_steps / the members' median
    # step rate): a faster peer takes more steps, a slower one fewer (at least 1, at most
    # PACE_MAX_STEPS_FACTOR x inner_steps), and all of them post at once.
    pace: str = "steps"

    def __post_init__(self) -> None:
        _check(self.inner_steps >= 1, "diloco.inner_steps", "must be >= 1")
        _check(self.pace in ("steps", "time"), "diloco.pace", f"{self.pace!r} is not 'steps' or 'time'")
        _check(self.rounds >= 1, "diloco.rounds", "must be >= 1")
        _check(self.eval_batches >= 1, "diloco.eval_batches", "must be >= 1")
        _check(self.eval_every_rounds >= 0, "diloco.eval_every_rounds", "must be >= 0")
        _check(self.overlap_max_steps >= 1, "diloco.overlap_max_steps", "must be >= 1")


@dataclass(frozen=True)
class CompressConfig:
    """How pseudo-gradients are encoded on the wire."""

    codec: str = "fp32"
    block_size: int = 64
    scale_dtype: str = "fp32"
    stochastic_rounding: bool = False
    zstd_level: int = 0  # 0 = no zstd stage
    error_feedback: bool = False

    def __post_init__(self) -> None:
        codecs = ("fp32", "fp16", "bf16", "int8", "int4")
        _check(self.codec in codecs, "compress.codec", f"{self.codec!r} is not one of {codecs}")
        _check(self.block_size >= 2 and self.block_size % 2 == 0, "compress.block_size", "must be even and >= 2")
        _check(self.scale_dtype in ("fp32", "fp16"), "compress.scale_dtype", "must be 'fp32' or 'fp16'")
        _check(0 <= self.zstd_level <= 22, "compress.zstd_level", "must be in [0, 22]")


@dataclass(frozen=True)
class DiscoveryConfig:
    """The control plane (hivemind DHT)."""

    initial_peers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False
    nat_port_map: bool = False
    use_auto_relay: bool = False
    identity_path: str = ""
    heartbeat_s: float = 2.0
    record_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "discovery.port", "must be in [0, 65535]")
        _check(self.heartbeat_s > 0, "discovery.heartbeat_s", "must be > 0")
        _check(self.record_ttl_s > self.heartbeat_s, "discovery.record_ttl_s", "must exceed discovery.heartbeat_s")


@dataclass(frozen=True)
class RpcConfig:
    """The data plane (gRPC)."""

    host: str = "127.0.0.1"
    port: int = 0
    announce: str = ""  # HOST:PORT others should dial; empty = the bound address
    run_key: str = ""  # shared secret; env SWARMTRAIN_RUN_KEY overrides when set
    call_timeout_s: float = 30.0
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 8 << 20
    retries: int = 3
    backoff_s: float = 0.2
    # "tcp": all-reduce payloads move over a second, raw TCP port (rpc/bulk.py; open it too behind a
    # firewall); "grpc": everything through rpc.port. Others adapt to what this peer serves.
    bulk_transport: str = "tcp"
    bulk_port: int = 0

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "rpc.port", "must be in [0, 65535]")
        _check(self.bulk_transport in ("tcp", "grpc"), "rpc.bulk_transport", "must be 'tcp' or 'grpc'")
        _check(0 <= self.bulk_port < 65536, "rpc.bulk_port", "must be in [0, 65535]")
        _check(self.call_timeout_s > 0, "rpc.call_timeout_s", "must be > 0")
        _check(1024 <= self.chunk_bytes <= self.max_message_bytes, "rpc.chunk_bytes", "must be in [1024, rpc.max_message_bytes]")
        _check(self.retries >= 0, "rpc.retries", "must be >= 0")
        _check(self.backoff_s >= 0, "rpc.backoff_s", "must be >= 0")


@dataclass(frozen=True)
class AveragingConfig:
    """Matchmaking and the fault-tolerant all-reduce."""

    min_peers: int = 2
    matchmaking_timeout_s: float = 5.0
    allreduce_timeout_s: float = 60.0
    max_retries: int = 1
    contribution_window_s: float = 15.0  # a reducer waits this long for shards after its round opens

    def __post_init__(self) -> None:
        _check(self.min_peers >= 1, "averaging.min_peers", "must be >= 1")
        _check(self.contribution_window_s > 0, "averaging.contribution_window_s", "must be > 0")
        _check(self.matchmaking_timeout_s > 0, "averaging.matchmaking_timeout_s", "must be > 0")
        _check(self.allreduce_timeout_s > 0, "averaging.allreduce_timeout_s", "must be > 0")
        _check(self.max_retries >= 0, "averaging.max_retries", "must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a peer saves its state."""

    dir: str = ""  # empty = no checkpoints
    every_rounds: int = 1
    keep: int = 2

    def __post_init__(self) -> None:
        _check(self.every_rounds >= 1, "checkpoint.every_rounds", "must be >= 1")
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    """Run-wide settings: identity, seed, device, threads."""

    run_id: str = "swarmtrain"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default

    def __post_init__(self) -> None:
        _check(bool(self.run_id) and all(c.isalnum() or c in "-_." for c in self.run_id), "train.run_id", "must be non-empty [A-Za-z0-9._-]")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "train.device", f"{self.device!r} is not auto, cpu or cuda[:N]")
        _check(self.threads >= 0, "train.threads", "must be >= 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; the unit that is published to the swarm and shown by `config show`."""

    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: each would otherwise fail only after start-up, deep inside training.
        from swarmtrain.models.presets import PRESETS

        context_len = self.model.context_len or PRESETS[self.model.preset].context_len
        _check(self.data.seq_len <= context_len, "data.seq_len",
               f"{self.data.seq_len} exceeds the model's context length {context_len} (model.preset/model.context_len)")
        _check(self.model.vocab_size >= BYTE_VOCAB_SIZE, "model.vocab_size",
               f"{self.model.vocab_size} is smaller than the data's {BYTE_VOCAB_SIZE} byte-level tokens")

    def replace(self, **sections: Any) -> RunConfig:
        """Return a copy with whole sections or `section={key: value}` dicts merged in."""
        return from_dict(_deep_merge(to_dict(self), sections))


# ---------------------------------------------------------------- conversion helpers


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, JSON/TOML-friendly dict (tuples become lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


SECRET_FIELDS: tuple[tuple[str, str], ...] = (("rpc", "run_key"),)


def public_dict(cfg: RunConfig) -> dict[str, Any]:
    """`to_dict(cfg)` with secrets blanked: what may be published to the DHT or printed."""
    out = to_dict(cfg)
    for section, key in SECRET_FIELDS:
        out[section][key] = ""
    return out


def to_toml(cfg: RunConfig) -> str:
    """Render a config as TOML (the resolved config `config show` prints)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, v in values.items():
            lines.append(f"{key} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build a validated RunConfig; unknown sections/keys and wrong types raise ConfigError."""
    sections = _section_types()
    built: dict[str, Any] = {}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"{name}: unknown config section; known: {sorted(sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{name}: must be a table of key = value")
        built[name] = _build_section(name, sections[name], values)
    return RunConfig(**built)


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key; known: {sorted(known)}")
        kwargs[key] = _coerce(f"{name}.{key}", hints[key], raw)
    return cls(**kwargs)


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    """Check a TOML/JSON value against a field type (bool is never an int, ints widen to float)."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {raw!r}")
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        return tuple(_coerce(name, item, x) for x in raw)
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{name}: union-typed fields are not supported")
    if typ is bool:
        if isinstance(raw, bool):
            return raw
    elif typ is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif typ is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif typ is str:
        if isinstance(raw, str):
            return raw
    else:
        raise ConfigError(f"{name}: unsupported field type {typ!r}")
    raise ConfigError(f"{name}: expected {typ.__name__}, got {raw!r}")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `section.key=value`; the value is read as TOML (bare words become strings)."""
    if "=" not in text:
        raise ConfigError(f"{text!r}: an override must look like section.key=value")
    path, _, raw = text.partition("=")
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{path!r}: an override key must be section.key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as codec=int8 is a string
    return parts[0], parts[1], value


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Defaults, then the TOML file at `path` (if any), then `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid TOML ({e})") from e
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"{section}: must be a table of key = value")
        data[section][key] = value
    return from_dict(data)
