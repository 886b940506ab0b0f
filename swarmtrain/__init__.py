"""swarmtrain: train one model on many far-apart peers with DiLoCo.

Map: config.py (RunConfig, loading, TOML) + config_sections.py, config_model.py, config_pipeline.py (one
documented dataclass per component) + daemon/config_reference.py (docs/configuration.md from those docs) · extras.py
(the optional `hf` extra) · models/ (GPT, Llama, transformers models; resolved signatures; training-state bytes) · data/
(tokenizers, corpora, token shards and `data prepare`, sharding) · diloco/ (outer loop, pure torch) · compress/ (codecs, kernels) · averaging/
(matchmaking, all-reduce) · discovery/ (hivemind DHT) · rpc/ (gRPC) · sync/ (state transfer,
checkpoints) · telemetry/ (event lines, counters, StatusSnapshot, console progress) · peer/ (the
peer daemon: composition root, round loops, network services, `swarmtrain peer` as a process) ·
daemon/ (CLI) · proctree.py (descendants of a process, signalled and awaited through pidfds) · process/ (stop
signals, child processes) · testbed/ (network-namespace WAN twin: shaped links, kernel byte counters; needs root) ·
testing/ (test helpers; never imported by the library).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
