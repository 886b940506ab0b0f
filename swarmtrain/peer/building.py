"""What a DiLoCo worker role builds before it joins the rounds: the worker (model, data slice, validation text) on
this process or as rank 0 of a local island, and the newest checkpoint of this run to resume from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmtrain.compress import Codec
from swarmtrain.config import RunConfig
from swarmtrain.data import eval_batches, load_corpus
from swarmtrain.data.evaluation import bytes_per_token
from swarmtrain.data.tokenizer import load_tokenizer
from swarmtrain.diloco import DilocoWorker, resolve_device
from swarmtrain.diloco.island import Island
from swarmtrain.diloco.island_steps import IslandWorker
from swarmtrain.diloco.worker import InnerStep
from swarmtrain.models import build_model
from swarmtrain.peer.data import peer_batches, peer_seed
from swarmtrain.peer.island import island_batches, setup_of
from swarmtrain.peer.services import PeerError
from swarmtrain.round.certificate import Certificate
from swarmtrain.sync.checkpoint import LoadedCheckpoint, load_latest_checkpoint

__all__ = ["BuiltWorker", "build_worker", "load_checkpoint", "resume"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltWorker:
    worker: DilocoWorker
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    val_bytes_per_token: float  # of the validation text: val_loss in bits per byte


def build_worker(cfg: RunConfig, *, peer_id: str, codec: Codec, island: Island | None,
                 on_step: Callable[[InnerStep], None] | None) -> BuiltWorker:
    """The worker of `peer_id` from the run's seed (every peer starts from the same θ); with `island`, as its rank 0
    leading the other ranks, which build their model and data slice meanwhile. Blocking: call it off the loop."""
    if island is not None:
        island.broadcast_object(("setup", setup_of(cfg, peer_id)))
    corpus = load_corpus(cfg.data)
    val = eval_batches(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                       num_batches=cfg.diloco.eval_batches)
    per_token = bytes_per_token(val, load_tokenizer(cfg.data.tokenizer))
    model = build_model(cfg.model, seed=cfg.train.seed, activation_checkpointing=cfg.train.activation_checkpointing)
    rng_seed = peer_seed(cfg.train.seed + 1, peer_id)
    worker: DilocoWorker
    if island is not None:
        batches = island_batches(cfg, corpus.train, peer_id, island)
        worker = IslandWorker(cfg, island=island, model=model, batches=batches, codec=codec, rng_seed=rng_seed,
                              on_step=on_step)
    else:
        worker = DilocoWorker(cfg, model=model, batches=peer_batches(cfg, corpus.train, peer_id),
                              device=resolve_device(cfg.train.device), codec=codec, rng_seed=rng_seed, on_step=on_step)
    return BuiltWorker(worker, val, per_token)


def load_checkpoint(cfg: RunConfig) -> LoadedCheckpoint | None:
    """The newest good checkpoint in `checkpoint.dir`, if any; one of another run or model is a PeerError."""
    if not cfg.checkpoint.dir:
        return None
    loaded = load_latest_checkpoint(cfg.checkpoint.dir)
    if loaded is None:
        return None
    if loaded.meta.get("run_id") != cfg.train.run_id:
        raise PeerError(f"{loaded.path}: checkpoint is of run {loaded.meta.get('run_id')!r}, "
                        f"not {cfg.train.run_id!r}; use another --checkpoint-dir")
    if loaded.meta.get("run_nonce", "") != cfg.train.run_nonce:
        raise PeerError(f"{loaded.path}: checkpoint is of another run of {cfg.train.run_id!r} (nonce "
                        f"{loaded.meta.get('run_nonce', '')!r}, this run's is {cfg.train.run_nonce!r}); "
                        "use another --checkpoint-dir")
    saved = (loaded.meta.get("run_config") or {}).get("model", {}).get("fingerprint", "")
    if saved and cfg.model.fingerprint and saved != cfg.model.fingerprint:
        raise PeerError(f"{loaded.path}: checkpoint is of another model (fingerprint {saved[:12]}, this run's "
                        f"{cfg.model.fingerprint[:12]}); use another --checkpoint-dir")
    return loaded


def resume(worker: DilocoWorker, loaded: LoadedCheckpoint) -> list[Certificate]:
    """Put `worker` at the checkpoint's state; the certificates it kept."""
    try:
        worker.load_state_dict(loaded.tensors, loaded.meta["worker"])
        certificates = [Certificate.from_json(c) for c in loaded.meta.get("certificates", [])]
    except (KeyError, ValueError) as e:
        raise PeerError(f"{loaded.path}: checkpoint does not fit this run (model or data layout): {e}") from e
    log.info("resumed from %s at round %d", loaded.path, worker.round)
    return certificates
