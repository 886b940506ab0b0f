"""Real processes, end to end and offline: train a tokenizer, prepare shards, train a Llama swarm, take it home.

1. `swarmtrain tokenizer train` learns a byte-level BPE on standard-library source;
2. `swarmtrain data prepare` turns a jsonl and a parquet file into token shards;
3. a coordinator and 2 peers train the built-in `llama` over those shards until their rounds are done,
   every committed round with one θ_global hash; one peer exports on leaving (`--export-dir`);
4. `swarmtrain export` writes the other's checkpoint as a Hugging Face directory; transformers'
   `AutoModelForCausalLM.from_pretrained` loads both, and their logits match swarmtrain's forward of the
   checkpoint (fp32, max abs difference <= 1e-4); `swarmtrain generate` samples a few tokens.

And the `hf` architecture: 2 peers on a LlamaForCausalLM from a local config.json commit rounds with one
hash; a peer whose config.json differs is refused, its error naming the field.
"""

from __future__ import annotations

import json
import sysconfig
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import LeaveEvent, RoundEvent
from swarmtrain.testing.procs import ProcessSet

pytestmark = [pytest.mark.system, pytest.mark.timeout(420)]
transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("pyarrow")

START_S = 120.0
RUN_S = 180.0
TIMING = [
    "data.seq_len=32", "data.batch_size=4", "inner.warmup_steps=1", "diloco.inner_steps=4", "diloco.rounds=3",
    "diloco.eval_batches=1", "averaging.min_peers=2", "averaging.matchmaking_timeout_s=2.0",
    "averaging.allreduce_timeout_s=10.0", "averaging.contribution_window_s=3.0", "discovery.heartbeat_s=0.5",
    "discovery.record_ttl_s=3.0", "rpc.call_timeout_s=5.0", "train.threads=1",
]


def _stdlib_text(max_bytes: int) -> list[str]:
    """Documents: standard-library modules, in a fixed order, up to `max_bytes` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for p in sorted(root.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def _run_tool(procs: ProcessSet, name: str, *args: str, timeout_s: float = 120.0) -> dict[str, object]:
    """A one-shot `swarmtrain` command: its exit status must be 0; returns its last JSON line."""
    child = procs.spawn(name, *args)
    rc = child.proc.wait(timeout=timeout_s)
    child.wait_eof(timeout_s=10.0)
    assert rc == 0, f"swarmtrain {' '.join(args)} failed (rc={rc}): {child.diagnostics()}"
    return json.loads(child.raw_tail[-1])


def _wait_done(child: Child) -> LeaveEvent:
    _, leave = child.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=RUN_S, what="the peer leaving")
    assert isinstance(leave, LeaveEvent) and leave.reason == "done", leave
    assert child.proc.wait(timeout=60.0) == 0, child.diagnostics()
    return leave


def _committed_hashes(*children: Child) -> dict[int, set[str]]:
    by_round: dict[int, set[str]] = defaultdict(set)
    for child in children:
        for line in child.snapshot():
            if isinstance(line, RoundEvent) and line.committed:
                by_round[line.round].add(line.hash)
    return by_round


def _logits_match(export_dir: Path, checkpoint_dir: Path) -> None:
    from swarmtrain.sync.export import model_from_checkpoint

    ours, cfg, _ = model_from_checkpoint(checkpoint_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(export_dir)).eval()
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(idx)[0] - theirs(input_ids=idx).logits).abs().max().item()
    assert diff <= 1e-4, f"{export_dir}: logits differ from swarmtrain's by {diff}"


def test_llama_on_prepared_shards_trains_exports_and_loads(procs: ProcessSet, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _stdlib_text(600_000)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs[: len(docs) // 2]), encoding="utf-8")
    tok = tmp_path / "tokenizer.json"
    trained = _run_tool(procs, "tokenizer", "tokenizer", "train", str(corpus), "--out", str(tok), "--vocab-size", "512")
    assert trained["vocab_size"] == 512

    jsonl, parquet = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs[::2])),
                     encoding="utf-8")
    pq.write_table(pa.table({"content": docs[1::2]}), parquet)
    shards_a, shards_b = tmp_path / "shards-a", tmp_path / "shards-b"
    for src, out, field in ((jsonl, shards_a, "text"), (parquet, shards_b, "content")):
        prepared = _run_tool(procs, f"prepare-{out.name}", "data", "prepare", str(src), "--out", str(out),
                             "--tokenizer", str(tok), "--field", field, "--val-fraction", "0.1", "--workers", "2")
        assert prepared["train_tokens"] > 10_000 and prepared["dtype"] == "uint16"

    run = ["model.arch=llama", "model.preset=tiny", "model.vocab_size=512", f"data.shards={json.dumps(str(shards_a))}",
           f"data.tokenizer={json.dumps(str(tok))}", *TIMING]
    _, join = procs.coordinator(run, timeout_s=START_S)
    ckpt_a, ckpt_b, home_a = tmp_path / "ckpt-a", tmp_path / "ckpt-b", tmp_path / "home-a"
    a = procs.peer("a", join, "--export-dir", str(home_a), checkpoint_dir=ckpt_a)
    b = procs.peer("b", join, checkpoint_dir=ckpt_b)
    for p in (a, b):
        p.wait_ready(timeout_s=START_S)
    _wait_done(a)
    _wait_done(b)
    hashes = _committed_hashes(a, b)
    assert sorted(hashes) == [0, 1, 2], f"rounds committed: {sorted(hashes)}"
    assert all(len(h) == 1 for h in hashes.values()), f"peers disagree on θ_global: {dict(hashes)}"
    rounds = [e for e in a.snapshot() if isinstance(e, RoundEvent) and e.val_loss is not None]
    assert rounds and all(e.val_bpb is not None and e.val_ppl is not None for e in rounds)

    home_b = tmp_path / "home-b"
    _run_tool(procs, "export", "export", "--checkpoint-dir", str(ckpt_b), "--out", str(home_b))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in home_b.iterdir()}
    _logits_match(home_b, ckpt_b)
    _logits_match(home_a, ckpt_a)  # the peer's own export on leaving: the same θ_global as its checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(home_b))
    assert tokenizer.decode(tokenizer("def main():").input_ids) == "def main():"

    gen = procs.spawn("generate", "generate", "--checkpoint-dir", str(ckpt_b), "--prompt", "def ",
                      "--max-new-tokens", "5", "--temperature", "0")
    assert gen.proc.wait(timeout=120.0) == 0, gen.diagnostics()
    gen.wait_eof(timeout_s=10.0)
    sampled = "\n".join(gen.raw_tail)  # the prompt and 5 tokens: a few lines at most
    assert sampled.startswith("def "), gen.raw_tail  # (an end-of-text may come first: the text is then the prompt)


def test_hf_arch_swarm_agrees_and_refuses_a_peer_with_another_config(procs: ProcessSet, tmp_path: Path) -> None:
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config), encoding="utf-8")
    run = ["model.arch=hf", f"model.hf_path={json.dumps(str(path))}", "data.max_corpus_bytes=300000",
           *[t for t in TIMING if not t.startswith("diloco.rounds")], "diloco.rounds=2"]
    _, join = procs.coordinator(run, timeout_s=START_S)
    a, b = procs.peer("a", join), procs.peer("b", join)
    for p in (a, b):
        p.wait_ready(timeout_s=START_S)

    # Another machine's copy of the config, one field changed: refused before it trains, naming the field.
    path.write_text(json.dumps({**config, "num_hidden_layers": 3}), encoding="utf-8")
    c = procs.peer("c", join)
    assert c.proc.wait(timeout=START_S) != 0, "a peer with another model must not join"
    c.wait_eof(timeout_s=10.0)
    error = c.log_path.read_text(errors="replace")
    assert "config.num_hidden_layers = 3 here, 2 in the run" in error, c.diagnostics()

    _wait_done(a)
    _wait_done(b)
    hashes = _committed_hashes(a, b)
    assert sorted(hashes) == [0, 1] and all(len(h) == 1 for h in hashes.values()), dict(hashes)
