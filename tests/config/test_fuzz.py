"""Hypothesis: malformed files and wrong-typed fields always give a ConfigError and an untouched file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefect_accelerate.config.io import load_config_path
from prefect_accelerate.config.update import update_config_file
from prefect_accelerate.errors import ConfigError

VALID = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "mixed_precision": "bf16",
    "use_cpu": False,
    "debug": False,
    "num_processes": 2,
    "machine_rank": 0,
    "num_machines": 1,
    "gpu_ids": "0,1",
    "main_process_port": 29500,
    "rdzv_backend": "static",
    "same_network": True,
    "main_training_function": "main",
    "tpu_name": "pod",
    "commands": ["echo hi"],
    "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": False, "fsdp_min_num_params": 1000},
    "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1},
    "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": False},
}

# field -> kind of value it takes; the generator draws values that kind never accepts
KINDS = {
    "compute_environment": "enum", "distributed_type": "enum", "mixed_precision": "enum", "rdzv_backend": "enum",
    "use_cpu": "flag", "debug": "flag", "same_network": "flag",
    "num_processes": "int", "machine_rank": "int", "num_machines": "int", "main_process_port": "int",
    "gpu_ids": "ids", "main_training_function": "text", "tpu_name": "text", "commands": "list",
    "fsdp_config": "section", "deepspeed_config": "section", "dynamo_config": "section",
    "fsdp_config.fsdp_version": "int", "fsdp_config.fsdp_offload_params": "flag", "fsdp_config.fsdp_min_num_params": "int",
    "deepspeed_config.zero_stage": "int", "deepspeed_config.gradient_accumulation_steps": "int",
    "dynamo_config.dynamo_backend": "enum", "dynamo_config.dynamo_use_fullgraph": "flag",
}

containers = st.one_of(st.lists(st.integers(), min_size=1, max_size=3), st.dictionaries(st.text(min_size=1, max_size=5), st.integers(), min_size=1, max_size=2))
junk_words = st.text(alphabet="xyzqjk_-", min_size=1, max_size=12)
WRONG = {
    "enum": st.one_of(junk_words.map(lambda s: f"Z{s}"), st.integers(), st.floats(allow_nan=False), containers),
    "flag": st.one_of(junk_words.map(lambda s: f"z{s}"), st.floats(min_value=2, max_value=1e6), containers),
    "int": st.one_of(st.text(min_size=1, max_size=8), st.booleans(), st.floats(allow_nan=False).filter(lambda f: f != int(f) if abs(f) < 1e15 else True), containers, st.integers(max_value=-2)),
    "ids": st.one_of(junk_words.map(lambda s: f"g{s}"), st.booleans(), containers, st.floats(min_value=0.5, max_value=9.5).filter(lambda f: f != int(f))),
    "text": st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), containers),
    "list": st.one_of(st.integers(), st.booleans(), st.dictionaries(st.text(min_size=1, max_size=3), st.integers(), min_size=1, max_size=2), st.lists(st.integers(), min_size=1, max_size=3)),
    "section": st.one_of(st.integers(), st.text(min_size=1, max_size=8), st.lists(st.integers(), min_size=1, max_size=2), st.dictionaries(junk_words.map(lambda s: f"zz_{s}"), st.integers(), min_size=1, max_size=2)),
}


@st.composite
def wrong_typed_config(draw):
    field = draw(st.sampled_from(sorted(KINDS)))
    value = draw(WRONG[KINDS[field]])
    data = json.loads(json.dumps(VALID))
    if "." in field:
        section, key = field.split(".")
        data[section][key] = value
    else:
        data[field] = value
    return field, data


def _assert_rejected_and_untouched(path: Path, field: str | None = None) -> None:
    before = path.read_bytes()
    try:
        load_config_path(path)
    except ConfigError as error:
        assert str(path) in error.message
        if field is not None:
            assert field.split(".")[0] in error.message
    else:
        raise AssertionError(f"{path.read_text()!r} was accepted")
    try:
        update_config_file(path)
    except ConfigError:
        pass
    else:
        raise AssertionError("update accepted a bad file")
    assert path.read_bytes() == before
    assert not path.with_name(path.name + ".bak").exists()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wrong_typed_config(), st.sampled_from([".yaml", ".json"]))
def test_wrong_typed_fields_are_config_errors_and_nothing_is_written(case, suffix):
    field, data = case
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"config{suffix}"
        text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data)
        path.write_text(text)
        _assert_rejected_and_untouched(path, field)


@st.composite
def malformed_text(draw):
    base = yaml.safe_dump(VALID) if draw(st.booleans()) else json.dumps(VALID, indent=1)
    kind = draw(st.sampled_from(["truncate", "insert", "garbage", "swap_braces"]))
    if kind == "truncate":
        cut = draw(st.integers(min_value=1, max_value=len(base) - 1))
        text = base[:cut] + draw(st.sampled_from(["{", "[", ": [", "\t", '"', "'"]))
    elif kind == "insert":
        at = draw(st.integers(min_value=0, max_value=len(base)))
        text = base[:at] + draw(st.sampled_from(["{{", "]]", ": :", "\t- ", '"\n', "&a *b", "%%", "@"])) + base[at:]
    elif kind == "garbage":
        text = draw(st.text(min_size=1, max_size=200))
    else:
        text = base.replace("{", "[", 1).replace(":", "=", 3)
    return text


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(malformed_text(), st.sampled_from([".yaml", ".json"]))
def test_malformed_files_are_config_errors_never_crashes(text, suffix):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"config{suffix}"
        path.write_text(text)
        before = path.read_bytes()
        try:
            load_config_path(path)
        except ConfigError as error:
            assert str(path) in error.message and "\n" not in error.message
        try:
            update_config_file(path)
        except ConfigError:
            assert path.read_bytes() == before
