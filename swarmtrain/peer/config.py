"""A peer's config: the swarm's run config, with the few settings a peer owns itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swarmtrain.config import ConfigError, RunConfig, to_dict

__all__ = ["LOCAL_KEYS", "LOCAL_SECTIONS", "RUN_KEYS", "merge_run_config"]

# Sections a peer owns itself; every other section is the run's and comes from the coordinator.
LOCAL_SECTIONS = ("discovery", "rpc", "checkpoint")
# Single keys a peer owns in the run's sections (data.shard_index: which slot of a sharded run it reads;
# how it computes, which changes neither the data order nor what θ is).
LOCAL_KEYS: dict[str, tuple[str, ...]] = {"train": ("device", "threads", "memory_budget_mb", "precision", "compile",
                                                    "activation_checkpointing", "parallel",
                                                    "round_device"),
                                          "data": ("shard_index", "micro_batch_size")}
# Single keys of a peer's own sections that the run decides (rpc.tls: a TLS peer and a plain one cannot talk).
RUN_KEYS: dict[str, tuple[str, ...]] = {"rpc": ("tls",)}


def merge_run_config(swarm: RunConfig, local: RunConfig, *, local_overrides: Sequence[str] = ()) -> RunConfig:
    """The swarm's run config with this peer's local sections (discovery, rpc but rpc.tls, checkpoint) and
    keys (train.device/threads, data.shard_index).

    A `--set` of a run-wide field (model, data, optimizers, ...) is an error: it would make this peer
    train a different model than the swarm, so it must be set on the coordinator instead.
    """
    for text in local_overrides:
        section, _, rest = text.partition(".")
        key = rest.partition("=")[0].strip()
        if ((section not in LOCAL_SECTIONS and key not in LOCAL_KEYS.get(section, ()))
                or key in RUN_KEYS.get(section, ())):
            allowed = ", ".join(f"{s}.{k}" for s, ks in LOCAL_KEYS.items() for k in ks)
            raise ConfigError(f"{section}.{key}: comes from the swarm's run config; set it on the coordinator "
                              f"(a peer may set {', '.join(LOCAL_SECTIONS)} and {allowed})")
    local_dict = to_dict(local)
    merged: dict[str, Any] = {s: local_dict[s] for s in LOCAL_SECTIONS}
    swarm_dict = to_dict(swarm)
    for section, keys in RUN_KEYS.items():
        merged[section] = {**merged[section], **{k: swarm_dict[section][k] for k in keys}}
    merged.update({s: {k: local_dict[s][k] for k in keys} for s, keys in LOCAL_KEYS.items()})
    try:
        return swarm.replace(**merged)
    except ConfigError as e:  # e.g. a shard index the run's data.num_shards does not have
        raise ConfigError(f"this peer's settings do not fit the swarm's run: {e}") from e
