"""common.py: the helpers every model shares."""
import os
import stat
import subprocess
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import common
from common import write_atomic
from conftest import ROOT, MatmulDtypes

# the repository's modules
FILES = ("common", "codec", "dualAR", "bench", "omnivoice", "omnivoice_codec", "app", "train_lora")


def imported_with(module: str) -> set:
    """The other repository modules that `import module` brings in, in a fresh process."""
    script = f"import sys, {module}; print(*(m for m in {FILES!r} if m in sys.modules and m != {module!r}))"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return set(run.stdout.split())


def test_imports_point_one_way_common_below_the_models_and_no_model_below_its_benchmark():
    assert imported_with("common") == set()  # no model: a model file is copied with common.py alone
    assert imported_with("codec") == {"common"}  # not dualAR.py: the codec stands alone
    assert imported_with("dualAR") == {"common", "codec"}  # bench.py is imported only to run a benchmark
    assert imported_with("omnivoice_codec") == {"common"}
    assert imported_with("omnivoice") == {"common", "omnivoice_codec"}  # copying OmniVoice drags in no S2


def test_a_file_written_atomically_gets_the_usual_permissions_not_safetensors_owner_only(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "x.safetensors", lambda tmp: save_file({"x": torch.zeros(1)}, str(tmp)))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o644  # safetensors makes 0o600


def test_few_rows_linear_runs_onednn_on_a_batch_of_rows_and_torch_elsewhere(monkeypatch):
    """A FewRowsLinear keeps nn.Linear's parameters; at 4-64 rows of eager fp32 inference it multiplies by its
    weight prepacked once (within 1e-5 of F.linear), made again when the weight changes in place; 1-3 rows,
    65 rows and a call that records gradients are F.linear's own."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40)
    common.use_few_rows_linears(layer)
    assert type(layer) is common.FewRowsLinear and list(layer.state_dict()) == ["weight", "bias"]
    calls, packed_matmul = [], common.packed_matmul
    monkeypatch.setattr(common, "packed_matmul", lambda x, *a: calls.append(len(x)) or packed_matmul(x, *a))
    with torch.inference_mode():
        for rows in (1, 3, 4, 16, 64, 65):
            x = torch.rand(rows, 1, 48)
            y, want = layer(x), F.linear(x, layer.weight, layer.bias)
            assert torch.equal(y, want) if rows not in (4, 16, 64) else torch.allclose(y, want, atol=1e-5)
        assert calls == [4, 16, 64]
        first = layer.weight.prepacked[1]
        layer(x[:4])
        assert layer.weight.prepacked[1] is first  # made once
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        assert torch.allclose(layer(x[:4]), F.linear(x[:4], layer.weight, layer.bias), atol=1e-5)
    y = layer(torch.rand(4, 1, 48))  # gradients recorded: nn.Linear's matmul
    assert y.requires_grad and calls == [4, 16, 64, 4, 4]


def test_few_rows_linears_are_taken_only_where_their_copies_fit_in_half_the_available_memory(monkeypatch):
    layers = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    size = (64 * 32 + 32 * 16) * 4  # fp32 weights
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 2 * size - 1)
    common.use_few_rows_linears(layers)
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 2 * size)
    common.use_few_rows_linears(layers)
    assert [type(m) for m in layers] == [common.FewRowsLinear, torch.nn.ReLU, common.FewRowsLinear]


def test_half_linears_run_many_rows_in_fp32_where_the_cpu_has_no_half_matmul_units(monkeypatch):
    """fp16 / bf16 on a CPU without matrix units for them (an AVX2 one): torch's many-row half matmuls are
    4-5x slower than fp32, so from MANY_ROWS rows on a HalfLinear multiplies the upcast weight in fp32 (the
    output rounded back); fewer rows stay in half precision (half the bytes to read). With the units, or in
    fp32, the linears stay nn.Linear."""
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for units in (True, False):
            monkeypatch.setitem(common.HALF_UNITS, dtype, units)
            layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
            layers, plain = layers.to(dtype), torch.nn.Linear(48, 8)
            common.use_half_linears(layers), common.use_half_linears(plain)
            kind = torch.nn.Linear if units else common.HalfLinear
            assert [type(m) for m in layers] == [kind, torch.nn.ReLU, kind] and type(plain) is torch.nn.Linear
        layer = layers[0]
        for shape, wide in (((common.MANY_ROWS - 1, 48), False), ((common.MANY_ROWS, 48), True),
                            ((2, 20, 48), True), ((1, 4, 48), False)):
            x = torch.rand(shape).to(dtype)
            with MatmulDtypes() as seen:
                y = layer(x)
            assert seen.dtypes == [torch.float32 if wide else dtype] and y.dtype == dtype, shape
            want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype) if wide else \
                F.linear(x, layer.weight, layer.bias)
            assert torch.equal(y, want)


def test_int8_weights_of_a_whole_sequence_multiply_in_bf16_or_fp32_as_the_cpu_has_units(monkeypatch):
    """QuantLinear(matmul_rows): from that many rows the int8 weight is converted (exactly) for one plain
    matmul, in bf16 where the CPU has bf16 matrix units, else in fp32 (bf16 there is 4-5x slower than fp32);
    the scales multiply its output. Fewer rows take torch's int8 kernel."""
    torch.manual_seed(0)
    layer = common.QuantLinear(torch.nn.Linear(64, 24, bias=False), 8, matmul_rows=8)
    x = torch.rand(2, 8, 64)
    dequantized = layer.weight.float() * layer.scales.float()[:, None]
    for units, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setitem(common.HALF_UNITS, torch.bfloat16, units)
        with MatmulDtypes() as seen:
            y = layer(x)
        assert seen.dtypes == [dtype] and y.dtype == x.dtype
        assert torch.allclose(y, F.linear(x.bfloat16().float(), dequantized), rtol=0.01, atol=0.01)
        if dtype == torch.float32:  # the int8 values and bf16 inputs exactly, summed in fp32
            want = F.linear(x.bfloat16().float(), layer.weight.float()) * layer.scales
            assert torch.equal(y, want.view(2, 8, 24))
    with MatmulDtypes() as seen:
        layer(x[:, :3])
    assert seen.dtypes == []  # 6 rows: aten's int8 kernel, no mm


def test_compiled_few_rows_linears_run_one_packed_copy_where_the_cpu_rule_says(monkeypatch):
    """In a compiled graph a FewRowsLinear at 4-64 rows runs oneDNN's prepacked matmul as one opaque op where
    COMPILED_FEW_ROWS (AVX2-only CPUs): within 1e-5 of F.linear, the copy made at the first call and found
    on the weight by every later one. Elsewhere the graph keeps F.linear: no copy made."""
    torch.manual_seed(0)
    packs, prepack = [], common.prepack
    monkeypatch.setattr(common, "prepack", lambda w: packs.append(tuple(w.shape)) or prepack(w))
    for rule in (True, False):
        torch._dynamo.reset()
        monkeypatch.setattr(common, "COMPILED_FEW_ROWS", rule)
        layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
        common.use_few_rows_linears(layers)
        step, x = torch.compile(layers, fullgraph=True), torch.rand(4, 48)
        with torch.inference_mode():
            hidden = F.silu(F.linear(x, layers[0].weight, layers[0].bias))
            want = F.linear(hidden, layers[2].weight, layers[2].bias)
            for _ in range(3):
                assert torch.allclose(step(x), want, atol=1e-5)
        assert packs == ([(40, 48), (8, 40)] if rule else [])
        assert all(hasattr(m.weight, "prepacked") == rule for m in layers[::2])
        packs.clear()
