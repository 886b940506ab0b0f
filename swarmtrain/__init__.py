"""swarmtrain: train one model on many far-apart peers with DiLoCo.

Map, by layer from the bottom (docs/architecture.md#layers; swarmtrain/testing/layers.py checks it):
trust/ (run membership) · round/ (the outer round as pure code) · wire/ (generated gRPC code) · proctree.py
(descendants of a process through pidfds) · extras.py (the optional `hf` extra) · config.py (RunConfig,
loading, TOML) over config_sections.py, config_model.py, config_pipeline.py (one documented dataclass per
component) and config_presets.py (the named model shapes) · data/ (tokenizers, corpora, token shards,
sharding) · compress/ (codecs, kernels) · models/ (GPT, Llama, transformers models; resolved signatures;
training-state bytes) · diloco/ (the outer loop, pure torch) · discovery/ (hivemind DHT) · rpc/ (gRPC) ·
sync/ (state transfer, checkpoints, export) · averaging/ (matchmaking, all-reduce, the round's decision) ·
telemetry/ (event lines, counters, StatusSnapshot, console progress) · driver/ (the round driver) · process/
(stop signals, child processes) · peer/ (what roles are composed from: the worker's part, round loops, network
services) · pipeline/ (SWARM pipelines: compute, routing, rules) · roles/ (the DiLoCo worker, the stage server,
the trainer; a role as a process) · testbed/ (network-namespace WAN twin; needs root) · dashboard/
(HTTP page, JSON API, /metrics) · daemon/ (the CLI, config reference) · __main__.py (`python -m swarmtrain`) ·
testing/ (test helpers; never imported by the library).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
