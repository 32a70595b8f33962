"""`tpu-config`: Accelerate's exact `Running gcloud ...` strings (reference §8), the fixed quirks (§13.14),
and real runs through a fake gcloud that plays a two-worker pod on this machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from prefect_accelerate.cli import main as cli_main
from prefect_accelerate.errors import LaunchError, UsageError
from prefect_accelerate.launchers.engines.tpu import gcloud
from prefect_accelerate.tpu_config import TpuConfigRequest, resolve_tpu_config, run_tpu_config

FAKES = Path(__file__).resolve().parent.parent / "launchers" / "fakes"
SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"

LATEST = """\
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
num_machines: 1
num_processes: 1
gpu_ids: all
rdzv_backend: static
same_network: true
use_cpu: false
main_training_function: main
tpu_name: test-tpu
tpu_zone: us-central1-a
commands: null
command_file: {command_file}
"""
COMMAND_FILE = 'echo "hello world"\necho "this is a second command"\n'
PLAIN = "Running gcloud compute tpus tpu-vm ssh test-tpu --zone us-central1-a --command cd /usr/share; {} --worker all"


@pytest.fixture(autouse=True)
def isolated(hf_home, monkeypatch):
    """No default config unless a test writes one."""
    monkeypatch.delenv(gcloud.TPU_BLOCK_ENV, raising=False)


@pytest.fixture
def latest(tmp_path) -> str:
    commands = tmp_path / "test_command_file.sh"
    commands.write_text(COMMAND_FILE)
    config = tmp_path / "latest.yaml"
    config.write_text(LATEST.format(command_file=commands))
    return str(config)


def ours(argv: list[str], capsys) -> str:
    code = cli_main.main(["tpu-config", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip()


def accelerates(argv: list[str], capsys) -> str:
    from accelerate.commands.tpu import tpu_command_launcher, tpu_command_parser

    tpu_command_launcher(tpu_command_parser().parse_args(argv))
    return capsys.readouterr().out.strip()


def accelerate_cases(latest: str) -> dict[str, tuple[list[str], str]]:
    """Accelerate's own TpuConfigTester cases: argv and the exact line it prints."""
    base = ["--tpu_name", "test-tpu", "--tpu_zone", "us-central1-a"]
    two = 'echo "hello world"; echo "this is a second command"'
    return {
        "base": ([*base, "--command", "ls", "--debug"], PLAIN.format("ls")),
        "config": (["--config_file", latest, "--debug"], PLAIN.format(two)),
        "config-and-command": (["--config_file", latest, "--command", "ls", "--debug"], PLAIN.format("ls")),
        "two-commands": (["--config_file", latest, "--command", "ls", "--command", 'echo "Hello World"', "--debug"],
                         PLAIN.format('ls; echo "Hello World"')),
        "command-file": (["--config_file", latest, "--command_file", latest.replace("latest.yaml", "test_command_file.sh"), "--debug"],
                         PLAIN.format(two)),
        "backward-compat": (["--config_file", str(SAMPLES / "era2_downcast_text.yaml"), "--command_file",
                             latest.replace("latest.yaml", "test_command_file.sh"), *base, "--debug"], PLAIN.format(two)),
        "install-latest": (["--config_file", latest, "--install_accelerate", "--debug"], PLAIN.format(f"pip install accelerate -U; {two}")),
        "install-version": (["--config_file", latest, "--install_accelerate", "--accelerate_version", "12.0.0", "--debug"],
                            PLAIN.format(f"pip install accelerate==12.0.0; {two}")),
    }


@pytest.mark.parametrize("case", ["base", "config", "config-and-command", "two-commands", "command-file", "backward-compat",
                                  "install-latest", "install-version"])
def test_debug_prints_exactly_what_accelerate_prints(case, latest, capsys):
    argv, expected = accelerate_cases(latest)[case]
    assert ours(argv, capsys) == expected
    assert accelerates(argv, capsys) == expected  # the oracle agrees with the reference's strings


def test_a_multi_word_command_stays_one_command_where_accelerate_splits_it(capsys):
    argv = ["--tpu_name", "test-tpu", "--tpu_zone", "us-central1-a", "--command", "echo", "hello", "--debug"]
    assert ours(argv, capsys) == PLAIN.format("echo hello")
    assert accelerates(argv, capsys) == PLAIN.format("echo; hello")  # the quirk we fix (reference §13.14)


def test_a_missing_name_or_zone_is_an_error_that_says_where_to_set_them(capsys):
    code = cli_main.main(["tpu-config", "--tpu_zone", "us-central1-a", "--command", "ls", "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "No name (--tpu_name)" in err and "tpu_name/tpu_zone in the config file" in err
    with pytest.raises(UsageError, match=r"No zone \(--tpu_zone\)"):
        resolve_tpu_config(tpu_name="pod", command=["ls"])
    from accelerate.commands.tpu import tpu_command_launcher, tpu_command_parser

    with pytest.raises(TypeError):  # Accelerate: a None in the argv it joins
        tpu_command_launcher(tpu_command_parser().parse_args(["--tpu_zone", "z", "--command", "ls", "--debug"]))


def test_no_command_at_all_is_accelerates_error_with_the_ways_to_give_one():
    with pytest.raises(UsageError, match="You must specify either a command file or a command to run on the pod"):
        resolve_tpu_config(tpu_name="pod", tpu_zone="z")


def test_command_and_command_file_together_are_refused(tmp_path):
    (tmp_path / "c.sh").write_text("ls\n")
    with pytest.raises(UsageError, match="not both"):
        resolve_tpu_config(tpu_name="pod", tpu_zone="z", command=["ls"], command_file=tmp_path / "c.sh")


def test_blank_lines_of_a_command_file_are_skipped(tmp_path):
    (tmp_path / "c.sh").write_text("echo a\n\n   \necho b\n")
    request = resolve_tpu_config(tpu_name="pod", tpu_zone="z", command_file=tmp_path / "c.sh")
    assert request.remote_script() == "cd /usr/share; echo a; echo b"


@pytest.mark.parametrize(("version", "spec"), [("latest", "accelerate -U"), ("dev", "git+https://github.com/huggingface/accelerate.git"),
                                               ("1.16.0", "accelerate==1.16.0")])
def test_accelerate_versions_become_pip_requirements(version, spec):
    request = resolve_tpu_config(tpu_name="pod", tpu_zone="z", command=["ls"], install_accelerate=True, accelerate_version=version)
    assert request.remote_script() == f"cd /usr/share; pip install {spec}; ls"


def test_an_accelerate_version_that_is_not_a_version_is_a_usage_error():
    with pytest.raises(UsageError, match="'main' is not a version"):
        resolve_tpu_config(tpu_name="pod", tpu_zone="z", command=["ls"], install_accelerate=True, accelerate_version="main")


@pytest.mark.parametrize(("version", "spec"), [("latest", "prefect-accelerate -U"), ("0.1.0", "prefect-accelerate==0.1.0"),
                                               ("/tmp/prefect_accelerate-0.1.0-py3-none-any.whl", "/tmp/prefect_accelerate-0.1.0-py3-none-any.whl")])
def test_prefect_accelerate_is_installed_on_the_pod_when_asked(version, spec, capsys):
    out = ours(["--tpu_name", "pod", "--tpu_zone", "z", "--install_accelerate", "--install_prefect_accelerate",
                "--prefect_accelerate_version", version, "--command", "ls", "--debug"], capsys)
    assert out == f"Running gcloud compute tpus tpu-vm ssh pod --zone z --command cd /usr/share; pip install accelerate -U; pip install {spec}; ls --worker all"


def test_alpha_project_and_a_pod_block_shape_the_command(monkeypatch, capsys):
    monkeypatch.setattr(gcloud, "load_pod_block", lambda name: {"name": "block-pod", "zone": "europe-west4-a", "project": "team"})
    out = ours(["--tpu_block", "team-pod", "--use_alpha", "--command", "ls", "--debug"], capsys)
    assert out == "Running gcloud alpha compute tpus tpu-vm ssh block-pod --zone europe-west4-a --project team --command cd /usr/share; ls --worker all"


def test_flags_win_over_the_config_for_name_and_zone(latest, capsys):
    out = ours(["--config_file", latest, "--tpu_name", "other", "--tpu_zone", "us-east5-a", "--command", "ls", "--debug"], capsys)
    assert out == "Running gcloud compute tpus tpu-vm ssh other --zone us-east5-a --command cd /usr/share; ls --worker all"


def test_the_default_config_is_read_as_in_accelerate(hf_home, latest, capsys):
    default = hf_home / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(Path(latest).read_text())
    assert ours(["--debug"], capsys) == PLAIN.format('echo "hello world"; echo "this is a second command"')


# ------------------------------------------------------------------------------------------------
# Real runs through the fake gcloud


@pytest.fixture
def fake_pod(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join([str(FAKES / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]))
    monkeypatch.setenv("FAKE_GCLOUD_LOG", str(tmp_path / "gcloud.log"))
    monkeypatch.setenv("FAKE_TPU_ROOT", str(tmp_path / "pod"))
    monkeypatch.setenv("FAKE_TPU_WORKERS", "2")
    monkeypatch.delenv("FAKE_GCLOUD_FAIL", raising=False)
    return tmp_path


def gcloud_calls(folder: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in (folder / "gcloud.log").read_text().splitlines()]


def test_tpu_config_runs_the_commands_on_every_worker_and_reports_success(fake_pod, capsys):
    out = ours(["--no-track", "--tpu_name", "pod", "--tpu_zone", "z", "--command", 'echo "set up $TPU_WORKER_ID" > ~/setup.txt',
                "--command", "echo done"], capsys)
    assert out.splitlines()[-1] == "Successfully setup pod."
    request = resolve_tpu_config(tpu_name="pod", tpu_zone="z", command=['echo "set up $TPU_WORKER_ID" > ~/setup.txt', "echo done"])
    assert gcloud_calls(fake_pod) == [request.argv()]
    assert [(fake_pod / "pod" / "pod" / f"worker-{i}" / "setup.txt").read_text() for i in (0, 1)] == ["set up 0\n", "set up 1\n"]


def test_a_gcloud_failure_is_a_launch_error_with_gclouds_exit_code_and_no_success_message(fake_pod, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_GCLOUD_FAIL", "3")
    code = cli_main.main(["tpu-config", "--no-track", "--tpu_name", "pod", "--tpu_zone", "z", "--command", "ls"])
    out, err = capsys.readouterr()
    assert code == 3 and "Successfully setup pod." not in out
    assert "gcloud exited with code 3" in err and "NOT_FOUND" in err
    request = TpuConfigRequest(pod=gcloud.TpuPod(name="pod", zone="z"), commands=("ls",))
    with pytest.raises(LaunchError) as raised:
        run_tpu_config(request)
    assert raised.value.exit_code == 3


def test_a_failing_command_on_a_worker_fails_tpu_config(fake_pod):
    request = TpuConfigRequest(pod=gcloud.TpuPod(name="pod", zone="z"), commands=("test $TPU_WORKER_ID = 0",))
    with pytest.raises(LaunchError, match="gcloud exited with code 1"):
        run_tpu_config(request)


@pytest.mark.slow
def test_tracked_tpu_config_runs_as_a_flow_with_a_task_and_an_artifact(fake_pod, prefect_harness):
    from prefect.artifacts import Artifact

    from prefect_accelerate.flows.tpu import tpu_config_flow
    from prefect_accelerate.tasks.tpu import RESULT_ARTIFACT_KEY

    request = resolve_tpu_config(tpu_name="pod", tpu_zone="z", command=["echo tracked-$TPU_WORKER_ID"])
    result = tpu_config_flow(request=request)
    assert result.succeeded and result.command == request.argv()
    assert any("tracked-0" in line for line in result.tail) and any("tracked-1" in line for line in result.tail)

    found = Artifact.get(RESULT_ARTIFACT_KEY)  # the newest by update time
    data = found.data if found else None
    assert data is not None and "tpu-config on `pod`" in data
