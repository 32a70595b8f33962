"""Each pod's own command, run for real: the manifest's command, args and env, one process per pod, with
JOB_COMPLETION_INDEX set as the Job controller sets it, and pod 0's DNS name resolving to 127.0.0.1 through a hosts
file bind-mounted over /etc/hosts in each "pod"'s own mount namespace, with its own hostname (`unshare -m -u`).

What only a cluster can add: the Service's DNS records, the pods' network, the Job controller, the image.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.launchers.engines.kubernetes import plan as kplan
from prefect_accelerate.launchers.engines.kubernetes.pod_entry import DNS_TIMEOUT_EXIT_CODE
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

from helpers.processes import end_group

REPO = Path(__file__).resolve().parents[4]
BIND_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'
#: a pod: its own hostname (as the kubelet sets it, `<job>-<index>`) and its own /etc/hosts
POD_SHELL = 'hostname "$1" && mount --bind "$0" /etc/hosts && shift && exec "$@"'


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare here"
    done = subprocess.run(["unshare", "-m", "-u", "--propagation", "private", "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare -m -u refused: {done.stderr.strip()} (needs root or CAP_SYS_ADMIN)"


pytestmark = pytest.mark.skipif(_can_unshare() is not None, reason=str(_can_unshare()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job(tmp_path: Path, *extra: str, script: str = "examples/train_ddp.py", args: tuple[str, ...] = ("--steps", "5")) -> tuple[str, dict]:
    parsed = build_parser().parse_args([
        "launch", "--kubernetes", "--kubernetes_image", "local", "--kubernetes_working_dir", str(REPO), *extra, script, *args])
    plan = kplan.plan(options_from_namespace(parsed, environ={}), StaticHost(), cwd=str(REPO), run_dir=str(tmp_path / "run"))
    return plan.request["rendezvous"], plan.request["manifests"][1]


def _pod_env(container: dict, index: int, secrets: dict[str, str]) -> dict[str, str]:
    """What the container would see: a small base (the image's), the manifest's env, the Job controller's index."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "PYTHONPATH", "PREFECT_ACCELERATE_STATE_DIR") if k in os.environ}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the image's `python`
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[f"{ref['name']}:{ref['key']}"]  # what the kubelet reads from the Secret
    env["JOB_COMPLETION_INDEX"] = str(index)
    return env


def _start_pod(container: dict, index: int, folder: Path, rendezvous: str, secrets: dict[str, str]) -> subprocess.Popen:
    """One pod: its hostname and hosts file as the kubelet writes them (its own name, pod 0's name through the
    headless Service, here both on 127.0.0.1), the manifest's command, args and env, JOB_COMPLETION_INDEX."""
    hostname = rendezvous.split(".")[0].rsplit("-", 1)[0] + f"-{index}"
    hosts = folder / f"hosts-{index}"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {hostname}\n127.0.0.1 {rendezvous}\n")
    command = [*container["command"], *container["args"]]
    log = folder / f"pod-{index}.log"
    return subprocess.Popen(["unshare", "-m", "-u", "--propagation", "private", "sh", "-c", POD_SHELL, str(hosts), hostname, *command],
                            env=_pod_env(container, index, secrets), cwd=container.get("workingDir"), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_pods_own_command_forms_one_world_of_the_right_size_and_trains(tmp_path):
    rendezvous, job = _job(tmp_path, "--cpu", "--num_machines", "2", "--num_processes", "4", "--mixed_precision", "no",
                           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                           "--kubernetes_secret_env", "HF_TOKEN=hf-token:token")
    container = job["spec"]["template"]["spec"]["containers"][0]
    secrets = {"hf-token:token": "hf_not_a_real_token_123"}
    logs = [tmp_path / f"pod-{i}.log" for i in range(2)]
    pods = [_start_pod(container, i, tmp_path, rendezvous, secrets) for i in (1, 0)]
    try:
        for pod in pods:
            pod.wait(timeout=480)
    finally:
        for pod in pods:
            end_group(pod)
    outputs = [log.read_text(errors="replace") for log in logs]
    assert [pod.returncode for pod in pods] == [0, 0], "\n\n".join(outputs)
    for index, output in enumerate(outputs):
        assert f"[prefect-accelerate] node {index} of 2: {rendezvous} resolved" in output
    finished = re.findall(r"rank (\d)/(\d) finished 5 steps, weight checksum (-?[0-9.]+)", "\n".join(outputs))
    assert sorted(int(rank) for rank, _, _ in finished) == [0, 1, 2, 3]
    assert {world for _, world, _ in finished} == {"4"}  # one world of 2 pods x 2 processes
    assert len({checksum for _, _, checksum in finished}) == 1  # the ranks trained together: the same weights
    # node 1's ranks are 2 and 3: the rank came from JOB_COMPLETION_INDEX
    assert re.search(r"\[default\d\]:rank [23]/4 finished", outputs[1])
    assert "hf_not_a_real_token_123" not in "\n".join(outputs)
    assert "Unable to resolve hostname" not in "\n".join(outputs)  # each pod's own name resolves, as in a cluster


def test_a_name_that_never_resolves_is_a_bounded_wait_and_one_line_naming_it(tmp_path):
    name = "pa-nowhere-000000-0.pa-nowhere-000000"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", kplan.ENTRY_MODULE, "--wait-for", name, "--timeout", "2", "--nodes", "2", "--",
                           sys.executable, "-c", "print('must not run')"],
                          env={**os.environ, "JOB_COMPLETION_INDEX": "1"}, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == DNS_TIMEOUT_EXIT_CODE != 0
    assert "must not run" not in done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and name in lines[0] and "did not resolve within 2 s" in lines[0], done.stderr
    assert took < 60  # bounded (a Python start-up plus 2 s, on a loaded machine)


def test_the_wait_ends_as_soon_as_pod_zeros_name_appears(tmp_path):
    name = "pa-late-000000-0.pa-late-000000"
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    marker = tmp_path / "started"
    entry = [sys.executable, "-m", kplan.ENTRY_MODULE, "--wait-for", name, "--timeout", "120", "--nodes", "2", "--",
             sys.executable, "-c", f"import sys, pathlib; pathlib.Path({str(marker)!r}).write_text(' '.join(sys.argv[1:]))",
             "--node_rank", "$(JOB_COMPLETION_INDEX)"]
    pod = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", BIND_HOSTS, str(hosts), *entry],
                           env={**os.environ, "JOB_COMPLETION_INDEX": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        time.sleep(3)
        assert pod.poll() is None and not marker.exists()  # still waiting: the name does not resolve yet
        with hosts.open("a") as handle:  # written in place: the bind mount shows the same file
            handle.write(f"127.0.0.1 {name}\n")
        output, _ = pod.communicate(timeout=60)
    finally:
        end_group(pod)
    assert pod.returncode == 0, output
    assert marker.read_text() == "--node_rank 1"  # the index from JOB_COMPLETION_INDEX, in place of the reference
    assert f"{name} resolved after" in output


@pytest.mark.parametrize(("index", "words"), [(None, "not a node index"), ("2", "not a node index from 0 to 1"), ("x", "not a node index")])
def test_a_pod_without_a_valid_index_says_so_and_exits_2(index, words):
    from prefect_accelerate.launchers.engines.kubernetes.pod_entry import main

    saved = os.environ.pop("JOB_COMPLETION_INDEX", None)
    if index is not None:
        os.environ["JOB_COMPLETION_INDEX"] = index
    try:
        assert main(["--wait-for", "localhost", "--nodes", "2", "--", "true"]) == 2
    finally:
        os.environ.pop("JOB_COMPLETION_INDEX", None)
        if saved is not None:
            os.environ["JOB_COMPLETION_INDEX"] = saved


def test_wait_backs_off_and_says_every_thirty_seconds_while_it_waits():
    from prefect_accelerate.launchers.engines.kubernetes.pod_entry import WaitTimeout, wait_for_name

    now = [0.0]
    sleeps: list[float] = []
    said: list[str] = []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    def resolve(name, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(WaitTimeout, match="did not resolve within 100 s"):
        wait_for_name("x-0.x", 100, clock=lambda: now[0], sleep=sleep, resolve=resolve, say=said.append)
    assert sleeps[0] < 0.1 and max(sleeps) <= 2.0 and now[0] == pytest.approx(100)
    assert 2 <= len(said) <= 4  # about one line per 30 s, not one per try
