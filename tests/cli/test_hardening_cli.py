"""The CLI's promises over hostile input (issue 17): exit 0 or 2, never a traceback, never a hang, the input
file unchanged unless the command writes it, and no secret value in any output or file it writes.

The property test drives `main()` in this process (fast enough for hundreds of examples) in a thread with
a deadline; the few paths that need a real process (special files, host problems) run the real CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prefect_accelerate.cli.main import main

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]
SECRET = "hf_fuzzsecret_5d41402abc4b2a76"
HANG_SECONDS = 20  # far above any of these commands on a loaded machine; only a real hang reaches it

BASES = {
    "multi_cpu": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True,
                  "mixed_precision": "no", "num_machines": 1, "machine_rank": 0},
    "fsdp": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
             "fsdp_config": {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": False}},
    "deepspeed": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_processes": 2,
                  "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1}},
    "sagemaker": {"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "NO", "ec2_instance_type": "ml.p3.2xlarge",
                  "iam_role_name": "role", "profile": "default", "region": "us-east-1", "num_machines": 1,
                  "image_uri": "123.dkr.ecr.us-east-1.amazonaws.com/train:latest",
                  "additional_args": {"environment": {"MY_SERVICE_SECRET": SECRET, "DB_PASSWORD": SECRET}}},
    "single": {"distributed_type": "NO", "fp16": True},
}
FIELDS = ["num_processes", "num_machines", "machine_rank", "main_process_port", "gpu_ids", "mixed_precision", "distributed_type",
          "use_cpu", "main_process_ip", "rdzv_backend", "deepspeed_config.zero_stage", "fsdp_config.fsdp_version",
          "fsdp_config.fsdp_sharding_strategy", "dynamo_config.dynamo_backend", "additional_args.environment", "unknown_key"]
NASTY = st.one_of(
    st.sampled_from([-3, -1, 0, 1, 2, 7, 65536, 99999, 99999999999, 10**30, 1.5, math.nan, math.inf, True, None, "", "abc",
                     "abc,-1", "0,1", "NO", "nan", "all", SECRET, [], {}, [1, 2], {"HF_TOKEN": SECRET}]),
    st.integers(), st.text(max_size=12),
)
FLAGS = {
    "--num_processes": ["-1", "0", "1", "2", "99999999999", "abc"], "--num_machines": ["-3", "1", "2"],
    "--machine_rank": ["-1", "0", "5"], "--main_process_port": ["-5", "0", "99999", "29533"], "--gpu_ids": ["abc,-1", "all", "0,1", ""],
    "--zero_stage": ["7", "-1", "3"], "--timeout": ["nan", "-5", "inf", "0", "5"], "--grace_period": ["nan", "0", "40", "5"],
    "--mixed_precision": ["no", "bf16", "fp8", "xx"], "--dynamo_backend": ["no", "inductor", "nonsense"],
    "--num_cpu_threads_per_process": ["0", "-2", "4"], "--main_process_ip": ["127.0.0.1", ""], "--max_restarts": ["-1", "2"],
    "--monitor_interval": ["nan", "-1", "0.5"], "--rdzv_backend": ["static", "c10d", "zzz"],
}
SWITCHES = ["--cpu", "--multi_gpu", "--use_fsdp", "--use_deepspeed", "-m", "--no_python", "--json", "--debug", "-q"]


@st.composite
def config_file_text(draw) -> tuple[str, str]:
    suffix = draw(st.sampled_from([".yaml", ".json"]))
    if draw(st.integers(0, 9)) == 0:  # now and then: no mapping at all
        return suffix, draw(st.text(max_size=80))
    data = json.loads(json.dumps(BASES[draw(st.sampled_from(sorted(BASES)))]))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(FIELDS))
        value = draw(NASTY)
        if "." in field:
            section, key = field.split(".")
            if not isinstance(data.get(section), dict):
                data[section] = {}
            data[section][key] = value
        else:
            data[field] = value
    if suffix == ".json":
        return suffix, json.dumps(data)
    return suffix, yaml.safe_dump(data)


@st.composite
def command_line(draw, config: str, out: str) -> list[str]:
    kind = draw(st.sampled_from(["launch", "launch", "launch-no-config", "update", "to-fsdp2", "default"]))
    if kind == "update":
        return ["config", "update", "--config_file", config]
    if kind == "to-fsdp2":
        return ["to-fsdp2", "--config_file", config, "--output_file", out, *draw(st.sampled_from([[], ["--overwrite"]]))]
    if kind == "default":
        return ["config", "default", "--config_file", out, *draw(st.sampled_from([[], ["--force"]])),
                *draw(st.sampled_from([[], ["--mixed_precision", "bf16"], ["--mixed_precision", "zz"]]))]
    argv = ["launch", "--dry-run"] + (["--config_file", config] if kind == "launch" else [])
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=4, unique=True)):
        argv += [flag, draw(st.sampled_from(FLAGS[flag]))]
    argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
    argv += [draw(st.sampled_from(["train.py", "missing.py", "."])), "--tok", SECRET]
    return argv


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in a thread with a deadline: (exit code, stdout, stderr). Any exception escaping is a failure."""
    out, err = io.StringIO(), io.StringIO()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome["code"] = main(argv)
        except SystemExit as exit_:  # argparse's usage errors and --help
            outcome["code"] = exit_.code if isinstance(exit_.code, int) else 2
        except BaseException as error:  # noqa: BLE001 - reported as the test's failure
            outcome["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(HANG_SECONDS)
    assert not worker.is_alive(), f"{argv} still running after {HANG_SECONDS} s"
    if "error" in outcome:
        raise AssertionError(f"{argv} raised instead of a one-paragraph error") from outcome["error"]  # type: ignore[misc]
    return int(outcome["code"]), out.getvalue(), err.getvalue()  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_keeps_its_promises_for_any_config_and_command_line(data, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("PREFECT_ACCELERATE_DEBUG", "0")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        monkeypatch.chdir(root)
        monkeypatch.setenv("HF_HOME", str(root / "hf"))
        (root / "train.py").write_text("print('train')\n")
        suffix, text = data.draw(config_file_text())
        config = root / f"cfg{suffix}"
        config.write_text(text)
        out = root / "out.yaml"
        argv = data.draw(command_line(str(config), str(out)))
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        code, stdout, stderr = run_main(argv)
        event(f"{argv[0]} {argv[1] if argv[0] == 'config' else ''} exit {code}")
        assert code in (0, 2), (argv, code, stderr)
        assert "Traceback" not in stdout + stderr, (argv, stderr)
        assert SECRET not in stdout + stderr, (argv, stdout, stderr)
        if code == 2:
            assert stderr.strip(), argv  # an error says what went wrong
        writes = argv[0] in ("config", "to-fsdp2") and code == 0
        for path, content in before.items():
            if path != config or not writes:
                assert path.read_bytes() == content, f"{argv} changed {path}"
        for path in root.rglob("*"):
            if path.is_file() and path not in before:
                assert writes, f"{argv} wrote {path}"
                assert SECRET.encode() not in path.read_bytes() or path.name.endswith(".bak") or path == out, (argv, path)


# --------------------------------------------------------------------------------------------------------
# Paths and host problems through the real CLI


def cli(*argv: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def test_special_files_as_configs_are_named_and_never_block(tmp_path):
    (tmp_path / "train.py").write_text("print('x')\n")
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    for path, named in ((fifo, "named pipe (FIFO)"), (zero, "character device")):
        for argv in (["launch", "--dry-run", "--config_file", str(path), "train.py"], ["config", "update", "--config_file", str(path)],
                     ["env", "--config_file", str(path), "--no_import_check"]):
            done = cli(*argv, cwd=tmp_path, timeout=60)
            assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)


@pytest.mark.parametrize("case", ["hf_home_file", "config_folder_is_file", "fsdp2_output_folder_is_file", "missing_script"])
def test_bad_paths_are_one_paragraph_and_exit_2(tmp_path, case):
    afile = tmp_path / "afile"
    afile.write_text("")
    fsdp = tmp_path / "f1.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    argv, env, expected = {
        "hf_home_file": (["config", "default"], {"HF_HOME": str(afile)}, f"{afile} is a file, not a folder"),
        "config_folder_is_file": (["config", "default", "--config_file", str(afile / "c.yaml")], {}, f"{afile} is a file, not a folder"),
        "fsdp2_output_folder_is_file": (["to-fsdp2", "--config_file", str(fsdp), "--output_file", str(afile / "o.yaml")], {}, "is a file, not a folder"),
        "missing_script": (["launch", "--dry-run", "--num_processes", "1", "nope.py"], {}, "The training script 'nope.py' was not found"),
    }[case]
    done = cli(*argv, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["fp8_without_te", "pdsh_missing"])
def test_host_problems_at_plan_time_exit_2_like_every_other_error(tmp_path, case):
    (tmp_path / "train.py").write_text("print('x')\n")
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    if case == "fp8_without_te":
        argv = ["launch", "--dry-run", "--multi_gpu", "--num_processes", "2", "--mixed_precision", "fp8", "train.py"]
        env = {}
        expected = "Transformer Engine"
    else:
        argv = ["launch", "--dry-run", "--use_deepspeed", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
                "--main_process_port", "29541", "--deepspeed_multinode_launcher", "pdsh", "--deepspeed_hostfile", "hostfile", "train.py"]
        env = {"PATH": f"{empty_bin}{os.pathsep}{Path(sys.executable).parent}"}  # no pdsh anywhere
        expected = "pdsh"
    done = cli(*argv, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr


def test_a_secret_value_echoed_by_an_error_is_redacted(tmp_path):
    """Found by the property test above: a config field holding a known secret value was quoted in clear by
    the config error. Every error message redacts known secret values where it is made."""
    from prefect_accelerate.errors import ConfigError

    secret = "hf_echoedsecret_0123456789"
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "cfg.yaml").write_text(f"distributed_type: MULTI_CPU\nnum_processes: {secret}\n")
    done = cli("launch", "--dry-run", "--config_file", str(tmp_path / "cfg.yaml"), "train.py", cwd=tmp_path, env={"HF_TOKEN": secret})
    assert done.returncode == 2 and "num_processes" in done.stderr and "***" in done.stderr, done.stderr
    assert secret not in done.stdout + done.stderr
    os.environ["WANDB_API_KEY"] = secret
    try:
        assert secret not in ConfigError(f"bad value {secret!r}").message
    finally:
        del os.environ["WANDB_API_KEY"]
