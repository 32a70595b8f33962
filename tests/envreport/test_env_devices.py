"""Accelerator detection and the report on a machine that pretends to have two GPUs."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from prefect_accelerate.config.defaults import build_default_config
from prefect_accelerate.envreport.devices import detect_accelerator, device_line
from prefect_accelerate.envreport.probe import collect_env_report
from prefect_accelerate.envreport.render import render_text

GIB = 1024**3
NAMES = ("NVIDIA Fake A100-SXM4-80GB", "NVIDIA Fake A100-SXM4-40GB")
MEMORY = (80 * GIB, 40 * GIB)


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda answers as on a host with two (different) GPUs; nothing touches a real device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index=0: SimpleNamespace(name=NAMES[index], total_memory=MEMORY[index])
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: NAMES[0 if device is None else int(device)])


def test_cpu_machine_is_detected_as_having_no_accelerator():
    info = detect_accelerator()
    assert info.kind is None and info.count == 0 and info.label == "N/A"
    assert device_line(info) is None


def test_two_gpus_are_detected_with_names_and_memory(two_gpus):
    info = detect_accelerator()
    assert info.kind == "cuda" and info.label == "CUDA" and info.count == 2
    assert [(d.index, d.name, d.total_memory) for d in info.devices] == [(0, NAMES[0], MEMORY[0]), (1, NAMES[1], MEMORY[1])]
    assert device_line(info) == ("GPU type", NAMES[0])


def test_report_and_text_list_every_gpu(two_gpus):
    report = collect_env_report(check_imports=False)
    assert report.accelerator == "CUDA" and report.accelerator_count == 2
    assert report.device_line == ("GPU type", NAMES[0])
    assert [(d.kind, d.name, d.total_memory_gb) for d in report.accelerators] == [("cuda", NAMES[0], 80.0), ("cuda", NAMES[1], 40.0)]
    lines = render_text(report).splitlines()
    ram = next(i for i, line in enumerate(lines) if line.startswith("- System RAM:"))
    assert lines[ram + 1] == f"- GPU type: {NAMES[0]}"
    assert f"- Accelerator cuda:0: {NAMES[0]}, 80.00 GB" in lines
    assert f"- Accelerator cuda:1: {NAMES[1]}, 40.00 GB" in lines


def test_device_lines_match_accelerate_env_on_the_same_fake_gpus(two_gpus, capsys):
    pytest.importorskip("accelerate")
    from accelerate.commands.env import env_command

    capsys.readouterr()
    env_command(argparse.Namespace(config_file=None))
    theirs = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("- PyTorch accelerator", "- GPU type"))]
    ours = [line for line in render_text(collect_env_report(check_imports=False)).splitlines() if line.startswith(("- PyTorch accelerator", "- GPU type"))]
    assert ours == theirs == ["- PyTorch accelerator: CUDA", f"- GPU type: {NAMES[0]}"]


def test_default_config_for_two_gpus_is_multi_gpu_with_two_processes(two_gpus):
    config = build_default_config()
    assert config.to_dict()["distributed_type"] == "MULTI_GPU"
    assert config.num_processes == 2 and config.use_cpu is False


def test_mps_is_reported_with_the_chip_line(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    report = collect_env_report(check_imports=False)
    assert report.accelerator == "MPS"
    assert report.device_line is not None and report.device_line[0] == "MPS type" and report.device_line[1]


@pytest.mark.parametrize("kind,key,distributed_type", [("xpu", "XPU type", "MULTI_XPU"), ("npu", "CANN version", "MULTI_NPU"),
                                                       ("mlu", "MLU type", "MULTI_MLU")])
def test_other_accelerators_are_detected_reported_and_configured(monkeypatch, kind, key, distributed_type):
    """Two fake devices of each non-CUDA kind (their torch plug-in packages cannot be installed here)."""
    from prefect_accelerate.envreport import devices

    names = (f"Fake {kind.upper()} 0", f"Fake {kind.upper()} 1")
    fake = SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                           get_device_properties=lambda index=0: SimpleNamespace(name=names[index], total_memory=32 * GIB))
    monkeypatch.setattr(devices, "_PLUGINS", {})  # no torch_npu / torch_mlu import needed for the fake
    monkeypatch.setattr(torch, kind, fake, raising=False)
    monkeypatch.setattr(torch.version, "cann", "8.0.RC1", raising=False)
    info = detect_accelerator()
    assert info.kind == kind and [d.name for d in info.devices] == list(names) and info.devices[1].total_memory == 32 * GIB
    assert device_line(info) == (key, "8.0.RC1" if kind == "npu" else names[0])
    config = build_default_config()
    assert config.to_dict()["distributed_type"] == distributed_type and config.num_processes == 2


def test_cuda_cudnn_and_nccl_versions_are_reported_as_a_cuda_build_gives_them(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90300)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    report = collect_env_report(check_imports=False)
    assert (report.cuda_version, report.cudnn_version, report.nccl_version) == ("12.8", "90300", "2.27.3")
    text = render_text(report)
    assert "- NCCL version: 2.27.3" in text and "- CUDA version: 12.8" in text and "- cuDNN version: 90300" in text
