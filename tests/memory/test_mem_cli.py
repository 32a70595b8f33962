"""`prefect-accelerate estimate-memory` end to end (untracked): output, flags, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefect_accelerate.cli import main as cli_main
from prefect_accelerate.cli.parser import Parser

MODULE = "prefect_accelerate.cli.estimate_cmd"


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Call the real `main` with our module registered (COMMAND_MODULES gains it when the command ships)."""
    if MODULE not in cli_main.COMMAND_MODULES:
        monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, MODULE))

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli_main.main(["estimate-memory", *map(str, argv)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def parse(*argv: str):
    from prefect_accelerate.cli import estimate_cmd

    parser = Parser(prog="prefect-accelerate")
    estimate_cmd.add_parser(parser.add_subparsers(parser_class=Parser))
    return parser.parse_args(["estimate-memory", *argv])


def test_table_mode_prints_accelerates_output(run_cli, zoo):
    from prefect_accelerate.memory import EstimateOptions, estimate, render_text

    code, out, err = run_cli(zoo["tiny-gpt2"], "--dtypes", "float32", "int4")
    assert code == 0
    assert out.rstrip("\n") == render_text(estimate(str(zoo["tiny-gpt2"]), EstimateOptions(dtypes=("float32", "int4"))))
    assert out.startswith(f"Loading pretrained config for `{zoo['tiny-gpt2']}` from `transformers`...\n┌")
    assert "Per-device" not in out


def test_hyphen_spellings_and_defaults():
    args = parse("m", "--library-name", "timm", "--num-processes", "8", "--mixed-precision", "bf16", "--trust-remote-code")
    assert (args.library_name, args.num_processes, args.mixed_precision, args.trust_remote_code) == ("timm", 8, "bf16", True)
    assert parse("m").dtypes == ["float32", "float16", "int8", "int4"]


def test_layout_flag_turns_on_the_breakdown_with_ddp_by_default():
    from prefect_accelerate.cli.estimate_cmd import options_from_args

    assert options_from_args(parse("m")).strategy is None
    assert options_from_args(parse("m", "--batch_size", "4")).strategy == "ddp"
    assert options_from_args(parse("m", "--strategy", "zero3")).strategy == "zero3"


def test_breakdown_and_fit_verdict(run_cli, zoo):
    code, out, _ = run_cli(zoo["tiny-llama"], "--strategy", "zero3", "--num_processes", "2", "--mixed_precision", "bf16",
                           "--seq_len", "64", "--device_memory", "80GiB")
    assert code == 0
    assert "Per-device memory for training `LlamaForCausalLM`" in out
    assert "Total per device" in out and "CPU memory per machine" in out
    assert "Fits:" in out


def test_not_fitting_exits_1_with_the_smallest_change(run_cli, zoo):
    code, out, _ = run_cli(zoo["tiny-llama"], "--batch_size", "64", "--seq_len", "256", "--device_memory", "2000MiB")
    assert code == 1
    assert "Does not fit" in out and "Smallest change that buys room: --gradient_checkpointing" in out
    assert "Beyond the allocated peak: CUDA context and library workspaces" in out


def test_json_output_is_data(run_cli, zoo):
    code, out, _ = run_cli(zoo["tiny-gpt2"], "--json", "--strategy", "zero2", "--num_processes", "2", "--device_memory", "8GiB")
    payload = json.loads(out)
    assert code == 0
    assert payload["estimate"]["table"]["rows"][0]["dtype"] == "float32"
    assert payload["estimate"]["breakdown"]["strategy"] == "zero2"
    assert payload["verdict"]["fits"] is True
    assert "config" not in payload["estimate"]["source"]


@pytest.mark.parametrize("argv,message", [
    (["{missing}"], "looks like a path"),
    (["{empty}"], "has no config.json"),
    (["{model}", "--num_processes", "0"], "--num_processes must be at least 1"),
    (["{model}", "--strategy", "ddp", "--offload", "optimizer"], "needs a sharded strategy"),
    (["{broken}"], "is not valid JSON"),
    (["{unknown_timm}"], "has no architecture `resnet9000`"),
    (["{remote}"], "--trust_remote_code"),
])
def test_errors_exit_2_with_one_paragraph_and_no_traceback(run_cli, zoo, tmp_path, argv, message):
    files = {
        "broken": '{"model_type": "gpt2",,}',
        "unknown_timm": json.dumps({"architecture": "resnet9000", "num_classes": 10}),
        "remote": json.dumps({"model_type": "tiny-custom", "architectures": ["TinyForCausalLM"],
                              "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig"}}),
    }
    values = {"missing": tmp_path / "missing", "empty": tmp_path, "model": zoo["tiny-gpt2"]}
    for name, text in files.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        values[name] = tmp_path / name
    code, out, err = run_cli(*[a.format(**values) for a in argv])
    assert code == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_unknown_dtype_is_refused_by_the_parser():
    with pytest.raises(SystemExit) as exit_info:
        parse("m", "--dtypes", "float8")
    assert exit_info.value.code == 2


def test_help_imports_neither_torch_nor_prefect():
    code = (
        "import sys\n"
        "from prefect_accelerate.cli.parser import Parser\n"
        "from prefect_accelerate.cli import estimate_cmd\n"
        "p = Parser(prog='x'); estimate_cmd.add_parser(p.add_subparsers(parser_class=Parser)); p.format_help()\n"
        "heavy = [m for m in ('torch', 'prefect', 'transformers', 'timm', 'pydantic') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_python_api_estimates_without_importing_prefect(zoo):
    code = (
        "import sys\n"
        "from prefect_accelerate.memory import EstimateOptions, check_fit, estimate\n"
        f"est = estimate({str(zoo['tiny-gpt2'])!r}, EstimateOptions(strategy='zero2', num_processes=2, seq_len=16))\n"
        "assert check_fit(est, '4GiB').fits\n"
        "assert 'prefect' not in sys.modules, 'prefect was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_attn_implementation_flag_changes_what_is_modelled_and_says_so(run_cli, zoo):
    args = (zoo["tiny-gpt2"], "--json", "--seq_len", "64", "--batch_size", "4")
    _, default_out, _ = run_cli(*args)
    _, eager_out, _ = run_cli(*args, "--attn_implementation", "eager")
    default = json.loads(default_out)["estimate"]["breakdown"]
    eager = json.loads(eager_out)["estimate"]["breakdown"]
    assert default["attention"] == "sdpa (CUDA kernel: efficient)"  # fp32, no mask, equal heads
    assert eager["attention"] == "eager"
    acts = {b["attention"]: next(i["bytes"] for i in b["device_items"] if i["key"] == "activations") for b in (default, eager)}
    assert acts["eager"] > acts["sdpa (CUDA kernel: efficient)"]  # eager keeps its seq x seq probabilities
    _, text, _ = run_cli(zoo["tiny-gpt2"], "--seq_len", "64", "--attn_implementation", "flash_attention_2")
    assert "Attention: flash_attention_2" in text


def test_an_unknown_attn_implementation_is_refused_by_the_parser():
    with pytest.raises(SystemExit) as exit_info:
        parse("m", "--attn_implementation", "flex")
    assert exit_info.value.code == 2


@pytest.mark.parametrize("family", ["squeezebert", "llama", "gpt2"])
def test_a_config_the_models_own_constructor_rejects_is_bad_input_not_a_traceback(run_cli, tmp_path, family):
    """A config transformers or the model's own constructor rejects, each in its own way: SqueezeBERT asserts
    (AssertionError), a Llama whose per-layer list is one short fails the config class's strict validation
    (huggingface_hub's error, no ValueError), a GPT-2 with zero heads divides by zero. Each is the user's
    config, so: exit 2, one paragraph naming the error and the file, no traceback of ours (transformers' own
    warnings may come first)."""
    import transformers

    if family == "squeezebert":
        config = transformers.SqueezeBertConfig(hidden_size=64, embedding_size=32, num_hidden_layers=1,
                                                architectures=["SqueezeBertForMaskedLM"])
    elif family == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                                          vocab_size=100, architectures=["LlamaForCausalLM"])
        config.save_pretrained(tmp_path)
        raw = json.loads((tmp_path / "config.json").read_text())
        raw["layer_types"] = ["full_attention"]  # one entry for two layers
        (tmp_path / "config.json").write_text(json.dumps(raw))
        config = None
    else:
        config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=0, vocab_size=100, architectures=["GPT2LMHeadModel"])
    if config is not None:
        config.save_pretrained(tmp_path)
    code, out, err = run_cli(tmp_path)
    assert code == 2, (out, err)
    assert "prefect_accelerate/" not in out + err  # no frame of ours
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(tmp_path) in last and "Error" in last


def _deepspeed_json(folder, **zero):
    path = folder / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero}))
    return path


def _item(payload, key):
    return next(item for item in payload["estimate"]["breakdown"]["device_items"] if item["key"] == key)


def test_the_deepspeed_config_gives_the_stage_and_the_reduce_buckets(run_cli, zoo, tmp_path):
    """`--deepspeed_config_file`: the stage when --strategy is not given; "auto" is hidden_size squared (Accelerate
    fills it in so); overlap_comm doubles ZeRO-1/2's bucket; DeepSpeed's default is 5e8 elements whatever the size."""
    hidden = 64  # tiny-llama's hidden_size
    ds = _deepspeed_json(tmp_path, stage=2, reduce_bucket_size="auto", overlap_comm=True)
    code, out, _ = run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--mixed_precision", "bf16", "--json")
    payload = json.loads(out)
    assert code == 0 and payload["estimate"]["breakdown"]["strategy"] == "zero2"
    assert _item(payload, "communication_buffers")["bytes"] == 2 * 2 * hidden * hidden
    ds = _deepspeed_json(tmp_path, stage=3, reduce_bucket_size=2e6, overlap_comm=True)
    payload = json.loads(run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--json")[1])
    assert payload["estimate"]["breakdown"]["strategy"] == "zero3"
    assert _item(payload, "communication_buffers")["bytes"] == 4 * 2_000_000  # ZeRO-3 keeps one, overlap or not
    payload = json.loads(run_cli(zoo["tiny-llama"], "--strategy", "zero1", "--json")[1])
    assert _item(payload, "communication_buffers")["bytes"] == 4 * 500_000_000


def test_the_deepspeed_config_gives_zero3s_prefetch_and_reuse_settings(run_cli, zoo, tmp_path):
    """ZeRO-3's prefetch bucket ("auto": 0.9 x hidden_size squared, as Accelerate fills it in; DeepSpeed's field name
    works as well as its stage3_ alias), max_live_parameters capping it, and max_reuse_distance shrinking what stays
    gathered, all read from the JSON."""
    hidden = 64
    ds = _deepspeed_json(tmp_path, stage=3, stage3_prefetch_bucket_size="auto")
    payload = json.loads(run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--json")[1])
    profile = payload["estimate"]["profile"]
    assert payload["estimate"]["options"]["prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert _item(payload, "prefetch_buffer")["bytes"] == 4 * min(profile["parameters"],
                                                                int(0.9 * hidden * hidden) + profile["largest_tensor_numel"])
    ds = _deepspeed_json(tmp_path, stage=3, prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    payload = json.loads(run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--json")[1])
    assert _item(payload, "prefetch_buffer")["bytes"] == 0
    profile = payload["estimate"]["profile"]
    kept = min(profile["parameters"], max(profile["largest_unit_parameters"], profile["largest_module_parameters"]))
    assert _item(payload, "kept_gathered")["bytes"] == 4 * (kept - profile["largest_module_parameters"])
    ds = _deepspeed_json(tmp_path, stage=3, stage3_max_live_parameters=1000, sub_group_size=0)
    payload = json.loads(run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--json")[1])
    assert _item(payload, "prefetch_buffer")["bytes"] == 4 * 1000
    assert payload["estimate"]["options"]["sub_group_size"] == 0  # each weight a sub-group of its own


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_contiguous_gradients_false_is_said_to_be_unmodelled_and_widens_the_margin(run_cli, zoo, tmp_path, stage):
    """Every ZeRO rule here follows DeepSpeed's contiguous path (its default); a JSON that turns it off is read, and
    the verdict says it met a path it does not model (so 'Fits' needs the wider margin); left at its default, not."""
    ds = _deepspeed_json(tmp_path, stage=stage, contiguous_gradients=False)
    code, out, err = run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--device_memory", "80GiB")
    assert code == 0 and "Traceback" not in err
    assert "Not modelled: DeepSpeed's `contiguous_gradients: false`" in out
    payload = json.loads(run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--json")[1])
    assert payload["estimate"]["options"]["contiguous_gradients"] is False
    ds = _deepspeed_json(tmp_path, stage=stage, contiguous_gradients=True)
    assert "contiguous_gradients" not in run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, "--device_memory", "80GiB")[1]


@pytest.mark.parametrize("zero,argv,message", [
    ({"stage": 2}, ["--strategy", "zero3"], "disagrees with `zero_optimization.stage: 2`"),
    ({"reduce_bucket_size": "big"}, [], "`zero_optimization.reduce_bucket_size`"),
    ({"reduce_bucket_size": -5}, [], "`zero_optimization.reduce_bucket_size`"),
    ({"stage3_prefetch_bucket_size": 1.5}, [], "`zero_optimization.stage3_prefetch_bucket_size`"),
    ({"stage3_max_live_parameters": "auto"}, [], "Accelerate does not fill in \"auto\" here"),
    (None, [], "is not JSON"),
])
def test_a_bad_deepspeed_config_is_one_paragraph_naming_the_file_and_field(run_cli, zoo, tmp_path, zero, argv, message):
    ds = _deepspeed_json(tmp_path, **zero) if zero is not None else tmp_path / "ds.json"
    if zero is None:
        ds.write_text("{not json")
    code, _, err = run_cli(zoo["tiny-llama"], "--deepspeed_config_file", ds, *argv)
    assert code == 2 and message in err and str(ds) in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_the_pipelines_memory_gate_takes_the_launchs_deepspeed_json(zoo, tmp_path):
    """The gate sizes the launch it guards: the reduce buckets of the DeepSpeed JSON the launch names, and an edit of
    that JSON re-runs the gate (its layout is part of the step's key)."""
    from prefect_accelerate.pipeline.graph import build_graph, estimate_options, launch_options
    from prefect_accelerate.pipeline.models import PipelineRequest

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    ds = _deepspeed_json(tmp_path, stage=1, reduce_bucket_size=123456, overlap_comm=True)

    def request():
        return PipelineRequest(script=str(script), model=str(zoo["tiny-llama"]), cwd=str(tmp_path),
                               launch_flags={"use_deepspeed": True, "deepspeed_config_file": "ds.json", "num_processes": 2,
                                             "mixed_precision": "no"})

    layout = estimate_options(request(), launch_options(request()))
    assert (layout.strategy, layout.reduce_bucket_size, layout.overlap_comm) == ("zero1", 123456, True)
    assert (layout.prefetch_bucket_size, layout.max_live_parameters, layout.max_reuse_distance) == (None, None, None)
    key = next(step.key for step in build_graph(request()).steps if step.name == "memory")
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 654321}}))
    key2 = next(step.key for step in build_graph(request()).steps if step.name == "memory")
    assert key2 != key
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 654321,
                                                    "stage3_prefetch_bucket_size": 777, "stage3_max_reuse_distance": 5}}))
    layout = estimate_options(request(), launch_options(request()))
    assert (layout.strategy, layout.prefetch_bucket_size, layout.max_reuse_distance) == ("zero3", 777, 5)
    assert next(step.key for step in build_graph(request()).steps if step.name == "memory") not in (key, key2)
