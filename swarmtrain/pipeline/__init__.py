"""SWARM pipelines: a model too big for one peer, cut into stages that several servers each serve.

Trainers hold the data, the embeddings and the head, and drive each micro-batch through one server
per stage (routing.py), re-sending it to another server of the stage when one fails or stalls;
servers hold a contiguous range of transformer blocks (parts.py, server.py, service.py) and step their
own inner optimizer once they have accumulated enough samples; each part's holders average it (outer.py).
The roles that run them are in swarmtrain/roles; a stage server's choices are the pure rules of decisions.py
(its moves to the bottleneck stage by the rule of rebalance.py, its taking of a stage left without a server
by the rules of lost.py), and placement.py says where a server goes. docs/pipeline.md has the whole design.
Also: cut.py (which blocks each stage holds), llama_parts.py (the Llama's stage and end parts), tensors.py
(activations and gradients on the wire), trainer.py (a trainer's steps), stage_copies.py (a server's copies of its
neighbours' state), memory.py (what a stage needs in memory), errors.py (typed errors), service.py (a stage
served over gRPC), server.py (a stage's compute), outer.py (a part's outer rounds).
"""

from swarmtrain.pipeline.cut import stage_blocks, stage_of_block
from swarmtrain.pipeline.errors import (
    BadActivation,
    PipelineError,
    StageLost,
    StaleContext,
    UnknownMicrobatch,
    WrongStage,
)

__all__ = [
    "BadActivation",
    "PipelineError",
    "StageLost",
    "StaleContext",
    "UnknownMicrobatch",
    "WrongStage",
    "stage_blocks",
    "stage_of_block",
]
