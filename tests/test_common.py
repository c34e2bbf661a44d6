"""common.py: the helpers every model shares."""
import collections
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
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


STEPS = [[0, False], [4, True], [65, False]]  # a machine where oneDNN wins at 4-64 rows (an Intel Xeon's)
FEW_ROWS_STEPS = common.few_rows_steps  # as imported: conftest's session fixture replaces it for every test
ONE_ROW_WINS = common.compiled_one_row_wins  # the same
MANY_ROWS_MATMUL = common.many_rows_matmul  # the same
MKL_PACK = common.mkl_pack
FROZEN_ROWS_STEPS = common.frozen_rows_steps  # the same


def test_few_rows_linear_runs_onednn_at_the_rows_its_steps_take_and_torch_elsewhere(monkeypatch):
    """A FewRowsLinear keeps nn.Linear's parameters; at the row counts its steps take (here 4-64) eager fp32
    inference multiplies by its weight prepacked once (within 1e-5 of F.linear), made again when the weight
    changes in place; other row counts and a call that records gradients are F.linear's own."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40)
    common.use_few_rows_linears(layer, STEPS)
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


def test_few_rows_linears_are_taken_only_where_some_rows_win_and_the_copies_fit_in_half_the_memory(
        monkeypatch):
    layers = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    size = (64 * 32 + 32 * 16) * 4  # fp32 weights
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 2 * size - 1)
    common.use_few_rows_linears(layers, STEPS)
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 2 * size)
    common.use_few_rows_linears(layers, [[0, False]])  # a machine where torch's own always wins
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    common.use_few_rows_linears(layers.to(torch.bfloat16), STEPS)  # oneDNN's fp32 matmuls only
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    common.use_few_rows_linears(layers.float(), STEPS)
    assert [type(m) for m in layers] == [common.FewRowsLinear, torch.nn.ReLU, common.FewRowsLinear]
    assert layers[0].steps == STEPS


def test_the_machines_row_steps_are_timed_once_and_kept_in_the_compile_cache(tmp_path, monkeypatch):
    """few_rows_steps: timed on this machine's first call, then read from the compile cache's file beside
    other machines' (a next process alike); an unreadable file or an odd value is timed again, never a
    crash. use_few_rows_linears takes the machine's steps by default."""
    monkeypatch.setattr(common, "few_rows_steps", FEW_ROWS_STEPS)
    monkeypatch.setattr(common, "use_compile_cache", lambda: tmp_path)
    timed, steps = [], [[0, True], [8, False]]
    monkeypatch.setattr(common, "timed_row_steps", lambda: timed.append(1) or steps)
    path, machine = tmp_path / common.ROWS_FILE, common.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({"another machine": [[0, False]]}))
    assert common.few_rows_steps() == steps and common.few_rows_steps() == steps and timed == [1]
    assert json.loads(path.read_text()) == {"another machine": [[0, False]], machine: steps}
    for odd in ("{not json", json.dumps({machine: [[0, True]]}), json.dumps({machine: [[1, False]]}),
                json.dumps({machine: [[0, 1]]}), json.dumps([steps])):
        path.write_text(odd)
        assert common.few_rows_steps() == steps
    assert len(timed) == 6 and json.loads(path.read_text()) == {machine: steps}
    layer = torch.nn.Linear(8, 4)
    common.use_few_rows_linears(layer)
    assert type(layer) is common.FewRowsLinear and layer.steps == steps and len(timed) == 6


def test_row_steps_give_each_timed_row_count_its_choice_and_torch_above_them():
    assert common.row_steps({1: True, 2: True, 4: False, 8: True, 16: True}) == [
        [0, True], [4, False], [8, True], [17, False]]
    assert common.row_steps({1: False, 64: False}) == [[0, False]]
    steps = common.row_steps({1: False, 4: True, 64: True})
    assert [common.step_at(steps, rows) for rows in (0, 1, 3, 4, 64, 65, 999)] == [
        False, False, False, True, True, False, False]
    assert all(common.is_row_steps(s) for s in (steps, [[0, False]]))
    assert not any(common.is_row_steps(s) for s in ([[0, True]], [], [[0, False], [0, False]], True))


def test_timed_row_steps_time_both_matmuls_at_every_probed_row_count(monkeypatch):
    """Each probe times F.linear and the prepacked matmul on the same weights, a warm-up round first: where
    the prepacked one is no slower it is taken (a fake clock makes it win at 2 rows only)."""
    monkeypatch.setattr(common, "PROBE_SHAPES", ((24, 16), (16, 24)))
    monkeypatch.setattr(common, "ROW_PROBES", (1, 2, 4))
    seen, now = [], [0.0]

    def timed(kind, matmul):
        def run(x, w, *rest):
            seen.append((kind, len(x)))
            now[0] += (1.0 if len(x) == 2 else 2.0) if kind == "packed" else 1.5
            return matmul(x, w, *rest)
        return run

    monkeypatch.setattr(common.F, "linear", timed("torch", F.linear))
    monkeypatch.setattr(common, "packed_matmul", timed("packed", common.packed_matmul))
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    assert common.timed_row_steps(repeats=2) == [[0, False], [2, True], [4, False]]  # 3 rows: as 2
    for rows in (1, 2, 4):
        for kind in ("torch", "packed"):  # a warm-up and 2 repeats, of 2 shapes PROBE_LAYERS times
            assert seen.count((kind, rows)) == 3 * 2 * common.PROBE_LAYERS


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


def test_quantized_linears_whose_shape_torchs_kernels_cannot_take_still_multiply_right():
    """torch's int8 kernel needs inputs in whole 16s and the int4 one outputs in whole 16s (else a crash or
    garbage): an int8 layer of 40 inputs converts its weight for a plain matmul at every row count, an int4
    layer of 40 outputs becomes int8; both within int8's error of the float layer, as the kernels' shapes."""
    torch.manual_seed(0)
    cases = (((40, 24), 8, 8), ((64, 40), 4, 8), ((64, 48), 4, 4), ((48, 8), 8, 8))  # (inputs, outputs)
    for (inputs, outputs), bits, kept in cases:
        linear = torch.nn.Linear(inputs, outputs)
        layer = common.QuantLinear(linear, bits)
        assert layer.bits == kept and layer.kernel == (inputs % 16 == 0 or kept == 4)
        for rows in (1, 3):
            x = torch.rand(rows, inputs)
            with torch.inference_mode():
                want = linear(x)
                with MatmulDtypes() as seen:
                    y = layer(x)
            assert len(seen.dtypes) == (0 if layer.kernel else 1), (inputs, outputs, bits)
            bound = 0.1 if kept == 4 else 0.02  # of the output's largest value
            assert (y - want).abs().max() <= bound * want.abs().max(), (inputs, outputs, bits, rows)


def test_w8a8_rounds_weights_and_each_input_row_to_int8_and_sums_their_products_exactly():
    """W8A8Linear: int8 weights (a scale per output row), each input row rounded to int8 with its own scale
    (its largest |x| -> 127), the int8 products summed in int32 (exact), then both scales: bit for bit that
    arithmetic, within 2 % of the float layer, at any shape (here 40 inputs, 24 outputs) and row count; a
    row of zeros (padding) gives the bias, not NaN."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 24)
    layer = common.W8A8Linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (24, 40)
    assert layer.weight.abs().amax(1).eq(127).all()  # each row's largest weight takes the whole range
    for shape in ((1, 40), (3, 40), (2, 5, 40)):
        x = torch.rand(shape) - 0.5
        padded = x.numel() > 40
        if padded:
            x.view(-1, 40)[-1] = 0
        with torch.inference_mode():
            y, want = layer(x), linear(x)
        x2 = x.reshape(-1, 40)
        x_scale = x2.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(x2 / x_scale)
        assert xq[0].abs().max() == 127 and torch.equal(xq, xq.clamp(-127, 127))
        sums = (xq.double() @ layer.weight.double().t()).float()  # exact: |sums| < 2^24
        exact = (sums * x_scale * layer.scales + linear.bias).view(*shape[:-1], 24)
        assert y.shape == want.shape and torch.equal(y, exact.detach()), shape
        assert (y - want).abs().max() <= 0.02 * want.abs().max(), shape
        if padded:
            assert torch.equal(y.reshape(-1, 24)[-1], linear.bias.detach())
    with pytest.raises(common.UserError, match="w8a8: a linear layer of 133200 inputs is over int32's sums"):
        common.W8A8Linear(torch.nn.Linear(133_200, 1))


@pytest.mark.parametrize("int8_units", [True, False])
def test_int8_products_are_torchs_int_mm_bit_for_bit_with_or_without_int8_units(monkeypatch, int8_units):
    """common.int_mm: torch._int_mm where the CPU has int8 dot products, else fp32 matmuls of EXACT_TERMS
    inputs at a time (exact integer sums) added in int32: the same int32 sums either way. The second
    pair of inputs sums to an odd integer above 2^24 (2000 products of 127 x 127, 999 of 127 x 1), which
    no fp32 value holds: one fp32 matmul over all 3000 inputs rounds, in whatever order it adds."""
    monkeypatch.setattr(common, "INT8_UNITS", int8_units)
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (5, 3000), dtype=torch.int8)
    b = torch.randint(-127, 128, (3000, 7), dtype=torch.int8)
    big_a = torch.full((1, 3000), 127, dtype=torch.int8)
    big_b = torch.cat([torch.full((2000, 2), 127), torch.ones(999, 2), torch.zeros(1, 2)]).to(torch.int8)
    for x, w in ((a, b), (big_a, big_b)):
        want = (x.long() @ w.long()).int()
        assert torch.equal(torch._int_mm(x, w), want) and torch.equal(common.int_mm(x, w), want)
    assert want[0, 0] % 2 == 1 and want[0, 0] > 2 ** 24
    assert (big_a.float() @ big_b.float()).double().ne(want.double()).all()  # one fp32 sum rounds: chunks


def test_compiled_few_rows_linears_run_one_packed_copy_at_the_rows_their_compiled_steps_take(monkeypatch):
    """In a compiled graph a FewRowsLinear runs oneDNN's prepacked matmul as one opaque op where its steps
    take the rows and either the CPU is AVX2-only or the steps take one row too (MKL loses there even at one
    row): within 1e-5 of F.linear, the copy made at the first call and found on the weight by every later
    one. Elsewhere (an AVX-512 Xeon's steps: from 4 rows) the graph keeps F.linear: no copy made."""
    torch.manual_seed(0)
    packs, prepack = [], common.prepack
    monkeypatch.setattr(common, "prepack", lambda w: packs.append(tuple(w.shape)) or prepack(w))
    cases = ((STEPS, True, True), (STEPS, False, False), ([[0, True], [65, False]], False, True),
             ([[0, True], [4, False]], True, False))  # the last: 4 rows not taken
    for steps, avx2, taken in cases:
        torch._dynamo.reset()
        monkeypatch.setattr(common, "AVX2_ONLY", avx2)
        layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
        common.use_few_rows_linears(layers, steps)
        step, x = torch.compile(layers, fullgraph=True), torch.rand(4, 48)
        with torch.inference_mode():
            hidden = F.silu(F.linear(x, layers[0].weight, layers[0].bias))
            want = F.linear(hidden, layers[2].weight, layers[2].bias)
            for _ in range(3):
                assert torch.allclose(step(x), want, atol=1e-5)
        assert packs == ([(40, 48), (8, 40)] if taken else []), (steps, avx2)
        assert all(hasattr(m.weight, "prepacked") == taken for m in layers[::2])
        packs.clear()


def graph_calls(layers, x) -> list:
    """The functions a fullgraph compile of layers(x) calls, by name (the graph captured, run as it is)."""
    calls = []

    def backend(gm, example_inputs):
        calls.extend(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                     if n.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        y = torch.compile(layers, fullgraph=True, backend=backend)(x)
    return y, calls


def test_compiled_one_row_linears_are_a_product_and_a_sum_where_the_machine_takes_them():
    """Where this machine's timing took `one_row_linear` (use_one_row_sums), a compiled graph multiplies one
    row by each fp32 or int8 weight and sums: no matmul, no int8 kernel, within 1e-5 of the same arithmetic
    as a matmul (int8: the dequantized weight times the kernel's bf16 x); 4 rows, eager calls and a machine
    whose timing said no keep the matmuls, and only fp32 and int8 weights are touched."""

    def model():
        torch.manual_seed(0)
        int8 = common.QuantLinear(torch.nn.Linear(48, 8), bits=8)
        return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), int8)

    def reference(layers, x):
        hidden = F.silu(F.linear(x, layers[0].weight, layers[0].bias)).bfloat16().float()
        return F.linear(hidden, layers[2].weight.float()) * layers[2].scales.float() + layers[2].bias

    for wins in (True, False):
        layers = model()
        common.use_one_row_sums(layers, {torch.float32: wins, torch.int8: wins})
        assert [m.one_row for m in layers[::2]] == [wins, wins]
        assert type(layers[0]) is (common.FewRowsLinear if wins else torch.nn.Linear)
        for rows, x in ((1, torch.rand(1, 1, 32)), (4, torch.rand(4, 32))):
            with torch.inference_mode():
                want, eager = reference(layers, x), layers(x)
            y, calls = graph_calls(layers, x)
            summed = wins and rows == 1
            assert torch.allclose(y, want, atol=1e-5) if summed else torch.equal(y, eager)
            matmuls = (calls.count("linear"), calls.count("_weight_int8pack_mm"), calls.count("sum"))
            assert matmuls == ((0, 0, 2) if summed else (1, 1, 0)), calls
            with torch.inference_mode():
                assert torch.equal(layers(x), eager)  # eager: the matmuls
        assert not hasattr(layers[0].weight, "prepacked")
    int4 = common.QuantLinear(torch.nn.Linear(64, 16), bits=4)
    others = torch.nn.Sequential(torch.nn.Linear(8, 8).bfloat16(), int4)
    common.use_one_row_sums(others, {torch.float32: True, torch.int8: True})
    assert type(others[0]) is torch.nn.Linear and not hasattr(others[0], "one_row")
    assert others[1].bits == 4 and not others[1].one_row


FROZEN = [[0, False], [4, True], [8, False]]  # a Zen 4's frozen_rows_steps: 4-row graphs on frozen weights


def test_graphs_of_the_rows_frozen_steps_take_compile_on_frozen_weights_with_plain_linears(monkeypatch):
    """frozen_graphs compiles a graph for the row counts its steps take within frozen_gemms (freezing, the
    GEMM template), every other plainly; in those graphs a FewRowsLinear is F.linear (a matmul of a
    constant weight, which the template takes), even where its compiled steps take oneDNN's op."""
    monkeypatch.setattr(common, "AVX2_ONLY", True)  # compiled graphs take oneDNN's op at 4-64 rows
    layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
    common.use_few_rows_linears(layers, STEPS)
    common.use_frozen_gemms(layers, FROZEN)
    assert [m.frozen_steps for m in layers[::2]] == [FROZEN, FROZEN]
    compiled = []

    def backend(gm, example_inputs):
        calls = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
        rows = next(t.size(0) for t in example_inputs if t.shape[-1] == 48 and t.size(0) != 40)  # x
        compiled.append((rows, torch._inductor.config.freezing, calls))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(layers, fullgraph=True, dynamic=False, backend=backend)
    with torch.inference_mode():
        for rows in (1, 4, 8, 4):
            x = torch.rand(rows, 48)
            hidden = F.silu(F.linear(x, layers[0].weight, layers[0].bias))
            want = F.linear(hidden, layers[2].weight, layers[2].bias)
            assert torch.allclose(common.frozen_graphs(step, FROZEN, x), want, atol=1e-5)
    assert [(rows, freezing, calls.count("linear"), calls.count("packed_linear.default"))
            for rows, freezing, calls in compiled] == [(1, False, 2, 0), (4, True, 2, 0), (8, False, 0, 2)]
    assert torch._inductor.config.freezing is False  # patched only while compiling


def test_inductors_gemm_on_frozen_weights_multiplies_each_models_own_weights():
    """Within frozen_gemms inductor's GEMM template runs the 4-row linears (its packed copies of the
    weights): within 1e-5 of F.linear; and a second model of the same shapes, whose graph inductor may find
    in its caches, gets its own weights' result, not the copies packed for the first."""
    from torch._dynamo.utils import counters

    def model(seed):
        torch.manual_seed(seed)
        layers = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32))
        common.use_frozen_gemms(layers, FROZEN)
        return layers

    x = torch.rand(4, 64)
    torch._dynamo.reset()
    templated = counters["inductor"]["cpp_templated_kernel_counter"]
    for seed in (0, 1):
        layers = model(seed)
        with torch.inference_mode():
            want = layers(x)  # eager: F.linear
            got = common.frozen_graphs(torch.compile(layers, fullgraph=True, dynamic=False), FROZEN, x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert counters["inductor"]["cpp_templated_kernel_counter"] - templated == 4  # 2 linears, 2 models


def test_frozen_graphs_are_taken_only_for_cpu_fp32_unquantized_models_whose_copies_fit(monkeypatch):
    """frozen_rows: this machine's steps for a CPU fp32 model whose linear layers fit in an eighth of the
    memory available; none for a quantized or half-precision one, or where the copies would not fit."""
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 8 * (48 * 40 + 40 * 8) * 4)
    layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
    assert common.frozen_rows(layers) == FROZEN  # conftest's untimed steps
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 8 * (48 * 40 + 40 * 8) * 4 - 1)
    assert common.frozen_rows(layers) == [[0, False]]
    monkeypatch.setattr(common, "available_memory_bytes", lambda: 2 ** 40)
    int8 = torch.nn.Sequential(torch.nn.Linear(48, 40), common.QuantLinear(torch.nn.Linear(40, 8), bits=8))
    for module in (int8, torch.nn.Sequential(torch.nn.Linear(48, 40).half()), torch.nn.SiLU()):
        assert common.frozen_rows(module) == [[0, False]]


def test_the_frozen_rows_choice_is_timed_once_and_kept_beside_the_row_steps(tmp_path, monkeypatch):
    """frozen_rows_steps: timed on this machine's first call, then read from ROWS_FILE under its own key;
    a value that is not row steps is timed again."""
    monkeypatch.setattr(common, "frozen_rows_steps", FROZEN_ROWS_STEPS)
    monkeypatch.setattr(common, "use_compile_cache", lambda: tmp_path)
    timed = []
    monkeypatch.setattr(common, "timed_frozen_rows", lambda: timed.append(1) or FROZEN)
    assert common.frozen_rows_steps() == FROZEN and common.frozen_rows_steps() == FROZEN and timed == [1]
    key = f"{common.machine_key(torch.device('cpu'), torch.float32)} {common.FROZEN_KEY}"
    assert json.loads((tmp_path / common.ROWS_FILE).read_text()) == {key: FROZEN}
    (tmp_path / common.ROWS_FILE).write_text(json.dumps({key: True}))
    assert common.frozen_rows_steps() == FROZEN and timed == [1, 1]


def test_the_compiled_one_row_choice_is_timed_once_per_weight_dtype_and_kept_beside_the_row_steps(
        tmp_path, monkeypatch):
    """compiled_one_row_wins: timed on this machine's first call for a weight dtype and kept in ROWS_FILE
    under that dtype's key (the row steps' entry untouched); an odd value is timed again. use_one_row_sums
    asks it only for the dtypes the module has."""
    monkeypatch.setattr(common, "compiled_one_row_wins", ONE_ROW_WINS)
    monkeypatch.setattr(common, "use_compile_cache", lambda: tmp_path)
    timed = []
    monkeypatch.setattr(common, "timed_one_row", lambda dtype: timed.append(dtype) or dtype == torch.float32)
    path, machine = tmp_path / common.ROWS_FILE, common.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({machine: [[0, False]]}))
    common.use_one_row_sums(torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(8, 4).bfloat16()))
    assert timed == []
    layers = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    common.use_one_row_sums(layers)
    assert type(layers[0]) is common.FewRowsLinear and layers[1].one_row and timed == [torch.float32]
    int8 = common.QuantLinear(torch.nn.Linear(8, 4), bits=8)
    common.use_one_row_sums(torch.nn.Sequential(torch.nn.Linear(8, 4), int8))
    assert not int8.one_row and timed == [torch.float32, torch.int8]
    assert common.compiled_one_row_wins() is True and common.compiled_one_row_wins(torch.int8) is False
    fp32, int8 = (f"{common.machine_key(torch.device('cpu'), dtype)} {common.ONE_ROW_KEY}"
                  for dtype in (torch.float32, torch.int8))
    assert json.loads(path.read_text()) == {machine: [[0, False]], fp32: True, int8: False}
    path.write_text(json.dumps({fp32: "yes"}))
    assert common.compiled_one_row_wins() is True and timed == [torch.float32, torch.int8, torch.float32]


def test_the_many_rows_choice_is_timed_once_and_kept_beside_the_row_steps(tmp_path, monkeypatch):
    """many_rows_matmul (OmniVoice's flat row): timed on this machine's first call, then read from ROWS_FILE
    under its own key, the row steps' entry untouched; a value that names no matmul is timed again."""
    monkeypatch.setattr(common, "many_rows_matmul", MANY_ROWS_MATMUL)
    monkeypatch.setattr(common, "use_compile_cache", lambda: tmp_path)
    timed = []
    monkeypatch.setattr(common, "timed_many_rows", lambda: timed.append(1) or "mkl")
    path, machine = tmp_path / common.ROWS_FILE, common.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({machine: [[0, False]]}))
    assert common.many_rows_matmul() == "mkl" and common.many_rows_matmul() == "mkl" and timed == [1]
    key = f"{machine} {common.MANY_ROWS_KEY}"
    assert json.loads(path.read_text()) == {machine: [[0, False]], key: "mkl"}
    for odd in (True, "blas", [[0, True]]):  # an older file's bool included
        path.write_text(json.dumps({key: odd}))
        assert common.many_rows_matmul() == "mkl"
    assert timed == [1, 1, 1, 1]


@pytest.mark.skipif(not common.mkl_packs(), reason="this torch has no MKL (the choice never takes it there)")
def test_mkl_packed_matmul_gives_f_linear_at_any_row_count_and_packs_once(monkeypatch):
    """MKL's copy is packed for MANY_ROWS_PROBE rows; mkl_packed_matmul runs it at every row count (within
    fp32 rounding of F.linear: odd shapes, a bias, 3-D inputs), makes it once, and again where the weight
    changed in place."""
    torch.manual_seed(0)
    for out_features, in_features in ((40, 48), (8200, 64), (24, 3072)):
        layer = torch.nn.Linear(in_features, out_features)
        with torch.inference_mode():
            for rows in (1, 3, 7, 100, common.MANY_ROWS_PROBE, 446):
                x = torch.rand(2, rows, in_features) - 0.5
                want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
                assert torch.allclose(common.mkl_packed_matmul(x, layer.weight, layer.bias).double(), want,
                                      atol=1e-5 * in_features ** 0.5), (out_features, in_features, rows)
    first = layer.weight.mkl_prepacked[1]
    assert common.mkl_prepacked(layer.weight) is first  # made once
    with torch.no_grad():
        layer.weight.mul_(2)
    x = torch.rand(5, in_features)
    assert torch.allclose(common.mkl_packed_matmul(x, layer.weight, layer.bias),
                          F.linear(x, layer.weight, layer.bias), atol=1e-3)
    assert layer.weight.mkl_prepacked[1] is not first
    # the packed copy, not the weight, is what every row count multiplies: packed from twice the weight here
    monkeypatch.setattr(common, "mkl_pack", lambda w: MKL_PACK(2 * w))
    fresh = torch.nn.Linear(in_features, 8, bias=False)
    for rows in (1, 7, common.MANY_ROWS_PROBE + 1):
        x = torch.rand(rows, in_features)
        assert torch.allclose(common.mkl_packed_matmul(x, fresh.weight), 2 * F.linear(x, fresh.weight),
                              atol=1e-3), rows


@pytest.mark.skipif(not common.mkl_packs(), reason="this torch has no MKL (the choice never takes it there)")
def test_mkl_packs_any_rows_checks_the_products_at_other_row_counts(monkeypatch):
    """timed_many_rows may take MKL only where its copy packed for MANY_ROWS_PROBE rows gives F.linear's
    products at other row counts: true of this machine's MKL, false of one whose products are off there."""
    weights = [torch.rand(24, 16), torch.rand(16, 24)]
    assert common.mkl_packs_any_rows(weights)
    real = common.mkl_packed_matmul
    off = lambda x, w, b=None: real(x, w, b) * (1 if len(x) == common.MANY_ROWS_PROBE else 1.01)  # noqa: E731
    monkeypatch.setattr(common, "mkl_packed_matmul", off)
    assert not common.mkl_packs_any_rows(weights)


def test_timed_many_rows_takes_the_fastest_matmul_and_torchs_on_a_tie(monkeypatch):
    """F.linear, oneDNN's and MKL's packed matmuls on MANY_ROWS_PROBE rows of a layer's shapes, a warm-up
    round first: the fastest (a fake clock), torch's unless another is strictly faster; MKL's only where its
    packed copy gives F.linear's products at other row counts."""
    monkeypatch.setattr(common, "PROBE_SHAPES", ((24, 16), (16, 24)))
    monkeypatch.setattr(common, "MANY_ROWS_PROBE", 8)
    now, cost = [0.0], {}

    def costs(kind, fn):
        return lambda *args: now.__setitem__(0, now[0] + cost[kind]) or fn(*args)

    monkeypatch.setattr(common.F, "linear", costs("torch", F.linear))
    monkeypatch.setattr(common, "packed_matmul", costs("onednn", common.packed_matmul))
    monkeypatch.setattr(common, "mkl_packed_matmul", costs("mkl", common.mkl_packed_matmul))
    monkeypatch.setattr(common, "mkl_packs", lambda: True)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    cases = (((2, 1, 3), "onednn"), ((2, 3, 1), "mkl"), ((1, 2, 2), "torch"), ((1, 1, 1), "torch"),
             ((2, 1, 1), "onednn"))
    for (torch_cost, onednn, mkl), fastest in cases:
        cost.update(torch=torch_cost, onednn=onednn, mkl=mkl)
        assert common.timed_many_rows(repeats=2) == fastest, (torch_cost, onednn, mkl)
    monkeypatch.setattr(common, "mkl_packs_any_rows", lambda weights: False)
    assert common.timed_many_rows(repeats=2) == "onednn"  # (2, 1, 1): MKL's copy wrong elsewhere, not taken
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    prepacks = []
    monkeypatch.setattr(common, "prepack", lambda w: prepacks.append(w))
    assert common.timed_many_rows(repeats=2) == "torch" and prepacks == []  # a torch without oneDNN


def test_timed_one_row_takes_the_compiled_sum_only_where_it_beats_every_matmul(monkeypatch):
    """The compiled product and sum against F.linear and the prepacked matmul (fp32 weights) or aten's int8
    kernel (int8 ones) on the same one-row probes, a warm-up round first; the sum is taken only if faster
    than each of them (a fake clock; compile made a no-op so that nothing compiles here)."""
    monkeypatch.setattr(common, "PROBE_SHAPES", ((24, 16), (16, 24)))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    now, cost = [0.0], {}

    def timed(kind, fn):
        def run(*args, **kwargs):
            now[0] += cost[kind]
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(common, "one_row_linear", timed("sum", common.one_row_linear))
    monkeypatch.setattr(common.F, "linear", timed("torch", F.linear))
    monkeypatch.setattr(common, "packed_matmul", timed("packed", common.packed_matmul))
    int8_kernel = timed("int8", torch.ops.aten._weight_int8pack_mm)
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", int8_kernel)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    for sum_cost, torch_cost, packed_cost, wins in ((1, 2, 3, True), (2, 3, 1, False), (2, 1, 3, False),
                                                    (2, 2, 2, False)):
        cost.update(sum=sum_cost, torch=torch_cost, packed=packed_cost, int8=100)
        assert common.timed_one_row(torch.float32, repeats=2) is wins
    for sum_cost, int8_cost, wins in ((1, 2, True), (2, 1, False), (2, 2, False)):
        cost.update(sum=sum_cost, int8=int8_cost, torch=100, packed=100)
        assert common.timed_one_row(torch.int8, repeats=2) is wins



# ----------------------------------------------------------------------------- the engine thread
class Countdown(common.Job):
    """A job of `steps` steps; codes() waits for its end -> the steps it ran."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.ran = steps, 0

    def codes(self) -> int:
        with self.changed:
            self.changed.wait_for(lambda: self.done, timeout=30)
        if self.error:
            raise self.error
        return self.ran


class Rows:
    """Every verb common.EngineThread drives, and no model: `slots` rows; step() admits waiting jobs into free
    rows, runs one step of each, ends those that ran all theirs. Clear `go` to hold the steps."""

    def __init__(self, slots: int):
        self.slots, self.rows, self.waiting, self.closed = slots, [], collections.deque(), False
        self.go = threading.Event()
        self.go.set()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def running(self) -> int:
        return len(self.rows)

    def submit(self, job: Countdown) -> Countdown:
        if self.closed:
            raise common.EngineClosed("the engine was closed")
        self.waiting.append(job)  # one deque operation: atomic, as the step thread's popleft
        return job

    def step(self):
        self.go.wait(30)
        while self.waiting and len(self.rows) < self.slots:
            self.rows.append(self.waiting.popleft())
        for job in self.rows:
            job.ran += 1
        for job in [job for job in self.rows if job.ran == job.steps]:
            self.rows.remove(job)
            job.finish()

    def fail(self, error: Exception):
        jobs, self.rows = self.rows, []
        for job in jobs:
            job.finish(error)

    def close(self):
        self.closed = True
        for job in [*self.rows, *self.waiting]:
            job.finish(common.EngineClosed("the engine was closed"))
        self.rows, self.waiting = [], collections.deque()


def test_an_engine_thread_steps_any_scheduler_and_bounds_its_queue():
    """submit() starts the thread, which steps a job to its end; a free row and max_queue waiting jobs are
    taken, one more is refused (never a request's next part); close() stops the thread, then refuses."""
    scheduler = Rows(slots=1)
    engine = common.EngineThread(scheduler, max_queue=1)
    try:
        assert engine.wait(engine.submit(Countdown(3))) == 3 and engine.thread.is_alive()
        assert engine.stats() == dict(slots=1, busy=0, free=1, queued=0)
        scheduler.go.clear()  # the thread's next step waits: what comes now waits for a row
        first, second = engine.submit(Countdown(2)), engine.submit(Countdown(2))  # the free row, the queue
        with pytest.raises(common.QueueFull):
            engine.submit(Countdown(2))
        later = engine.submit(Countdown(1), new_request=False)
        assert engine.stats() == dict(slots=1, busy=0, free=1, queued=3)
        scheduler.go.set()
        assert [engine.wait(job) for job in (first, second, later)] == [2, 2, 1]
    finally:
        scheduler.go.set()
        engine.close()
    assert not engine.thread.is_alive() and scheduler.closed
    with pytest.raises(common.EngineClosed):
        engine.submit(Countdown(1))
