"""Perplexity and bits per byte: their arithmetic, and their way into round lines' tallies and /metrics."""

from __future__ import annotations

import math

import pytest
import torch

from swarmtrain.data.evaluation import bits_per_byte, bytes_per_token, perplexity
from swarmtrain.data.tokenizer import load_tokenizer
from swarmtrain.telemetry.events import RoundEvent, parse_line, to_json
from swarmtrain.telemetry.prometheus import PeerCollector
from swarmtrain.telemetry.tally import Tally

pytestmark = pytest.mark.unit


def test_bits_per_byte_counts_the_validation_text() -> None:
    text = "héllo wörld, "
    ids = torch.tensor([list(text.encode())] * 2)
    assert bytes_per_token([(ids, ids)], load_tokenizer("bytes")) == 1.0
    assert bits_per_byte(math.log(2) * 3, bytes_per_token=1.5) == pytest.approx(2.0)
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)


def test_a_bpe_has_more_bytes_per_token(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tokenizers")
    from swarmtrain.data.tokenizer_train import train_bpe

    text = "the quick brown fox jumps over the lazy dog. " * 200
    train_bpe(iter([text]), vocab_size=300, out=tmp_path / "t.json")
    tok = load_tokenizer(str(tmp_path / "t.json"))
    (ids,) = tok.encode_batch([text[:450]])
    y = torch.tensor([ids[:40]])
    assert bytes_per_token([(y, y)], tok) == pytest.approx(len(tok.decode(ids[:40]).encode()) / 40)
    assert bytes_per_token([(y, y)], tok) > 2


def test_round_lines_and_metrics_carry_perplexity_and_bits_per_byte() -> None:
    event = RoundEvent(round=3, committed=True, members=("a", "b"), loss=2.0, val_loss=1.5, hash="h", bytes_sent=1,
                       bytes_received=1, compute_s=1.0, comm_s=0.5, steps=4, val_ppl=perplexity(1.5),
                       val_bpb=bits_per_byte(1.5, bytes_per_token=2.0))
    assert parse_line(to_json(event)) == event
    tally = Tally(tokens_per_step=10)
    tally.observe(event)
    assert tally.stats().val_bpb == pytest.approx(1.5 / (2 * math.log(2)))
    metrics = {m.name: m.samples[0].value for m in PeerCollector(tally).collect() if m.samples}
    assert metrics["swarmtrain_val_perplexity"] == pytest.approx(math.exp(1.5))
    assert metrics["swarmtrain_val_bits_per_byte"] == pytest.approx(1.5 / (2 * math.log(2)))
