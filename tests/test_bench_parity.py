"""`--device auto|npu|cuda|xpu|mps|cpu` (common.pick_device) and `python bench.py parity`: CPU bf16 / fp16 vs
CPU fp32 pass bench.PARITY_LIMITS at the tiny sizes, a device that gets one layer wrong fails them."""
import argparse
import re
import sys
import types

import pytest
import torch
import torch.nn as nn

import bench
import common
from conftest import CKPT

TINY = ["parity", "--device", "cpu", "--config", "tiny", "--frames", "4", "--seconds", "1"]
ERROR = r"mean relative error ([\d.]+) %"


def fake_machine(monkeypatch, kinds: set):
    """A machine with the device kinds in `kinds` (and a CPU): npu as torch_npu would add it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: "cuda" in kinds)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if "cuda" in kinds else 0)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: "xpu" in kinds)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: "mps" in kinds)
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu") if "npu" in kinds else None)
    monkeypatch.setattr(torch, "npu", npu, raising=False)


@pytest.mark.parametrize("kinds, first", [({"npu", "cuda", "xpu", "mps"}, "npu"),
                                          ({"cuda", "xpu", "mps"}, "cuda"), ({"xpu", "mps"}, "xpu"),
                                          ({"mps"}, "mps"), (set(), "cpu")])
def test_auto_picks_the_first_of_npu_cuda_xpu_mps_cpu(monkeypatch, kinds, first):
    fake_machine(monkeypatch, kinds)
    assert common.first_available() == first
    if first != "npu":  # torch.device("npu") needs the real torch_npu's registration
        assert common.pick_device("auto") == common.pick_device(None) == torch.device(first)


def test_an_unavailable_device_is_one_line(monkeypatch, capsys):
    fake_machine(monkeypatch, {"cuda"})
    assert common.pick_device("cuda:1") == torch.device("cuda", 1)
    for name, message in [("xpu", "--device xpu: no xpu device on this machine"),
                          ("npu:0", "--device npu:0: no npu device on this machine"),
                          ("mps", "--device mps: no mps device on this machine"),
                          ("cuda:2", "--device cuda:2: this machine has 2 CUDA devices")]:
        with pytest.raises(common.UserError) as error:
            common.pick_device(name)
        assert str(error.value) == message
    with pytest.raises(SystemExit) as end:
        common.cli(bench.main, TINY[:1] + ["--device", "xpu"])
    assert end.value.code == 2
    assert capsys.readouterr().err == "error: --device xpu: no xpu device on this machine\n"


def test_device_flag_takes_every_kind_and_defaults_to_auto(capsys):
    for name in ("auto", "cpu", "mps", "cuda", "cuda:1", "npu", "npu:3", "xpu", "xpu:0"):
        assert common.device_name(name) == name
    for name in ("gpu", "tpu", "cuda:", "mps:1", "auto:0"):
        with pytest.raises(SystemExit):
            bench.main(["parity", "--device", name])
        assert "use auto, cuda, cuda:N, npu, xpu, mps or cpu" in capsys.readouterr().err


def parity_lines(capsys, argv) -> list:
    bench.main(argv)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cpu_half_vs_fp32_passes_the_limits_for_both_models_and_the_codec(capsys, dtype):
    lines = parity_lines(capsys, TINY + ["--dtype", dtype])
    assert lines[-1] == f"parity passed on cpu {dtype}: every figure within PARITY_LIMITS (docs/gpu.md)"
    figures = lines[1:-1]
    assert [line.split(" (")[0].split(":")[0] for line in figures] == [
        "s2 tiny slow logits", "s2 tiny fast logits", "s2 tiny greedy codes", "omnivoice tiny logits",
        "omnivoice tiny unmasked tokens", "codec tiny decode of 4 frames"]
    limit = bench.PARITY_LIMITS[dtype]["rel_error"]
    errors = [float(re.search(ERROR, line)[1]) / 100 for line in figures if "logits" in line]
    # the copy really ran in half precision (an error > 0) and fp16's 3 more mantissa bits show
    assert all(0 < e < (0.002 if dtype == "fp16" else 0.02) < limit for e in errors), errors
    decode = float(re.search(r"relative RMS error ([\d.]+) %", figures[-1])[1]) / 100
    assert 0 < decode < (0.003 if dtype == "fp16" else 0.02) < bench.PARITY_LIMITS[dtype]["decode_error"]
    assert "of 4 frames x 11 tokens equal" in figures[2] and "over the 32 steps" in figures[4]


def broken_copy(model: nn.Module, device, dtype) -> nn.Module:
    """A device that gets one layer 50 % wrong: the last weight matrix of S2's and OmniVoice's last
    transformer block (its MLP's output), of the codec's decoder (its last convolution)."""
    moved = REAL_COPY(model, device, dtype)
    layer = moved.layers[-1] if hasattr(moved, "layers") else moved.decoder
    [p for name, p in layer.named_parameters() if name.endswith("weight") and p.dim() >= 2][-1].mul_(1.5)
    return moved


REAL_COPY = bench.parity_copy


def test_a_device_with_one_layer_wrong_fails_naming_the_figures(monkeypatch, capsys):
    monkeypatch.setattr(bench, "parity_copy", broken_copy)
    with pytest.raises(SystemExit) as end:
        bench.main(TINY + ["--dtype", "bf16"])
    assert end.value.code == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("parity FAILED on cpu bf16: ")
    failed = [re.sub(r" [\d.e-]+ [<>] [\d.e-]+$", "", part) for part in last.split(": ", 1)[1].split("; ")]
    assert {"s2 slow logits rel_error", "s2 fast logits rel_error", "omnivoice logits rel_error",
            "omnivoice logits cosine", "codec decode_error"} <= set(failed), failed


def test_a_checkpoint_is_one_models(capsys):
    lines = parity_lines(capsys, TINY + ["--dtype", "fp16", "--model", "codec", "--checkpoint", str(CKPT)])
    assert lines[1].startswith("codec checkpoint decode of 4 frames: relative RMS error ")
    assert lines[-1].startswith("parity passed on cpu fp16")
    with pytest.raises(common.UserError, match="--checkpoint is one model's folder: give --model s2,"):
        bench.main(TINY + ["--checkpoint", str(CKPT)])


def test_a_figure_fails_only_past_its_limit():
    limits = bench.PARITY_LIMITS["bf16"]
    at_the_limits = {"s2 slow logits": dict(rel_error=0.05, mse=9.0, max_diff=9.0, cosine=0.995, top1=0.8,
                                            top5=0.8, positions=3), "codec": dict(decode_error=0.05)}
    assert bench.parity_failures(at_the_limits, limits) == []
    past = {"s2": dict(codes=0.49), "omnivoice": dict(unmasked=0.7), "codec": dict(decode_error=0.0501)}
    assert bench.parity_failures(past, limits) == ["s2 codes 0.49 < 0.5", "omnivoice unmasked 0.7 < 0.8",
                                                   "codec decode_error 0.0501 > 0.05"]


def test_the_same_dtype_on_the_same_device_agrees_exactly(capsys):
    """The figures line up the same positions, frames and steps on both sides: fp32 vs fp32 is exact."""
    args = argparse.Namespace(config="tiny", checkpoint=None, frames=4, seconds=1.0, seed=0)
    cpu = torch.device("cpu")
    figures = {}
    for check in (bench.s2_parity, bench.omnivoice_parity, bench.codec_parity):
        figures.update(check(args, cpu, torch.float32))
    assert figures.pop("s2") == dict(codes=1.0) and figures.pop("omnivoice") == dict(unmasked=1.0)
    assert figures.pop("codec") == dict(decode_error=0.0)
    for f in figures.values():
        assert (f["rel_error"], f["max_diff"], f["top1"], f["top5"]) == (0.0, 0.0, 1.0, 1.0)
        assert f["cosine"] == pytest.approx(1.0, abs=1e-6)
