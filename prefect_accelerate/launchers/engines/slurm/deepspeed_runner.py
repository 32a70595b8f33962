"""DeepSpeed's own `slurm` launcher inside the allocation: its runner, run once by the batch script.

With `deepspeed_multinode_launcher: slurm`, DeepSpeed's runner starts every rank itself, with one
`srun -n TOTAL --nodes N python -u SCRIPT ...`. Under `launch --slurm` the batch script runs that runner on
the batch host, after writing a hostfile of the allocation's nodes (`scontrol show hostnames`, `slots=` the
processes per node). What differs from running `deepspeed --launcher slurm` by hand:
- `--no_ssh_check` and `--master_addr`/`--master_port` (the head node's address and the port the batch
  script picked): the runner would otherwise ssh to the first host, which a Slurm job does not need;
- `--num_gpus` only when the job asks for GPUs (--slurm_gpus_per_node): DeepSpeed turns it into srun's
  `--gpus-per-node`, which a cluster without GPU GRES refuses; the hostfile's slots set the count anyway;
- srun also gets `--label` (our output labels), `--kill-on-bad-exit=1` (one failing rank ends the step, as
  with torchrun) and `--ntasks-per-node` (srun's default block layout can put more ranks on one node);
- a `sitecustomize.py` in the run folder (rank_env.py) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT from Slurm's task variables in every rank, which srun alone does not;
- the launch's variables are exported by the batch script and reach the ranks through srun's
  `--export=ALL`, so no `.deepspeed_env` is written (DeepSpeed still reads the user's ~/ and ./.deepspeed_env).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.launchers.engines.deepspeed.plan import prepare, runner_arguments
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan

HOSTFILE_NAME = "hostfile"
#: the folder of the run folder that holds sitecustomize.py; first on the ranks' PYTHONPATH
SITE_FOLDER = "site"
HEAD_VAR = "${PA_HEAD_ADDR}"
PORT_VAR = "${PA_PORT}"


def sitecustomize_source() -> str:
    return Path(__file__).with_name("rank_env.py").read_text(encoding="utf-8")


def runner_plan(options, host: HostProbe, *, cwd: str, run_dir: str, gpus_per_node: int | None) -> LaunchPlan:
    """The runner command the batch script runs, its environment and the sitecustomize file. Pure.

    Raises:
        DependencyError: DeepSpeed is not installed. UsageError: filters, or a process count the nodes cannot share.
        ConfigError: settings Accelerate's DeepSpeed plugin would refuse.
    """
    _, env, warnings = prepare(options, host, cwd)
    machines, processes = int(options.num_machines), int(options.num_processes)
    if processes % machines:
        raise UsageError(
            f"num_processes {processes} cannot be shared evenly by {machines} machines, and DeepSpeed's slurm launcher "
            "starts the same number of processes on every node. Pass a --num_processes that is a multiple of --num_machines."
        )
    if options.deepspeed_inclusion_filter is not None or options.deepspeed_exclusion_filter is not None:
        raise UsageError(
            "--slurm chooses the nodes through Slurm, so a DeepSpeed inclusion or exclusion filter has nothing to select "
            "from. Remove the filter and ask Slurm instead, e.g. --slurm_sbatch_args \"--exclude=node3\"."
        )
    site = os.path.join(run_dir, SITE_FOLDER)
    env["PYTHONPATH"] = ":".join([site, env["PYTHONPATH"]])
    env |= blocks.unbuffered_env()
    per_node = processes // machines
    hostfile = os.path.join(run_dir, HOSTFILE_NAME)
    srun_args = f"--label --kill-on-bad-exit=1 --ntasks-per-node={per_node}"
    arguments = runner_arguments(options.with_changes(deepspeed_hostfile=hostfile, main_process_ip=HEAD_VAR), "slurm", 0,
                                 num_gpus=bool(gpus_per_node))
    arguments[arguments.index("--master_port") + 1] = PORT_VAR
    argv = [host.python(), "-m", "deepspeed.launcher.runner", "--no_ssh_check", "--num_nodes", str(machines),
            f"--launcher_args={srun_args}", *arguments, options.training_script, *options.training_script_args]
    notes = [f"DeepSpeed's runner starts {processes} process(es), {per_node} on each of the allocation's {machines} nodes, "
             "with one srun."]
    if options.deepspeed_hostfile is not None:
        notes.append(f"The DeepSpeed hostfile {options.deepspeed_hostfile} is not used: the allocation's nodes are written "
                     f"to {hostfile} in the job.")
    if options.defaults_warning:
        warnings.insert(0, options.defaults_warning)
    return LaunchPlan(
        launcher="deepspeed-slurm", argv=tuple(argv), env=env, cwd=cwd, num_processes=processes, num_machines=machines,
        run_dir=run_dir, warnings=tuple(warnings), notes=(*options.notes, *notes),
        files={os.path.join(site, "sitecustomize.py"): sitecustomize_source()},
    )


def hostfile_line(run_dir: str, per_node: int) -> str:
    """The batch script's line that writes the allocation's nodes as a DeepSpeed hostfile."""
    return (f'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed \'s/$/ slots={per_node}/\' > '
            f"{shlex.quote(os.path.join(run_dir, HOSTFILE_NAME))} || exit 2")
