"""Typed, validated run configuration: defaults < TOML file < `section.key=value` overrides.

Each component owns one frozen dataclass (a *section*, in config_sections.py, config_model.py and config_pipeline.py,
re-exported here).
`RunConfig` composes them. Unknown sections or keys and values of the wrong type are `ConfigError`s
(a `ValueError`) naming the offending `section.key`, so a typo never silently falls back to a
default. `swarmtrain config reference` (daemon/config_reference.py) documents every field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmtrain.config_model import BYTES_TOKENIZER, DataConfig, ModelConfig
from swarmtrain.config_pipeline import PipelineConfig
from swarmtrain.config_sections import (
    CODEC_DEFAULTS,
    AveragingConfig,
    CheckpointConfig,
    CompressConfig,
    ConfigError,
    DashboardConfig,
    DilocoConfig,
    DiscoveryConfig,
    InnerConfig,
    OuterConfig,
    RpcConfig,
    TrainConfig,
    check,
)

__all__ = [
    "CODEC_DEFAULTS",
    "AveragingConfig",
    "CheckpointConfig",
    "CompressConfig",
    "ConfigError",
    "DashboardConfig",
    "DataConfig",
    "DilocoConfig",
    "DiscoveryConfig",
    "InnerConfig",
    "ModelConfig",
    "OuterConfig",
    "PipelineConfig",
    "RpcConfig",
    "RunConfig",
    "TrainConfig",
    "load_config",
    "public_dict",
    "to_dict",
    "to_toml",
    "toml_value",
    "with_codec_defaults",
]


# An outer momentum this high on sparse means made every arm measured diverge (docs/benchmarks.md#the-sparse-codecs-
# outer-step): the error-feedback residual already carries what past rounds did not send.
SPARSE_MAX_MOMENTUM = 0.9
BYTE_VOCAB_SIZE = 256  # the data's tokens are bytes (swarmtrain.data.VOCAB_SIZE; no torch import here)


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
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: each would otherwise fail only after start-up, deep inside training.
        # (`hf` models are read from their config.json when the run is resolved: models/spec.py.)
        m = self.model
        if m.arch != "hf":
            context_len = m.shape_value("context_len")
            check(self.data.seq_len <= context_len, "data.seq_len",
                  f"{self.data.seq_len} exceeds the model's context length {context_len} "
                  "(model.preset/model.context_len)")
            check(self.data.tokenizer != BYTES_TOKENIZER or m.vocab_size >= BYTE_VOCAB_SIZE, "model.vocab_size",
                  f"{m.vocab_size} is smaller than the data's {BYTE_VOCAB_SIZE} byte-level tokens")
            n_layer = m.shape_value("n_layer")
            check(self.pipeline.stages <= n_layer, "pipeline.stages",
                  f"{self.pipeline.stages} stages for a model of {n_layer} blocks: a stage holds at least one")
            check(self.diloco.fragments <= n_layer, "diloco.fragments",
                  f"{self.diloco.fragments} fragments for a model of {n_layer} blocks: a fragment holds at least one")
        check(m.arch != "hf" or self.pipeline.stages == 0, "pipeline.stages",
              "a pipeline cuts the built-in gpt or llama into stages; model.arch = 'hf' trains data-parallel only")
        check(self.diloco.fragments == 1 or self.pipeline.stages == 0, "diloco.fragments",
              "must be 1 with pipeline.stages > 0 (a stage's holders average whole stages)")
        if self.averaging.mode == "gossip":  # each peer its own φ: nothing here is built for that yet
            for key, on in (("compress.error_feedback", self.compress.error_feedback),
                            ("diloco.overlap", self.diloco.overlap), ("diloco.fragments", self.diloco.fragments > 1),
                            ("pipeline.stages", self.pipeline.stages > 0)):
                check(not on, key, "is not supported with averaging.mode = 'gossip' (docs/gossip.md)")
        check(self.compress.codec != "sparse" or self.outer.momentum < SPARSE_MAX_MOMENTUM, "outer.momentum",
              f"{self.outer.momentum} with compress.codec = 'sparse' diverges (measured: val loss above its start "
              "after 32 rounds); use the codec's own outer step: leave outer.lr, outer.momentum and outer.nesterov "
              "unset, or set outer.momentum = 0, outer.nesterov = false, outer.lr = 4 "
              "(docs/benchmarks.md#the-sparse-codecs-outer-step)")
        check(not (self.averaging.gathers(self.compress.codec) and self.averaging.aggregator != "mean"),
              "averaging.aggregator",
              f"{self.averaging.aggregator!r} with gathered contributions (compress.codec = {self.compress.codec!r}, "
              f"averaging.combine = {self.averaging.combine!r}): members average them by their mean")

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
            lines.append(f"{key} = {toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(v: Any) -> str:
    """One value as TOML (a list of them included)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's resolved field types (resolving them is most of a run record's decode)."""
    return typing.get_type_hints(cls)


def _section_types() -> dict[str, type]:
    hints = _hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build a validated RunConfig; unknown sections/keys and wrong types raise ConfigError. Keys left unset
    take the defaults of the codec `compress.codec` names (CODEC_DEFAULTS), then their section's."""
    sections = _section_types()
    built: dict[str, Any] = {}
    for name, values in with_codec_defaults(data).items():
        if name not in sections:
            raise ConfigError(f"{name}: unknown config section; known: {sorted(sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{name}: must be a table of key = value")
        built[name] = _build_section(name, sections[name], values)
    return RunConfig(**built)


def with_codec_defaults(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """`data` with the keys it leaves unset that its codec has its own defaults for (CODEC_DEFAULTS) filled in;
    every key `data` sets, and anything malformed (reported by from_dict), is kept as it is."""
    compress = data.get("compress")
    codec = compress.get("codec") if isinstance(compress, Mapping) else None
    defaults = CODEC_DEFAULTS.get(codec) if isinstance(codec, str) else None
    if not defaults:
        return data
    out = dict(data)
    for section, keys in defaults.items():
        values = out.get(section, {})
        if isinstance(values, Mapping):
            out[section] = {**keys, **values}
    return out


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = _hints(cls)
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
