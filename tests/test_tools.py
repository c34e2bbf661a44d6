"""tools/: the scripts that measure the project, run small."""
import importlib.util
import re

from conftest import CKPT, ROOT


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_bench_load_run_reports_sane_figures(capsys):
    bench = load_tool("serving_bench")
    got = bench.main(["--checkpoint", str(CKPT), "--device", "cpu", "--load", "4", "--rate", "50",
                      "--slots", "2", "--frames", "6"])
    assert got["requests"] == 4
    # 4 requests of 5 frames (the 6th is dropped) arriving over 3 / 50 s: the run lasts at least that, and
    # each request, made within the run, goes at least at a quarter of the whole run's rate
    assert 0 < got["frames_per_s"] <= 4 * 5 / (3 / 50)
    assert got["frames_per_s"] / 4 * (1 - 1e-9) <= got["request_min"] <= got["request_max"]
    assert 0 < got["ttfa_p50_ms"] <= got["ttfa_p95_ms"]
    line = capsys.readouterr().out.splitlines()[-1]
    figures = dict(re.findall(r"(\w+)=(\S+)", line))
    assert line.startswith("bench load=4 ") and figures["slots"] == "2" and figures["rate"] == "50"
    assert figures["frames_per_s"] == f"{got['frames_per_s']:.1f}"  # the line says what main returned
    assert figures["request_frames_per_s_min"] == f"{got['request_min']:.1f}"
    assert figures["ttfa_p50_ms"] == f"{got['ttfa_p50_ms']:.0f}"
    assert figures["ttfa_p95_ms"] == f"{got['ttfa_p95_ms']:.0f}"
