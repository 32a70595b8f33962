"""Merging config, defaults and flags into LaunchOptions; planning decisions and refusals."""

from __future__ import annotations

import pytest

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import ConfigError, LaunchError, UsageError
from prefect_accelerate.launchers import choose_launcher, plan_launch
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options, options_from_namespace

GPU8 = StaticHost(kind="cuda", count=8, cores=16)
CPU = StaticHost(kind=None, count=0, cores=2)


def parse(*argv: str, host=GPU8, environ=None):
    args = build_parser().parse_args(["launch", *argv])
    return options_from_namespace(args, host=host, environ=environ or {})


def write(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_hyphen_and_underscore_spellings_give_the_same_options():
    a = parse("--num_processes", "2", "--multi_gpu", "--mixed_precision", "bf16", "t.py")
    b = parse("--num-processes", "2", "--multi-gpu", "--mixed-precision", "bf16", "t.py")
    assert a.model_dump(exclude={"given"}) == b.model_dump(exclude={"given"})


def test_script_arguments_pass_through_untouched_with_or_without_double_dash():
    options = parse("--cpu", "t.py", "--lr", "1", "--cpu", "-m", "x")
    assert options.training_script_args == ("--lr", "1", "--cpu", "-m", "x")
    dashed = parse("--cpu", "--", "t.py", "--num_processes", "9")
    assert dashed.training_script == "t.py" and dashed.training_script_args == ("--num_processes", "9")


def test_cli_wins_over_nested_config_keys_even_at_their_default_value(tmp_path):
    config = write(tmp_path, "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_offload_params: true\n")
    options = parse("--config_file", config, "--fsdp_sharding_strategy", "FULL_SHARD", "t.py")
    assert options.fsdp_sharding_strategy == "FULL_SHARD"  # given, equal to the default: still wins
    assert options.fsdp_offload_params is True  # from the config


def test_config_scalars_accelerate_ignores_are_applied(tmp_path):
    config = write(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\nrdzv_backend: c10d\nsame_network: true\nenable_cpu_affinity: true\ndowncast_bf16: 'yes'\n")
    options = parse("--config_file", config, "t.py")
    assert (options.rdzv_backend, options.same_network, options.enable_cpu_affinity, options.downcast_bf16) == ("c10d", True, True, True)
    overridden = parse("--config_file", config, "--rdzv_backend", "static", "t.py")
    assert overridden.rdzv_backend == "static"


def test_defaults_warning_lists_what_was_not_passed():
    options = parse("t.py", host=CPU)
    assert options.defaults_warning.startswith("The following values were not passed to `prefect-accelerate launch`")
    assert "`accelerate launch`" not in options.defaults_warning and "`accelerate config`" not in options.defaults_warning
    for part in ("`--num_processes` was set to a value of `1`", "`--num_machines` was set to a value of `1`", "`--mixed_precision` was set to a value of `'no'`", "`--dynamo_backend` was set to a value of `'no'`"):
        assert part in options.defaults_warning
    assert parse("--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "t.py", host=CPU).defaults_warning is None


def test_no_config_on_a_cpu_host_never_gives_zero_processes():
    assert parse("t.py", host=CPU).num_processes == 1
    with pytest.raises(UsageError, match="--num_processes 0"):
        parse("--num_processes", "0", "t.py")


def test_cpu_threads_follow_physical_cores_per_process():
    options = parse("--cpu", "--num_processes", "2", "t.py", host=StaticHost(cores=8))
    assert options.num_cpu_threads_per_process == 4
    assert "num_cpu_threads_per_process` was set to `4`" in options.defaults_warning
    assert parse("--cpu", "t.py", host=StaticHost(cores=8), environ={"OMP_NUM_THREADS": "3"}).num_cpu_threads_per_process == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cpu", "--multi_gpu", "t.py"], "only use one of"),
        (["--multi_gpu", "--num_processes", "1", "t.py"], "at least 2 processes"),
        (["-m", "--no_python", "t.py"], "cannot be used together"),
        (["--use_fsdp", "--fsdp_version", "1", "--use_parallelism_config", "t.py"], "FSDP version 2"),
        (["--use_parallelism_config", "t.py"], "FSDP version 2"),
    ],
)
def test_contradictory_flags_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


def test_parallelism_config_from_an_fsdp2_config_is_accepted(tmp_path):
    config = write(tmp_path, "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n  parallelism_config_tp_size: 2\n")
    assert parse("--config_file", config, "t.py").use_parallelism_config is True


def test_config_without_num_processes_asks_for_the_flag(tmp_path):
    config = write(tmp_path, "distributed_type: MULTI_GPU\n")
    with pytest.raises(ConfigError, match="--num_processes"):
        parse("--config_file", config, "t.py")
    assert parse("--config_file", config, "--num_processes", "2", "t.py").num_processes == 2


def test_too_few_gpu_ids_for_multi_gpu(tmp_path):
    config = write(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: '3'\n")
    with pytest.raises(UsageError, match="at least two ids"):
        parse("--config_file", config, "t.py")


def test_megatron_booleans_are_words_not_python_truthiness():
    options = parse("--use_megatron_lm", "--num_processes", "2", "--megatron_lm_no_save_optim", "False", "--megatron_lm_use_custom_fsdp", "true", "t.py")
    assert options.megatron_lm_no_save_optim is False and options.megatron_lm_use_custom_fsdp is True
    with pytest.raises(SystemExit):
        parse("--use_megatron_lm", "--megatron_lm_eod_mask_loss", "perhaps", "t.py")


def test_dynamo_backend_choice_is_spelled_correctly():
    assert parse("--num_processes", "1", "--dynamo_backend", "torchxla_trace_once", "t.py").dynamo_backend == "torchxla_trace_once"
    with pytest.raises(SystemExit):
        parse("--dynamo_backend", "torhchxla_trace_once", "t.py")


def test_options_are_frozen_and_planning_does_not_change_them():
    options = build_launch_options("t.py", num_processes=2, multi_gpu=True, host=GPU8)
    before = options.model_dump()
    plan_launch(options, GPU8)
    plan_launch(options, GPU8)
    assert options.model_dump() == before
    with pytest.raises(Exception):
        options.num_processes = 3


def test_unknown_python_option_suggests_the_flag():
    with pytest.raises(UsageError, match="Did you mean `num_processes`"):
        build_launch_options("t.py", num_procesess=2)


def test_decision_tree_matches_accelerate():
    assert choose_launcher(parse("--use_fsdp", "--num_processes", "2", "t.py")) == "torchrun"
    assert choose_launcher(parse("--use_megatron_lm", "--num_processes", "2", "t.py")) == "torchrun"
    assert choose_launcher(parse("--num_processes", "1", "t.py")) == "simple"
    assert choose_launcher(parse("--cpu", "--num_processes", "2", "t.py")) == "torchrun-cpu"
    assert choose_launcher(parse("--use_deepspeed", "--num_processes", "2", "t.py")) == "deepspeed"
    assert choose_launcher(parse("--tpu", "t.py", host=CPU)) == "tpu"


def test_busy_ports(tmp_path):
    busy = StaticHost(kind="cuda", count=8, busy_ports={29500, 31000}, next_free_port=40000)
    implicit = plan_launch(parse("--multi_gpu", "--num_processes", "2", "t.py", host=busy), busy, cwd=str(tmp_path))
    assert "--master_port" in implicit.argv and implicit.argv[implicit.argv.index("--master_port") + 1] == "40000"
    assert any("29500 is in use" in note for note in implicit.notes)
    with pytest.raises(LaunchError, match="Port 31000 on this machine is already in use"):
        plan_launch(parse("--multi_gpu", "--num_processes", "2", "--main_process_port", "31000", "t.py", host=busy), busy)
    with pytest.raises(LaunchError, match="already in use"):
        plan_launch(parse("--multi_gpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "0",
                          "--main_process_ip", "10.0.0.1", "t.py", host=busy), busy)


def test_multi_machine_simple_launch_names_the_missing_address():
    with pytest.raises(UsageError, match="--main_process_ip"):
        plan_launch(parse("--num_processes", "1", "--num_machines", "2", "t.py"), GPU8)


def test_mpirun_missing_is_a_clear_error(tmp_path):
    config = write(tmp_path, "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 4\nmpirun_config:\n  mpirun_hostfile: /etc/hosts.mpi\n")
    with pytest.raises(LaunchError, match="neither mpirun nor mpiexec"):
        plan_launch(parse("--config_file", config, "t.py", host=CPU), CPU)


def test_the_default_config_is_announced_and_skipped_under_cpu(hf_home):
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nfp16: true\n")
    options = parse("t.py")
    assert options.config_source == "default" and options.multi_gpu
    assert any("Using the default config file" in note for note in options.notes)
    assert any("older format" in note for note in options.notes)
    under_cpu = parse("--cpu", "t.py")
    assert under_cpu.config_path is None
    assert any("not read because --cpu" in note for note in under_cpu.notes)


def test_aws_keys_are_secrets_in_options():
    options = parse("--aws_access_key_id", "AKIAEXAMPLE", "--aws_secret_access_key", "s3cr3t-value", "--num_processes", "1", "t.py")
    dumped = options.model_dump_json()
    assert "s3cr3t-value" not in dumped and "AKIAEXAMPLE" not in dumped and "s3cr3t-value" not in repr(options)
    assert options.aws_secret_access_key.get_secret_value() == "s3cr3t-value"


def test_port_zero_is_refused_on_a_machine_that_is_not_the_main_one():
    options = parse("--multi_gpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
                    "--main_process_ip", "10.0.0.1", "--main_process_port", "0", "t.py")
    with pytest.raises(UsageError, match="machine rank 1"):
        plan_launch(options, GPU8)


def test_grace_period_must_be_positive_and_is_warned_about_at_prefects_kill_time():
    with pytest.raises(UsageError, match="--grace_period is 0.0: it must be a number of seconds above 0"):
        parse("--cpu", "--grace_period", "0", "t.py")
    assert not any("grace_period" in note for note in parse("--cpu", "--grace_period", "29", "t.py").notes)
    long = parse("--cpu", "--grace_period", "30", "t.py")
    assert any("--grace_period 30 s is not below Prefect's 30 s" in note for note in long.notes)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--num_processes", "99999999999"], "--num_processes"),
        (["--cpu", "--num_processes", "5000"], "--num_processes"),
        (["--num_machines", "-3"], "--num_machines"),
        (["--main_process_port", "-5"], "--main_process_port"),
        (["--main_process_port", "99999"], "--main_process_port"),
        (["--use_deepspeed", "--zero_stage", "7"], "--zero_stage"),
        (["--gpu_ids", "abc,-1"], "--gpu_ids"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "-5"], "--timeout"),
        (["--grace_period", "nan"], "--grace_period"),
        (["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "10.0.0.1"], "--machine_rank"),
    ],
)
def test_nonsense_values_are_refused_naming_the_flag(argv, named):
    with pytest.raises(UsageError, match=named):
        parse(*argv, "t.py", host=CPU)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("num_processes: 99999999999", "num_processes"),
        ("num_machines: -3", "num_machines"),
        ("main_process_port: 99999", "main_process_port"),
        ("gpu_ids: abc,-1", "gpu_ids"),
        ("deepspeed_config:\n  zero_stage: 7", "deepspeed_config.zero_stage"),
    ],
)
def test_the_same_nonsense_in_a_config_file_is_refused_naming_the_field(tmp_path, line, field):
    from prefect_accelerate.config.update import update_config_file

    config = write(tmp_path, f"distributed_type: MULTI_CPU\n{line}\n")
    before = (tmp_path / "cfg.yaml").read_bytes()
    with pytest.raises(ConfigError, match=f"`{field}`"):
        parse("--config_file", config, "t.py", host=CPU)
    with pytest.raises(ConfigError, match=f"`{field}`"):
        update_config_file(config)
    assert (tmp_path / "cfg.yaml").read_bytes() == before
