"""The CLI as a user runs it: subprocesses, exit codes, no tracebacks, no heavy imports for --help/--dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]


def run(*argv: str, env: dict | None = None, cwd: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd, input=stdin)


def imported_modules(*argv: str, env: dict | None = None, cwd: str | None = None) -> set[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "prefect_accelerate.cli.main", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd)
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    assert done.returncode == 0, done.stderr[-2000:]
    return names


def test_help_lists_the_commands_and_imports_neither_torch_nor_prefect():
    done = run("--help")
    assert done.returncode == 0
    for command in ("config", "env", "launch", "test", "to-fsdp2", "check"):
        assert command in done.stdout
    modules = imported_modules("--help")
    assert not {m for m in modules if m.split(".")[0] in ("torch", "prefect")}


def test_launch_help_hides_hyphen_aliases():
    text = run("launch", "--help").stdout
    assert "--num_processes" in text and "--num-processes" not in text


def test_dry_run_json_is_one_object_and_imports_nothing_heavy(tmp_path):
    argv = ("launch", "--dry-run", "--json", "--cpu", "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1", "train.py", "--lr", "1")
    (tmp_path / "train.py").write_text("print('train')\n")
    done = run(*argv, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert set(plan) == {"launcher", "argv", "env", "cwd"}
    assert plan["launcher"] == "torchrun" and plan["argv"][-3:] == ["train.py", "--lr", "1"]
    assert plan["env"]["ACCELERATE_USE_CPU"] == "True" and plan["cwd"] == str(tmp_path)
    modules = imported_modules(*argv, cwd=str(tmp_path))
    assert "prefect_accelerate.launchers.engines" in modules  # it did plan
    assert not {m for m in modules if m.split(".")[0] in ("torch", "prefect")}
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # nothing written, nothing started


def test_dry_run_redacts_secrets(tmp_path):
    done = run("launch", "--dry-run", "--json", "--num_processes", "1", "--aws_secret_access_key", "verysecretvalue", "train.py", cwd=str(tmp_path))
    assert "verysecretvalue" not in done.stdout + done.stderr


def test_config_errors_are_one_paragraph_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: NO\nnum_processes: lots\n")
    done = run("launch", "--config_file", str(bad), "--dry-run", "train.py")
    assert done.returncode == 2
    assert done.stderr.startswith("error: The config file") and "Traceback" not in done.stderr
    assert str(bad) in done.stderr and "num_processes" in done.stderr
    shown = run("--debug", "launch", "--config_file", str(bad), "--dry-run", "train.py")
    assert "Traceback" in shown.stderr


def test_usage_errors_exit_2_without_traceback():
    done = run("launch", "--cpu", "--multi_gpu", "--dry-run", "train.py")
    assert done.returncode == 2 and "only use one of" in done.stderr and "Traceback" not in done.stderr


def test_config_default_update_and_to_fsdp2_through_the_cli(tmp_path):
    target = tmp_path / "c.yaml"
    done = run("config", "default", "--config_file", str(target), "--mixed-precision", "bf16")
    assert done.returncode == 0 and f"saved at {target}" in done.stdout
    assert yaml.safe_load(target.read_text())["mixed_precision"] == "bf16"
    again = run("config", "default", "--config_file", str(target))
    assert again.returncode == 0 and "--force" in again.stdout
    old = tmp_path / "old.yaml"
    old.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nfp16: true\n")
    updated = run("config", "update", "--config_file", str(old))
    assert updated.returncode == 0 and "fp16: true became mixed_precision: fp16" in updated.stdout
    assert (tmp_path / "old.yaml.bak").exists()
    fsdp = tmp_path / "f.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_use_orig_params: true\n")
    converted = run("to-fsdp2", "--config_file", str(fsdp), "--output_file", str(tmp_path / "f2.yaml"))
    assert converted.returncode == 0, converted.stderr
    assert yaml.safe_load((tmp_path / "f2.yaml").read_text())["fsdp_config"] == {"fsdp_reshard_after_forward": False, "fsdp_version": 2}


def test_commands_using_the_default_file_say_which(tmp_path):
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text("distributed_type: NO\nfp16: true\n")
    done = run("config", "update", env={"HF_HOME": str(home)})
    assert f"Using the default config file {home / 'accelerate' / 'default_config.yaml'}" in done.stderr
    (tmp_path / "train.py").write_text("print('train')\n")
    launched = run("launch", "--dry-run", "train.py", env={"HF_HOME": str(home)}, cwd=str(tmp_path))
    assert f"Using the default config file {home / 'accelerate' / 'default_config.yaml'}" in launched.stdout


def test_update_without_any_config_says_where_it_looked(tmp_path):
    done = run("config", "update", env={"HF_HOME": str(tmp_path / "empty")})
    assert done.returncode == 2 and str(tmp_path / "empty" / "accelerate" / "default_config.yaml") in done.stderr


@pytest.mark.slow
def test_selftest_through_the_cli_on_two_cpu_processes(tmp_path):
    config = tmp_path / "mc.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: bf16\n")
    done = run("test", "--no-track", "--config_file", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    for check in ("process-group", "all-reduce", "broadcast", "all-gather", "barrier", "rng-sync", "distributed-sampler", "training-steps", "mixed-precision", "accelerator"):
        assert f"[selftest] PASS {check}" in done.stdout
    assert "Accelerator(): MULTI_CPU, 2 process(es), mixed precision bf16" in done.stdout
    assert "Test is a success!" in done.stdout


@pytest.mark.slow
def test_selftest_failure_names_the_check_and_rank(tmp_path):
    config = tmp_path / "mc.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    done = run("test", "--no-track", "--config_file", str(config), env={"SELFTEST_BREAK": "1:rng-sync"})
    assert done.returncode == 3
    assert "[selftest] FAIL rng-sync on rank(s) 1" in done.stdout
    assert "check rng-sync on rank(s) [1]" in done.stderr


@pytest.mark.slow
def test_selftest_single_process_without_config(tmp_path):
    done = run("test", "--no-track", env={"HF_HOME": str(tmp_path / "none")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Accelerator(): NO, 1 process(es)" in done.stdout


SAGEMAKER_CONFIG = """\
compute_environment: AMAZON_SAGEMAKER
distributed_type: 'NO'
ec2_instance_type: ml.p3.2xlarge
iam_role_name: role
profile: default
region: us-east-1
num_machines: 1
mixed_precision: 'no'
"""


@pytest.mark.parametrize("local_flag", ["--multi_gpu", "--use_fsdp", "--tpu"])
def test_a_sagemaker_config_sent_to_a_local_launcher_without_a_process_count_is_one_paragraph(tmp_path, local_flag):
    """A SageMaker config sizes instances, not processes; a flag that launches here needs --num_processes
    (found by the hardening property test: a TypeError in the torchrun plan)."""
    (tmp_path / "sm.yaml").write_text(SAGEMAKER_CONFIG)
    (tmp_path / "train.py").write_text("print('never runs')\n")
    done = run("launch", "--config_file", "sm.yaml", "--dry-run", local_flag, "train.py", cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    assert "sm.yaml" in done.stderr and "--num_processes" in done.stderr


def test_output_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`launch --dry-run | head -0`: the reader closes the pipe; no BrokenPipeError traceback, the SIGPIPE status."""
    (tmp_path / "train.py").write_text("print('never runs')\n")
    child = subprocess.Popen([*CLI, "launch", "--cpu", "--num_processes", "2", "--dry-run", "train.py"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the plan is printed (so the write always meets a closed pipe)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 141, stderr.decode()
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr


TEARDOWN_PROBE = """\
import sys, types
if sys.argv[2] == "prefect":
    sys.modules.setdefault("prefect", types.ModuleType("prefect"))  # as after a command that imported Prefect


class Witness:
    def __del__(self):
        print("interpreter teardown ran", flush=True)


witness = Witness()
sys.argv = ["prefect-accelerate", "config", "default", "--config_file", sys.argv[1]]
from prefect_accelerate.cli.main import entrypoint
entrypoint()
"""


def test_the_installed_command_skips_the_teardown_of_prefects_modules_after_its_exit_handlers(tmp_path):
    """The console script must call `entrypoint` (which ends a command that imported Prefect with os._exit after the
    last exit handler); `main` alone left 0.2 s of module teardown after every tracked launch."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["prefect-accelerate"] == "prefect_accelerate.cli.main:entrypoint"
    config = tmp_path / "default.yaml"
    done = subprocess.run([sys.executable, "-c", TEARDOWN_PROBE, str(config), "prefect"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert config.exists(), "the command did not run"
    assert "interpreter teardown ran" not in done.stdout
    without = subprocess.run([sys.executable, "-c", TEARDOWN_PROBE, str(tmp_path / "other.yaml"), "no prefect"], capture_output=True,
                             text=True, timeout=120)
    assert without.returncode == 0 and "interpreter teardown ran" in without.stdout, "the witness cannot see a teardown"
