"""[pipeline] values are checked where they are read, naming the field."""

from __future__ import annotations

import pytest

from swarmtrain.config import ConfigError, load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("override", "field"), [
    ("pipeline.stages=3", "pipeline.stages"),  # tiny has 2 blocks
    ("pipeline.stages=-1", "pipeline.stages"),
    ("pipeline.samples_per_step=6", "pipeline.samples_per_step"),  # not a multiple of 4
    ("pipeline.microbatch_size=0", "pipeline.microbatch_size"),
    ("pipeline.activation_codec='int4'", "pipeline.activation_codec"),
    ("pipeline.min_deadline_s=20", "pipeline.min_deadline_s"),
    ("pipeline.deadline_factor=0.5", "pipeline.deadline_factor"),
    ("pipeline.max_contexts=0", "pipeline.max_contexts"),
])
def test_bad_pipeline_values_are_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=["model.preset=tiny", override])


def test_a_pipeline_run_config_loads() -> None:
    cfg = load_config(overrides=["model.preset=small", "pipeline.stages=4", "pipeline.samples_per_step=8"])
    assert (cfg.pipeline.stages, cfg.pipeline.microbatch_size, cfg.pipeline.samples_per_step) == (4, 4, 8)
