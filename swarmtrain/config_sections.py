"""The run config's sections: one frozen, validated dataclass per component, each field documented.

The string literal under each field is its meaning; `swarmtrain config reference` (daemon/config_reference.py)
reads these attribute docstrings from this source and turns them into docs/configuration.md, and a
unit test fails on a field without one. `swarmtrain.config` composes the sections into `RunConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CODEC_DEFAULTS",
    "AveragingConfig",
    "CheckpointConfig",
    "CompressConfig",
    "ConfigError",
    "DilocoConfig",
    "DiscoveryConfig",
    "InnerConfig",
    "OuterConfig",
    "RpcConfig",
    "TrainConfig",
    "check",
]


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names which."""


def check(cond: bool, name: str, msg: str) -> None:
    """Raise `ConfigError("{name}: {msg}")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{name}: {msg}")


COMBINES = ("auto", "reencode", "gather")  # averaging.combine
AVERAGING_MODES = ("allreduce", "gossip")  # averaging.mode
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # train.precision
PARALLELS = ("ddp", "fsdp")  # train.parallel
ROUND_DEVICES = ("train", "cpu")  # train.round_device

# The outer step that goes with a codec where it is not the sections' defaults: a config that names the codec
# gets these for the keys it leaves unset (config.from_dict). The sparse codec's is SparseLoCo's: the
# error-feedback residual, decayed by β, already carries what past rounds did not send, as a momentum would,
# so the outer step adds none and takes a larger lr (docs/benchmarks.md#sparse-pseudo-gradients).
CODEC_DEFAULTS: dict[str, dict[str, dict[str, bool | float]]] = {
    "sparse": {"compress": {"error_feedback": True, "error_feedback_decay": 0.9},
               "outer": {"lr": 4.0, "momentum": 0.0, "nesterov": False}},
}


@dataclass(frozen=True)
class TrainConfig:
    """The run's identity and seed, and the device and threads of each process."""

    run_id: str = "swarmtrain"
    """Name of the run (`[A-Za-z0-9._-]`): peers find the run's records under it, and refuse records and
    state of another run."""
    seed: int = 0
    """Seed of the run: the initial weights and the data permutation; mixed with each peer's id, that
    peer's own data order (unsharded runs), dropout and stochastic rounding."""
    device: str = "auto"
    """Where a peer trains: `auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    threads: int = 0
    """torch intra-op threads of the process; 0 = torch's default."""
    memory_budget_mb: int = 0
    """Memory this peer may give the model's training state, in MB (a peer's own; 0 = no limit). A worker
    whose whole model needs more refuses to start (join as a pipeline stage server instead); a stage server
    takes only a stage that fits (docs/pipeline.md#memory)."""
    precision: str = "auto"
    """Arithmetic of a peer's forward and backward passes (weights, optimizer states and θ_global stay fp32):
    `auto` (bf16 autocast on CUDA, fp32 elsewhere), `fp32`, `bf16` (autocast) or `fp16` (autocast with a
    dynamic gradient scaler: a step whose gradients overflow is skipped and the scale halved)."""
    compile: bool = False
    """Run the model's forward through `torch.compile` (the first steps pay for the compilation; needs a
    C++ compiler on CPU)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them: about
    a third more compute for a fraction of the activation memory (the big presets)."""
    parallel: str = "ddp"
    """How the ranks of a peer that is an island (`swarmtrain peer --nproc-per-node N`, torchrun) share its
    model: `ddp` (each rank holds all of it; gradients averaged) or `fsdp` (FSDP2: each rank holds 1/N of the
    weights, gradients and inner optimizer moments; rank 0 also keeps θ_local, θ_global and the outer
    momentum whole). One process has nothing to share: it trains alone either way."""
    round_device: str = "train"
    """Where a peer keeps θ_global, the outer momentum and the error-feedback residual, and runs the round's
    arithmetic (Δ, the codec's encode and decode, the reducer's sums, the outer step): `train` (on the device it
    trains on: on a GPU the round stays there, through the CUDA kernels, and only encoded bytes cross to the
    host) or `cpu` (in host memory: on a GPU short of memory, it spares 8 bytes per parameter there, 12 with
    error feedback). Either way θ_global is bit-identical to every other peer's
    (docs/architecture.md#where-the-round-runs)."""
    run_nonce: str = ""
    """This run among all runs of the same `run_id` (`[A-Za-z0-9._-]`, at most 64): peers refuse a
    checkpoint or a donor's state of another nonce, naming both. Empty: the coordinator draws a random
    one when it starts a run (or keeps the one its run record already has); set it to restart a run's
    coordinator from scratch without orphaning the peers' checkpoints."""

    def __post_init__(self) -> None:
        check(bool(self.run_id) and all(c.isalnum() or c in "-_." for c in self.run_id), "train.run_id",
              "must be non-empty [A-Za-z0-9._-]")
        check(len(self.run_nonce) <= 64 and all(c.isalnum() or c in "-_." for c in self.run_nonce), "train.run_nonce",
              "must be at most 64 of [A-Za-z0-9._-]")
        check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "train.device",
              f"{self.device!r} is not auto, cpu or cuda[:N]")
        check(self.threads >= 0, "train.threads", "must be >= 0")
        check(self.memory_budget_mb >= 0, "train.memory_budget_mb", "must be >= 0 (0 = no limit)")
        check(self.precision in PRECISIONS, "train.precision", f"{self.precision!r} is not one of {PRECISIONS}")
        check(self.parallel in PARALLELS, "train.parallel", f"{self.parallel!r} is not one of {PARALLELS}")
        check(self.round_device in ROUND_DEVICES, "train.round_device",
              f"{self.round_device!r} is not one of {ROUND_DEVICES}")


@dataclass(frozen=True)
class InnerConfig:
    """The inner (local) optimizer each peer runs between two averagings, and its learning-rate schedule."""

    optimizer: str = "adamw"
    """`adamw` or `sgd`."""
    lr: float = 3e-3
    """Peak learning rate: linear warmup over `warmup_steps`, then cosine decay to `lr × min_lr_ratio` at
    step `diloco.rounds × diloco.inner_steps`."""
    weight_decay: float = 0.1
    """Weight decay of the matrices and embeddings (parameters with >= 2 dimensions; decoupled for AdamW);
    biases and LayerNorm weights get none."""
    beta1: float = 0.9
    """AdamW's first-moment decay rate β1."""
    beta2: float = 0.95
    """AdamW's second-moment decay rate β2."""
    warmup_steps: int = 50
    """Inner steps of linear warmup from `lr / warmup_steps` to `lr`."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of `lr`."""
    grad_clip: float = 1.0
    """Clip the gradient's global L2 norm to this before each inner step; 0 = no clipping."""
    momentum: float = 0.0
    """SGD momentum (`optimizer = "sgd"` only); 0 = plain SGD."""

    def __post_init__(self) -> None:
        check(self.optimizer in ("adamw", "sgd"), "inner.optimizer", f"{self.optimizer!r} is not 'adamw' or 'sgd'")
        check(self.lr > 0, "inner.lr", "must be > 0")
        check(self.weight_decay >= 0, "inner.weight_decay", "must be >= 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1/beta2", "must be in [0, 1)")
        check(self.warmup_steps >= 0, "inner.warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", "must be in [0, 1]")
        check(self.grad_clip >= 0, "inner.grad_clip", "must be >= 0")
        check(0 <= self.momentum < 1, "inner.momentum", "must be in [0, 1)")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with momentum on θ_global, with the averaged pseudo-gradient Δ = θ_global −
    θ_local as its gradient."""

    lr: float = 0.7
    """Outer learning rate; 1 with `momentum` 0 makes θ_global the plain mean of the peers' θ_local."""
    momentum: float = 0.9
    """Momentum μ of the outer step (buffer ← μ·buffer + Δ); 0 = none."""
    nesterov: bool = True
    """Nesterov momentum (θ ← θ − lr·(Δ + μ·buffer)) instead of heavy ball (θ ← θ − lr·buffer); needs
    `momentum` > 0."""

    def __post_init__(self) -> None:
        check(self.lr > 0, "outer.lr", "must be > 0")
        check(0 <= self.momentum < 1, "outer.momentum", "must be in [0, 1)")
        check(not (self.nesterov and self.momentum == 0), "outer.nesterov", "needs outer.momentum > 0")


@dataclass(frozen=True)
class DilocoConfig:
    """The outer loop: inner steps per round, rounds to run, evaluation, pacing and overlap."""

    inner_steps: int = 50
    """H: inner steps each peer takes per round (with `pace = "time"`: the swarm's average per peer)."""
    rounds: int = 10
    """Outer rounds of the run: a peer leaves once this many have committed. Also sets the inner schedule's
    length (`rounds × inner_steps` steps)."""
    eval_batches: int = 8
    """Validation batches (`data.batch_size` sequences of `data.seq_len` tokens, spread evenly over the
    validation split) an evaluation averages its loss over."""
    eval_every_rounds: int = 1
    """A peer scores θ_global on the validation batches after every this many committed rounds (its round
    lines' `val_loss`); 0 = never. `swarmtrain simulate` evaluates every round."""
    overlap: bool = False
    """Average round r's Δ while the first inner steps of round r+1 run (communication hidden behind
    compute): θ_local starts round r+1 from the outer step applied to its own Δ, and the swarm's mean
    corrects it when it lands, on the training thread between two inner steps unless the commit brings
    an evaluation or a checkpoint (then the steps stop there: keep `eval_every_rounds` and
    `checkpoint.every_rounds` above 1). Off = classic DiLoCo (train, then wait for the average)."""
    overlap_max_steps: int = 3
    """With `overlap`: at most this many inner steps of round r+1 run before round r's mean has landed; a
    peer that gets there waits for it (a longer lag makes the correction overshoot; benchmarks/overlap.py
    measures it). Simulations land every mean exactly here, the worst case. Raise it when means land later than
    this on real links (the round line's lag says by how many steps); the testbed's measurements of which
    values keep peers computing are in docs/benchmarks.md#no-waiting-sparse-rounds-overlapped-in-fragments."""
    eager: str = "fitted"
    """With `overlap`: how a peer guesses the round's mean to start its next inner steps from, as λ × its own
    contribution. `fitted`: λ fitted by least squares to the rounds this peer saw commit (its contribution
    against the committed mean, recent rounds weighted most), from the first committed overlapped round on.
    `own`: λ = 1 with a dense codec, 1 / the group's size with a gathered (sparse) one. The guess only moves
    θ_local until the mean lands; measured in docs/benchmarks.md#a-fitted-guess."""
    pace: str = "steps"
    """`steps`: every peer takes `inner_steps` steps per round, and the round waits for the slowest.
    `time`: every peer trains for the same span per round, sized from the last round's group so that the
    swarm takes `inner_steps` steps per peer on average (`inner_steps` / the members' median step rate): a
    faster peer takes more steps, a slower one fewer (at least 1, at most 4 × `inner_steps`), and all of
    them post at once."""
    pace_align: float = 0.0
    """With `pace = "time"`: each peer lengthens its next span by this fraction of how much longer than the
    group's median its last mean took to come back (`comm_s`), and shortens it by as much when shorter.
    Each measures its own time on its own clock and announces it in its next match entry, so no clock
    sync is involved. The peer that sent its Δ early waited longest; left alone the members' sends drift
    apart like a random walk (every round ends after a span of compute, plus each peer's own idle time)
    until the earliest waits for the mean. 0 = off, below 1 (the correction acts two rounds late: at 1
    it would not damp an offset); 0.5 settles a steady drift of v a round at an offset of 2v. The shift is
    capped at a quarter of the span."""

    fragments: int = 1
    """Streaming DiLoCo: θ is cut into this many fragments by transformer block (fragment p holds blocks p,
    p + P, …; the embeddings and final norm go with fragment 0), and each round syncs one fragment, in turn,
    after `inner_steps / fragments` inner steps: every fragment is synced every `inner_steps` steps, and a
    round sends about 1/P of θ. `rounds` counts these rounds (the run trains `rounds × inner_steps /
    fragments` steps). 1 = classic DiLoCo. With `overlap`, a fragment's mean lands while the next inner
    steps run (`overlap_max_steps` is Streaming DiLoCo's delay τ)."""

    @property
    def round_steps(self) -> int:
        """Inner steps per round: H, or H / P with fragments."""
        return self.inner_steps // self.fragments

    def __post_init__(self) -> None:
        check(self.inner_steps >= 1, "diloco.inner_steps", "must be >= 1")
        check(self.fragments >= 1, "diloco.fragments", "must be >= 1")
        check(self.inner_steps % self.fragments == 0, "diloco.fragments",
              f"{self.fragments} does not divide diloco.inner_steps ({self.inner_steps}): each round syncs one "
              f"fragment after inner_steps / fragments steps")
        check(self.pace in ("steps", "time"), "diloco.pace", f"{self.pace!r} is not 'steps' or 'time'")
        check(0.0 <= self.pace_align < 1.0, "diloco.pace_align", f"{self.pace_align} is not in [0, 1)")
        check(self.rounds >= 1, "diloco.rounds", "must be >= 1")
        check(self.eval_batches >= 1, "diloco.eval_batches", "must be >= 1")
        check(self.eval_every_rounds >= 0, "diloco.eval_every_rounds", "must be >= 0")
        check(self.overlap_max_steps >= 1, "diloco.overlap_max_steps", "must be >= 1")
        check(self.eager in ("fitted", "own"), "diloco.eager", f"{self.eager!r} is not 'fitted' or 'own'")


@dataclass(frozen=True)
class CompressConfig:
    """How pseudo-gradients are encoded on the wire: every contribution to a reducer and every mean it
    sends back."""

    codec: str = "int8"
    """`int8` or `int4` (blockwise absmax quantization: 1 or 0.5 bytes per value plus a scale per block),
    `fp16` or `bf16` (2 bytes), `fp32` (4 bytes, lossless), or `sparse`: per chunk of `chunk_size`
    values only the `density` largest in magnitude, at `bits` bits each plus their offsets (needs
    `error_feedback`). A config that names `sparse` gets its outer step for the keys it leaves unset:
    `compress.error_feedback = true`, `compress.error_feedback_decay = 0.9`, `outer.lr = 4`,
    `outer.momentum = 0`, `outer.nesterov = false` (SparseLoCo's; an outer momentum of 0.9 or more
    on sparse means diverges and is refused)."""
    block_size: int = 64
    """`int8`/`int4`: values per quantization block, each with its own scale (even, >= 2)."""
    scale_dtype: str = "fp32"
    """`int8`/`int4`: type of the per-block scales on the wire, `fp32` or `fp16` (other codecs need
    `fp32`)."""
    stochastic_rounding: bool = False
    """`int8`/`int4`: round each value up or down at random, unbiased in expectation, instead of to the
    nearest level (other codecs need `false`)."""
    zstd_level: int = 0
    """zstd level (1–22) applied to each encoded message; 0 = no zstd stage."""
    error_feedback: bool = False
    """Keep what the codec lost of this peer's Δ (Δ − decode(encode(Δ))) and add it to its next Δ once the
    round commits."""
    error_feedback_decay: float = 1.0
    """With `error_feedback`: the residual is multiplied by this before it is added to the next Δ (β of
    SparseLoCo's error-feedback accumulator; 1 = keep all of it)."""
    density: float = 0.01
    """`sparse`: fraction of each chunk's values sent (k = round(density × chunk_size), at least 1)."""
    bits: int = 2
    """`sparse`: bits per value sent (2, 4 or 8): a sign and 2^(bits−1) magnitudes between the chunk's
    smallest and largest kept magnitude."""
    chunk_size: int = 4096
    """`sparse`: values per chunk; each chunk keeps its own top k (in [2, 65536])."""

    def __post_init__(self) -> None:
        codecs = ("fp32", "fp16", "bf16", "int8", "int4", "sparse")
        check(self.codec in codecs, "compress.codec", f"{self.codec!r} is not one of {codecs}")
        check(0.0 < self.error_feedback_decay <= 1.0, "compress.error_feedback_decay", "must be in (0, 1]")
        check(0.0 < self.density <= 1.0, "compress.density", "must be in (0, 1]")
        check(self.bits in (2, 4, 8), "compress.bits", "must be 2, 4 or 8")
        check(2 <= self.chunk_size <= 65536, "compress.chunk_size", "must be in [2, 65536]")
        if self.codec == "sparse":
            check(self.error_feedback, "compress.error_feedback",
                  "must be true with compress.codec = 'sparse': without it the values a round does not send "
                  "are lost for good")
            check(self.zstd_level == 0, "compress.zstd_level", "must be 0 with compress.codec = 'sparse' (its "
                  "payload does not compress)")
        check(self.block_size >= 2 and self.block_size % 2 == 0, "compress.block_size", "must be even and >= 2")
        check(self.scale_dtype in ("fp32", "fp16"), "compress.scale_dtype", "must be 'fp32' or 'fp16'")
        check(0 <= self.zstd_level <= 22, "compress.zstd_level", "must be in [0, 22]")


@dataclass(frozen=True)
class DiscoveryConfig:
    """The control plane: this process's node of the hivemind DHT, which holds the run record, peer records
    and matchmaking."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of DHT nodes to join through, e.g. the coordinator's (`swarmtrain peer --join`); empty =
    start a new DHT."""
    host: str = "127.0.0.1"
    """Address the DHT node listens on (`0.0.0.0` on a public machine)."""
    port: int = 0
    """DHT (libp2p TCP) port; 0 = any free port."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs others should dial to reach this DHT node, when they differ from the bound ones (NAT,
    containers); empty = the bound addresses."""
    client_mode: bool = False
    """Behind NAT: only dial out, so no port of this peer needs to be reachable. The peer contributes to
    every round and receives every mean, but never reduces a shard or serves state to joiners."""
    nat_port_map: bool = False
    """Let libp2p ask the home router for a port mapping (UPnP/NAT-PMP)."""
    use_auto_relay: bool = False
    """Let libp2p look for relays through which this node becomes reachable behind NAT or a firewall
    (hivemind's `use_auto_relay`)."""
    identity_path: str = ""
    """File holding this node's libp2p RSA key, created if missing; it keeps the peer id across restarts.
    Empty = `identity.key` in `checkpoint.dir` when that is set, else a fresh identity each start."""
    heartbeat_s: float = 2.0
    """Seconds between two announcements of this peer's record (the coordinator: between two refreshes of
    the run record)."""
    record_ttl_s: float = 10.0
    """Seconds a peer record stays live after its heartbeat; a peer silent for longer counts as gone. Must
    exceed `heartbeat_s`."""
    max_clock_skew_s: float = 2.0
    """Seconds this peer's clock may differ from the swarm's before it says so in one warning line. The
    peer corrects for the difference either way (it stamps times on the swarm's clock, estimated from live
    peers' heartbeats to within about half a heartbeat; its record carries the correction, `clock_offset_s`).
    The correction holds while the clock is within `record_ttl_s - heartbeat_s` of another peer's."""
    alone_warning_s: float = 60.0
    """Seconds without seeing any other live peer of the run after which a peer says so: one warning log
    line, and `alone_s` in its round lines, until it sees one again. 0 = never."""
    shutdown_timeout_s: float = 5.0
    """Seconds this process's DHT node is given to stop when it closes; past them it is killed (with its
    `p2pd`), so closing takes at most this plus 3 s even when the DHT process hangs."""

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "discovery.port", "must be in [0, 65535]")
        check(self.heartbeat_s > 0, "discovery.heartbeat_s", "must be > 0")
        check(self.record_ttl_s > self.heartbeat_s, "discovery.record_ttl_s", "must exceed discovery.heartbeat_s")
        check(self.max_clock_skew_s > 0, "discovery.max_clock_skew_s", "must be > 0")
        check(self.alone_warning_s >= 0, "discovery.alone_warning_s", "must be >= 0 (0 = never)")
        check(self.shutdown_timeout_s > 0, "discovery.shutdown_timeout_s", "must be > 0")


@dataclass(frozen=True)
class RpcConfig:
    """The data plane: this peer's gRPC server and bulk TCP port (all-reduce payloads, state for joiners)."""

    host: str = "127.0.0.1"
    """Address the gRPC server and the bulk port bind (`0.0.0.0` on a public machine)."""
    port: int = 0
    """gRPC port; 0 = any free port."""
    announce: str = ""
    """HOST:PORT other peers dial to reach this gRPC server; empty = the bound address (127.0.0.1 when
    bound to all interfaces)."""
    run_key: str = ""
    """Shared secret of the run. It never leaves the machine: records, calls and bulk transfers carry MACs
    made with keys derived from it, and peers ignore or refuse whatever lacks them (docs/security.md).
    Empty = an open run, refused on a non-loopback address without `--insecure`. The environment variable
    `SWARMTRAIN_RUN_KEY`, when set, takes its place; it is blanked in the run config the coordinator
    publishes."""
    call_timeout_s: float = 30.0
    """Deadline in seconds of one data-plane call and of a read of the live peers from the DHT."""
    chunk_bytes: int = 1 << 20
    """Bytes per message when a payload is streamed over gRPC (state for joiners; all-reduce payloads with
    `bulk_transport = "grpc"`); in [1024, `max_message_bytes`]."""
    max_message_bytes: int = 8 << 20
    """Largest gRPC message this peer sends or accepts, in bytes."""
    max_concurrent_calls: int = 256
    """Calls this peer's gRPC server handles at once; more are refused with `RESOURCE_EXHAUSTED` (a
    caller retries), so a flood of calls cannot pile up without bound. A round needs about 4 per group
    member at a time."""
    retries: int = 3
    """Retries of an idempotent call that found its peer unavailable, never past the call's deadline."""
    backoff_s: float = 0.2
    """Delay in seconds before the first retry; doubles with each retry, jittered by ×0.5–1.5."""
    bulk_transport: str = "tcp"
    """`tcp`: all-reduce payloads move over a second, raw TCP port (`bulk_port`; open it too behind a
    firewall). `grpc`: everything through `port`. Others adapt to what this peer serves."""
    bulk_port: int = 0
    """TCP port of the bulk data path (with `bulk_transport = "tcp"`); 0 = any free port. Peers learn it
    from the gRPC call that precedes each transfer."""
    state_donors: int = 3
    """Donors a joiner downloads the swarm's state from at once, a range of it from each (they must serve
    one blob, which must hash to what the swarm announces); if that fails, one donor at a time. 1 = one
    donor at a time."""
    buffer_pool_mib: int = 256
    """Idle receive and scratch buffers (MiB) the data plane keeps for the next call or round instead of
    freeing them. Fresh memory costs a zeroing page fault per 4 KiB; kept memory stays in the peer's RSS
    through the inner steps. A model of 100M+ parameters needs buffers of a shard's fp32 size (the
    model's over the group size); raise it when RAM is plentiful and rounds are short. 0 = none kept."""
    tls: bool = False
    """Encrypt the data plane (gRPC and the bulk port) with TLS 1.3. The certificates come from the run key
    (an authority every key holder derives, a fresh leaf per process), so it needs a run key; every peer of
    the run takes the coordinator's setting. Costs throughput (docs/benchmarks.md); off, payloads are
    MACed but readable on the wire."""

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "rpc.port", "must be in [0, 65535]")
        check(self.bulk_transport in ("tcp", "grpc"), "rpc.bulk_transport", "must be 'tcp' or 'grpc'")
        check(1 <= self.state_donors <= 64, "rpc.state_donors", "must be in [1, 64]")
        check(0 <= self.buffer_pool_mib <= 1 << 20, "rpc.buffer_pool_mib", "must be in [0, 1048576]")
        check(0 <= self.bulk_port < 65536, "rpc.bulk_port", "must be in [0, 65535]")
        check(self.call_timeout_s > 0, "rpc.call_timeout_s", "must be > 0")
        check(1024 <= self.chunk_bytes <= self.max_message_bytes, "rpc.chunk_bytes",
              "must be in [1024, rpc.max_message_bytes]")
        check(self.retries >= 0, "rpc.retries", "must be >= 0")
        check(self.max_concurrent_calls >= 1, "rpc.max_concurrent_calls", "must be >= 1")
        check(self.backoff_s >= 0, "rpc.backoff_s", "must be >= 0")


@dataclass(frozen=True)
class AveragingConfig:
    """Matchmaking and the fault-tolerant all-reduce of each round's pseudo-gradients."""

    min_peers: int = 2
    """Fewest members a round needs: matchmaking forms no smaller group, and a round commits only when at
    least this many members (and more than half of its group) delivered their Δ."""
    matchmaking_timeout_s: float = 5.0
    """Matchmaking window in seconds: peers that post for a round within this span of the first one form
    its group (it closes early once every live peer at that round has posted and they are at least
    `min_peers`)."""
    allreduce_timeout_s: float = 60.0
    """Deadline in seconds of a round's all-reduce, retries included, from the moment its group is known."""
    max_retries: int = 3
    """Further all-reduce attempts of a round after one that lost a reducer, each without the reducers that
    failed, all inside `allreduce_timeout_s`. With up to `max_reducers` reducers and peers that come and go, a
    round may lose two of them (simulated at 128 peers with 1% churn per round: one retry was not enough)."""
    max_voters: int = 32
    """Most voters a round has: a commit names as the next round's voters at most this many of its serving
    contributors, drawn by a rank every member computes from the session (round/committee.py), so that a
    round's decision costs each member messages and certificates of a bounded size however large the swarm
    (0 = every serving contributor). A majority of them must be live for a round to be decided."""
    max_reducers: int = 32
    """Most reducers a round's attempt has: with more serving members, each attempt's shards go to this many of
    them, drawn by a rank every member computes from the group (round/committee.py), and a reducer found dead is
    replaced by the next in rank at the retry. Every member then pushes, asks and pulls this many shards
    however large the group, and at most this many peers can fail an attempt (0 = every serving member)."""
    contribution_window_s: float = 15.0
    """Seconds a reducer collects contributions to its shard after its round opens; later ones are left out
    of the mean. Must be shorter than `allreduce_timeout_s`."""
    aggregator: str = "mean"
    """How a reducer combines its shard's contributions: `mean`, or `trimmed_mean`, which drops the `trim`
    largest and smallest values of every coordinate before averaging, so that up to `trim` lying members
    cannot move θ_global beyond what honest members sent (docs/security.md); it holds every decoded
    contribution of the shard in memory."""
    trim: int = 1
    """With `aggregator = "trimmed_mean"`: contributions dropped at each end of every coordinate (fewer
    when a shard has at most 2·trim of them: the median for an odd count, the mean for two)."""
    combine: str = "auto"
    """What a reducer sends back: `reencode` = the mean of its shard, encoded with the run's codec;
    `gather` = the contributions themselves (less the caller's own), which each member averages (every
    contribution then crosses the network K − 1 times, and a sparse mean loses nothing to a second
    encoding); `auto` = `gather` for the sparse codec, `reencode` for the others."""

    mode: str = "allreduce"
    """How peers average: `allreduce` (DiLoCo: every round one group of the live peers, one θ_global by
    the round's consensus) or `gossip` (NoLoCo: every round each peer averages with `gossip_group_size`
    − 1 partners drawn by a seeded permutation of the live roster and applies the NoLoCo outer step; no
    collective, no quorum, no shared θ_global: docs/gossip.md)."""
    gossip_group_size: int = 2
    """`gossip`: peers per group (a peer and its partners); a roster that does not divide evenly puts the
    remaining peers into groups one larger."""
    gossip_timeout_s: float = 10.0
    """`gossip`: the longest a peer waits for its partners' contributions of a round; it then applies what
    it has (its own alone at worst) and trains on."""
    gossip_lr: float = 0.7
    """`gossip`: α of the NoLoCo outer step (NoLoCo's 0.7)."""
    gossip_momentum: float = 0.5
    """`gossip`: β of the NoLoCo outer step (NoLoCo's 0.5)."""
    gossip_weights_codec: str = "fp16"
    """`gossip`: the codec of the slow weights φ a peer sends its partners with its Δ (Δ goes with
    `compress.codec`): `fp16` halves fp32's bytes and keeps 11 significant bits of each weight."""
    gossip_clip: float = 4.0
    """`gossip`: a partner's Δ and its pull φ_partner − φ_own are each scaled down to at most this many
    times the norm of this peer's own Δ, so one lying partner moves a peer by a bounded step (0 = off)."""

    def gathers(self, codec: str) -> bool:
        """Whether reducers gather contributions of `codec` (`combine`: "auto" gathers the sparse codec's)."""
        return self.combine == "gather" or (self.combine == "auto" and codec == "sparse")

    def __post_init__(self) -> None:
        check(self.min_peers >= 1, "averaging.min_peers", "must be >= 1")
        check(self.max_voters >= 0, "averaging.max_voters", "must be >= 0 (0 = every serving contributor)")
        check(self.max_reducers >= 0, "averaging.max_reducers", "must be >= 0 (0 = every serving member)")
        check(self.contribution_window_s > 0, "averaging.contribution_window_s", "must be > 0")
        check(self.matchmaking_timeout_s > 0, "averaging.matchmaking_timeout_s", "must be > 0")
        check(self.allreduce_timeout_s > 0, "averaging.allreduce_timeout_s", "must be > 0")
        check(self.max_retries >= 0, "averaging.max_retries", "must be >= 0")
        check(self.aggregator in ("mean", "trimmed_mean"), "averaging.aggregator",
              f"{self.aggregator!r} is not mean or trimmed_mean")
        check(self.trim >= 1, "averaging.trim", "must be >= 1")
        check(self.mode in AVERAGING_MODES, "averaging.mode", f"{self.mode!r} is not allreduce or gossip")
        check(self.gossip_group_size >= 2, "averaging.gossip_group_size", "must be >= 2 (a peer and a partner)")
        check(self.gossip_timeout_s > 0, "averaging.gossip_timeout_s", "must be > 0")
        check(self.gossip_lr > 0, "averaging.gossip_lr", "must be > 0")
        check(0 <= self.gossip_momentum < 1, "averaging.gossip_momentum", "must be in [0, 1)")
        check(self.gossip_weights_codec in ("fp32", "fp16", "bf16"), "averaging.gossip_weights_codec",
              f"{self.gossip_weights_codec!r} is not fp32, fp16 or bf16 (weights are not quantized to integers)")
        check(self.gossip_clip >= 0, "averaging.gossip_clip", "must be >= 0 (0 = off)")
        check(self.combine in COMBINES, "averaging.combine",
              f"{self.combine!r} is not auto, reencode or gather")
        check(not (self.combine == "gather" and self.aggregator != "mean"), "averaging.combine",
              "gather needs averaging.aggregator = 'mean' (members average gathered contributions)")
        # A reducer fixes its contributors when its window closes; a window that outlasts the all-reduce's
        # deadline means no mean is ever served when a member is missing: every such round would abort.
        check(self.contribution_window_s < self.allreduce_timeout_s, "averaging.contribution_window_s",
              f"{self.contribution_window_s} must be shorter than averaging.allreduce_timeout_s "
              f"({self.allreduce_timeout_s}): a reducer still waiting for a missing member when the "
              f"all-reduce's deadline passes can never serve its mean")


@dataclass(frozen=True)
class DashboardConfig:
    """The coordinator's dashboard (`swarmtrain coordinator --dashboard-port`): its history and alerts."""

    db: str = ""
    """SQLite file of the dashboard's history; empty = `swarmtrain-<run_id>.dashboard.sqlite` in the
    coordinator's working directory. A restarted coordinator keeps its charts from it."""
    retention_rounds: int = 10000
    """Rounds of history kept (the newest; older samples and aborts are deleted)."""
    poll_s: float = 0.0
    """Seconds between two reads of the live peer records; 0 = `discovery.heartbeat_s`."""
    stuck_after_s: float = 600.0
    """Alert "stuck round" when live peers reached no new round for this many seconds."""
    silent_window_s: float = 600.0
    """Alert "silent peer" for a peer whose record expired without a departure, for this many seconds."""

    def __post_init__(self) -> None:
        check(self.retention_rounds >= 1, "dashboard.retention_rounds", "must be >= 1")
        check(self.poll_s >= 0, "dashboard.poll_s", "must be >= 0 (0 = discovery.heartbeat_s)")
        for key in ("stuck_after_s", "silent_window_s"):
            check(getattr(self, key) > 0, f"dashboard.{key}", "must be > 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a peer saves its state (it resumes from the newest good checkpoint on restart)."""

    dir: str = ""
    """Directory of this peer's checkpoints, its DHT identity key, its vote books (`votes-<scope>.json`) and
    the material its voter accepted (`material-<scope>/`); created when missing; one live peer per
    directory. Empty = no checkpoints, and votes in memory only (each start is a new voter)."""
    every_rounds: int = 1
    """Save after every this many committed rounds, and on leaving. A restart from a checkpoint older than its
    votes learns the rounds it replays from their certificates (docs/protocol.md#healing)."""
    keep: int = 2
    """Checkpoints kept: the newest this many; older ones are deleted."""

    def __post_init__(self) -> None:
        check(self.every_rounds >= 1, "checkpoint.every_rounds", "must be >= 1")
        check(self.keep >= 1, "checkpoint.keep", "must be >= 1")
