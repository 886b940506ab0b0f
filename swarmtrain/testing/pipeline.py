"""An in-process pipeline swarm for tests and benchmarks: stage servers and trainers on loopback gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from swarmtrain.config import RunConfig
from swarmtrain.pipeline.parts import assemble, build_ends, build_stage
from swarmtrain.pipeline.routing import Server
from swarmtrain.pipeline.server import StageServer
from swarmtrain.pipeline.service import StageHandler, serve_stage
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.pipeline.trainer import PipelineTrainer
from swarmtrain.rpc.node import RpcNode

__all__ = ["PipelineSwarm", "ServerProcess", "reference_model"]


@dataclass
class ServerProcess:
    """One stage server as a peer would run it: its node and its compute."""

    name: str
    stage: int
    node: RpcNode
    server: StageServer
    handler: StageHandler

    @property
    def info(self) -> Server:
        return Server(self.name, self.node.endpoint, self.stage)


@dataclass
class PipelineSwarm:
    """`servers_per_stage` servers of each stage and `trainers` trainers in this process. Every server of a
    stage starts from the same weights (seeded by the run), as healed servers would."""

    cfg: RunConfig
    servers_per_stage: int = 1
    trainers: int = 1
    max_inflight: int = 0
    servers: list[ServerProcess] = field(default_factory=list)
    trainer_nodes: list[RpcNode] = field(default_factory=list)
    pipeline_trainers: list[PipelineTrainer] = field(default_factory=list)
    forgotten: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        cfg, pipe = self.cfg, self.cfg.pipeline
        width = cfg.model.shape_value("n_embd")
        codec = TensorCodec(pipe.activation_codec, max_shape=(pipe.microbatch_size, cfg.data.seq_len, width))
        for stage in range(pipe.stages):
            for i in range(self.servers_per_stage):
                self.servers.append(self._server(f"s{stage}.{i}", stage, codec))
        for t in range(self.trainers):
            node = RpcNode(cfg.rpc, peer_id=f"t{t}", serve=False)
            self.trainer_nodes.append(node)
            self.pipeline_trainers.append(PipelineTrainer(node, build_ends(cfg.model, seed=cfg.train.seed), cfg,
                                                          servers=self.live, max_inflight=self.max_inflight))

    def _server(self, name: str, stage: int, codec: TensorCodec) -> ServerProcess:
        cfg = self.cfg
        node = RpcNode(cfg.rpc, peer_id=name)
        part = build_stage(cfg.model, stage, cfg.pipeline.stages, seed=cfg.train.seed)
        server = StageServer(part, stage=stage, pipeline=cfg.pipeline, inner=cfg.inner,
                             total_steps=cfg.diloco.rounds * cfg.diloco.inner_steps, seq_len=cfg.data.seq_len)
        handler = serve_stage(node, server, codec=codec)
        return ServerProcess(name, stage, node, server, handler)

    def __enter__(self) -> PipelineSwarm:
        for s in self.servers:
            s.node.start()
        for node in self.trainer_nodes:
            node.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for node in [*self.trainer_nodes, *(s.node for s in self.servers)]:
            node.close()
        for s in self.servers:
            s.handler.close()

    def live(self) -> list[Server]:
        """What the directory lists: every server whose record has not expired (a killed one's lingers
        until `forget`, as a DHT record does until its TTL)."""
        return [s.info for s in self.servers if s.name not in self.forgotten]

    def kill(self, name: str, *, forget: bool = False) -> ServerProcess:
        """Stop a server's node at once (calls in flight fail, nothing is answered any more); with `forget`
        its record is gone too."""
        victim = next(s for s in self.servers if s.name == name)
        victim.node.close()
        if forget:
            self.forgotten.add(name)
        return victim

    def model(self, *, trainer: int = 0, replica: int = 0) -> nn.Module:
        """One model of the trainer's ends and replica `replica` of each stage."""
        parts = [s.server.part for s in self.servers if s.name.endswith(f".{replica}")]
        return assemble(self.pipeline_trainers[trainer].ends, parts, vocab_size=self.cfg.model.vocab_size)


def reference_model(cfg: RunConfig) -> nn.Module:
    """The single-process model a pipeline of `cfg` starts from."""
    parts = [build_stage(cfg.model, k, cfg.pipeline.stages, seed=cfg.train.seed)
                       for k in range(cfg.pipeline.stages)]
    return assemble(build_ends(cfg.model, seed=cfg.train.seed), parts, vocab_size=cfg.model.vocab_size)
