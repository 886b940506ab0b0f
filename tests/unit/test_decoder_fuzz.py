"""Property-based fuzzing of every decoder of network bytes (swarmtrain/testing/fuzz.py): valid seeds decode,
and any mutation of them (or any bytes at all) raises only the decoder's typed error."""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain.compress import Codec, CodecError, get_codec
from swarmtrain.testing.fuzz import TARGETS, Target, mutate

pytestmark = pytest.mark.unit

IDS = [t.name for t in TARGETS]


def _only_typed(target: Target, data: bytes) -> None:
    with contextlib.suppress(*target.allowed):  # anything else fails the test: an untyped error is a crash
        target.run(data)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_every_seed_decodes(target: Target) -> None:
    for seed in target.seeds:
        target.run(seed)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng_seed=st.integers(0, 2**32 - 1), resign=st.booleans())
def test_mutated_seeds_raise_only_the_typed_error(target: Target, rng_seed: int, resign: bool) -> None:
    rng = random.Random(rng_seed)
    data = mutate(rng.choice(target.seeds), rng, others=[s for t in TARGETS for s in t.seeds])
    _only_typed(target, target.resign(data) if resign and target.resign is not None else data)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_the_typed_error(target: Target, data: bytes) -> None:
    _only_typed(target, data)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=8)


@pytest.mark.parametrize("target", [t for t in TARGETS if t.name.startswith("record:")],
                         ids=[t.name for t in TARGETS if t.name.startswith("record:")])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_records_with_any_field_set_to_any_json_raise_only_record_error(target: Target, data: st.DataObject) -> None:
    record = json.loads(target.seeds[0])
    node, path = record, []
    while True:  # walk to a random field, descending into objects and lists
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        path.append(key)
        if not isinstance(node[key], (dict, list)) or not node[key] or data.draw(st.booleans()):
            break
        node = node[key]
    node[key] = data.draw(JSON)
    _only_typed(target, json.dumps(record, allow_nan=True).encode())


CODECS = [t for t in TARGETS if t.name.startswith("codec:")]


def _decodes_finite(codec: Codec, data: bytes) -> tuple[bool, int]:
    """The reference verdict: does `decode` accept data, to finite values only? (and its element count)."""
    try:
        values = codec.decode(data)
    except CodecError:
        return False, -1
    return bool(torch.isfinite(values).all()), values.numel()


def _check_validate_agrees(codec: Codec, data: bytes) -> None:
    ok, numel = _decodes_finite(codec, data)
    if ok:
        codec.validate(data, numel=numel)
        with pytest.raises(CodecError):  # the count is part of what is checked
            codec.validate(data, numel=numel + 1)
    else:
        for n in {numel, *range(0, 400)} if numel >= 0 else range(0, 400):
            with pytest.raises(CodecError):
                codec.validate(data, numel=n)


@pytest.mark.parametrize("target", CODECS, ids=[t.name for t in CODECS])
@settings(max_examples=80, deadline=None)
@given(rng_seed=st.integers(0, 2**32 - 1))
def test_validate_refuses_exactly_what_decodes_badly_on_mutated_payloads(target: Target, rng_seed: int) -> None:
    codec = _codec_of(target)
    rng = random.Random(rng_seed)
    data = mutate(rng.choice(target.seeds), rng, others=[s for t in CODECS for s in t.seeds])
    _check_validate_agrees(codec, target.resign(data) if target.resign is not None else data)


@pytest.mark.parametrize("target", CODECS, ids=[t.name for t in CODECS])
def test_validate_refuses_non_finite_or_overflowing_tail_values(target: Target) -> None:
    """The last 2 or 4 payload bytes are the last wire value (cast codecs) or the last block scale
    (int8/int4, fp32 scales): set to Inf, NaN, a negative or an overflowing scale, checksum fixed."""
    codec = _codec_of(target)
    for seed in target.seeds:
        tails = [struct.pack("<f", v) for v in (math.inf, -math.inf, math.nan, -1.0, 3e38, 1e36, 1.0)]
        tails += [struct.pack("<H", v) for v in (0x7C00, 0xFC00, 0x7E00, 0x7F80, 0x7FC0, 0x3C00)]
        for tail in tails:
            data = target.resign(seed[:-len(tail)] + tail) if target.resign is not None else seed
            _check_validate_agrees(codec, data)


def _codec_of(target: Target) -> Codec:
    name = target.name.split(":", 1)[1]
    return get_codec(name, chunk_size=16, density=0.25) if name == "sparse" else get_codec(name)
