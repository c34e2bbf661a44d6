"""tools/: the scripts that measure the project, run small."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "tests" / "fixtures" / "s2-tiny" / "checkpoint"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_bench_load_run_reports_sane_figures(capsys):
    bench = load_tool("serving_bench")
    got = bench.main(["--checkpoint", str(CHECKPOINT), "--device", "cpu", "--load", "4", "--rate", "50",
                      "--slots", "2", "--frames", "6"])
    assert got["requests"] == 4
    assert got["frames_per_s"] > 0 and 0 < got["request_min"] <= got["request_max"]
    assert 0 < got["ttfa_p50_ms"] <= got["ttfa_p95_ms"]
    line = capsys.readouterr().out.splitlines()[-1]
    figures = dict(re.findall(r"(\w+)=(\S+)", line))
    assert line.startswith("bench load=4 ") and figures["slots"] == "2" and figures["rate"] == "50"
    assert float(figures["frames_per_s"]) > 0
    assert float(figures["ttfa_p95_ms"]) >= float(figures["ttfa_p50_ms"]) > 0
