"""cpu_fast.py: the CPU speed-ups applied from outside, their decisions and their timing rules."""
import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import codec
import cpu_fast
import dualAR
import quantize
from conftest import CKPT, GOLDEN, ROOT, MatmulDtypes, chunk_sizes, golden, max_diff


STEPS = [[0, False], [4, True], [65, False]]  # a machine where oneDNN wins at 4-64 rows (an Intel Xeon's)
MKL_PACK = cpu_fast.mkl_pack


@pytest.fixture
def decisions(tmp_path, monkeypatch):
    """A decisions file of this test's own, not there yet: cpu_fast keeps and reads its decisions in it."""
    path = tmp_path / cpu_fast.DECISIONS
    monkeypatch.setattr(cpu_fast, "decisions_file", lambda: path)
    return path


def test_a_tuned_model_holds_what_it_held_and_names_the_modules_that_run(monkeypatch):
    """cpu_fast.tune adds no attribute to the model (its own are weights, buffers, config and what the model
    reads: compiled_step, top_filter); each module it put in place is what print(model) and type() show,
    with the same parameters as the plain model's."""
    monkeypatch.setattr(cpu_fast, "few_rows_steps", lambda again=False: STEPS)  # whatever this machine says
    plain, model = dualAR.load(CKPT), dualAR.load(CKPT)
    before = set(vars(model))
    cpu_fast.tune(model, rows=1)
    assert set(vars(model)) == before
    wqkv = model.layers[0].attention.wqkv
    assert type(wqkv) is cpu_fast.FewRowsLinear and f"(wqkv): FewRowsLinear(in_features={wqkv.in_features}" \
        f", out_features={wqkv.out_features}, bias=False, steps={STEPS}" in repr(model)
    assert type(model.top_filter) is dualAR.TopFilter and model.top_filter.candidates
    assert "(top_filter): TopFilter(candidates=True)" in repr(model)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))
    assert list(plain.state_dict()) == list(model.state_dict())


def test_few_rows_linear_runs_onednn_at_the_rows_its_steps_take_and_torch_elsewhere(monkeypatch):
    """A FewRowsLinear keeps nn.Linear's parameters; at the row counts its steps take (here 4-64) eager fp32
    inference multiplies by its weight prepacked once (within 1e-5 of F.linear), made again when the weight
    changes in place; other row counts and a call that records gradients are F.linear's own."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40)
    layer = cpu_fast.use_few_rows_linears(layer, STEPS)
    assert type(layer) is cpu_fast.FewRowsLinear and list(layer.state_dict()) == ["weight", "bias"]
    calls, packed_matmul = [], cpu_fast.packed_matmul
    monkeypatch.setattr(cpu_fast, "packed_matmul", lambda x, *a: calls.append(len(x)) or packed_matmul(x, *a))
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
    monkeypatch.setattr(cpu_fast, "available_memory_bytes", lambda: 2 * size - 1)
    cpu_fast.use_few_rows_linears(layers, STEPS)
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    monkeypatch.setattr(cpu_fast, "available_memory_bytes", lambda: 2 * size)
    cpu_fast.use_few_rows_linears(layers, [[0, False]])  # a machine where torch's own always wins
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    cpu_fast.use_few_rows_linears(layers.to(torch.bfloat16), STEPS)  # oneDNN's fp32 matmuls only
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    cpu_fast.use_few_rows_linears(layers.float(), STEPS)
    assert [type(m) for m in layers] == [cpu_fast.FewRowsLinear, torch.nn.ReLU, cpu_fast.FewRowsLinear]
    assert layers[0].steps == STEPS


def test_the_machines_row_steps_are_timed_once_and_kept_in_the_compile_cache(decisions, monkeypatch):
    """few_rows_steps: timed on this machine's first call, then read from the compile cache's file beside
    other machines' (a next process alike); an unreadable file or an odd value is timed again, never a
    crash. use_few_rows_linears takes the machine's steps by default."""
    timed, steps = [], [[0, True], [8, False]]
    monkeypatch.setattr(cpu_fast, "timed_row_steps", lambda: timed.append(1) or steps)
    path, machine = decisions, cpu_fast.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({"another machine": [[0, False]]}))
    assert cpu_fast.few_rows_steps() == steps and cpu_fast.few_rows_steps() == steps and timed == [1]
    assert json.loads(path.read_text()) == {"another machine": [[0, False]], machine: steps}
    for odd in ("{not json", json.dumps({machine: [[0, True]]}), json.dumps({machine: [[1, False]]}),
                json.dumps({machine: [[0, 1]]}), json.dumps([steps])):
        path.write_text(odd)
        assert cpu_fast.few_rows_steps() == steps
    assert len(timed) == 6 and json.loads(path.read_text()) == {machine: steps}
    layer = torch.nn.Linear(8, 4)
    layer = cpu_fast.use_few_rows_linears(layer, cpu_fast.few_rows_steps())
    assert type(layer) is cpu_fast.FewRowsLinear and layer.steps == steps and len(timed) == 6


def test_row_steps_give_each_timed_row_count_its_choice_and_torch_above_them():
    assert cpu_fast.row_steps({1: True, 2: True, 4: False, 8: True, 16: True}) == [
        [0, True], [4, False], [8, True], [17, False]]
    assert cpu_fast.row_steps({1: False, 64: False}) == [[0, False]]
    steps = cpu_fast.row_steps({1: False, 4: True, 64: True})
    assert [cpu_fast.step_at(steps, rows) for rows in (0, 1, 3, 4, 64, 65, 999)] == [
        False, False, False, True, True, False, False]
    assert all(cpu_fast.is_row_steps(s) for s in (steps, [[0, False]]))
    assert not any(cpu_fast.is_row_steps(s) for s in ([[0, True]], [], [[0, False], [0, False]], True))


def test_best_seconds_take_turns_after_a_warm_up_round_and_keep_each_runs_fastest_call():
    """Every timing of cpu_fast goes through best_seconds: the runs take turns (a drifting machine slows
    each alike), the first round only warms up (and compiles), each keeps its fastest call (a fake clock)."""
    now, order, costs = [0.0], [], {"a": [9, 3, 2, 4], "b": [1, 5, 5, 5]}

    def run(name):
        return lambda: order.append(name) or now.__setitem__(0, now[0] + costs[name][order.count(name) - 1])

    best = cpu_fast.best_seconds({"a": run("a"), "b": run("b")}, repeats=3, clock=lambda: now[0])
    assert order == ["a", "b"] * 4 and best == {"a": 2, "b": 5}  # b's 1 s was its warm-up
    assert cpu_fast.beats_the_others(best, "a") and not cpu_fast.beats_the_others(best, "b")
    assert not cpu_fast.beats_the_others({"a": 2, "b": 2}, "a")  # strictly: a tie keeps what runs today
    assert cpu_fast.fastest({"onednn": 1, "torch": 2, "mkl": 3}) == "onednn"
    assert cpu_fast.fastest({"onednn": 1, "mkl": 1, "torch": 1}) == "torch"  # a tie: torch's


def products(run):
    return torch.cat([y.float().flatten() for y in run()])


@torch.inference_mode()
def test_the_row_probes_time_matmuls_that_give_the_same_products_and_decide_each_row_count(monkeypatch):
    """timed_row_steps times F.linear against oneDNN's prepacked matmul on the same weights and inputs (the
    same products) at each of ROW_PROBES rows and gives `row_steps` (small shapes here: nothing is judged
    by how fast it ran)."""
    weights = cpu_fast.probe_weights(layers=2)
    assert [tuple(w.shape) for w in weights] == list(cpu_fast.PROBE_SHAPES) * 2
    for rows in (1, 3, 64):
        runs = cpu_fast.matmul_runs(cpu_fast.probe_rows(weights, rows), weights,
                                    [cpu_fast.prepack(w) for w in weights])
        assert set(runs) == {"torch", "onednn"}
        assert torch.allclose(products(runs["onednn"]), products(runs["torch"]), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(cpu_fast, "PROBE_SHAPES", ((24, 16), (16, 24)))
    assert cpu_fast.is_row_steps(cpu_fast.timed_row_steps(repeats=1))

def test_half_linears_run_many_rows_in_fp32_where_the_cpu_has_no_half_matmul_units(monkeypatch):
    """fp16 / bf16 on a CPU without matrix units for them (an AVX2 one): torch's many-row half matmuls are
    4-5x slower than fp32, so from MANY_ROWS rows on a HalfLinear multiplies the upcast weight in fp32 (the
    output rounded back); fewer rows stay in half precision (half the bytes to read). With the units, or in
    fp32, the linears stay nn.Linear."""
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for units in (True, False):
            monkeypatch.setitem(quantize.HALF_UNITS, dtype, units)
            layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
            layers, plain = layers.to(dtype), torch.nn.Linear(48, 8)
            cpu_fast.use_half_linears(layers), cpu_fast.use_half_linears(plain)
            kind = torch.nn.Linear if units else cpu_fast.HalfLinear
            assert [type(m) for m in layers] == [kind, torch.nn.ReLU, kind] and type(plain) is torch.nn.Linear
        layer = layers[0]
        for shape, wide in (((cpu_fast.MANY_ROWS - 1, 48), False), ((cpu_fast.MANY_ROWS, 48), True),
                            ((2, 20, 48), True), ((1, 4, 48), False)):
            x = torch.rand(shape).to(dtype)
            with MatmulDtypes() as seen:
                y = layer(x)
            assert seen.dtypes == [torch.float32 if wide else dtype] and y.dtype == dtype, shape
            want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype) if wide else \
                F.linear(x, layer.weight, layer.bias)
            assert torch.equal(y, want)


def test_compiled_few_rows_linears_run_one_packed_copy_at_the_rows_their_compiled_steps_take(monkeypatch):
    """In a compiled graph a FewRowsLinear runs oneDNN's prepacked matmul as one opaque op where its steps
    take the rows and either the CPU is AVX2-only or the steps take one row too (MKL loses there even at one
    row): within 1e-5 of F.linear, the copy made at the first call and found on the weight by every later
    one. Elsewhere (an AVX-512 Xeon's steps: from 4 rows) the graph keeps F.linear: no copy made."""
    torch.manual_seed(0)
    packs, prepack = [], cpu_fast.prepack
    monkeypatch.setattr(cpu_fast, "prepack", lambda w: packs.append(tuple(w.shape)) or prepack(w))
    cases = ((STEPS, True, True), (STEPS, False, False), ([[0, True], [65, False]], False, True),
             ([[0, True], [4, False]], True, False))  # the last: 4 rows not taken
    for steps, avx2, taken in cases:
        torch._dynamo.reset()
        monkeypatch.setattr(cpu_fast, "AVX2_ONLY", avx2)
        layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
        cpu_fast.use_few_rows_linears(layers, steps)
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
    row (written out first: cpu_fast.realized) by each fp32 or int8 weight and sums: no matmul, no int8
    kernel, within 1e-5 of the same arithmetic as a matmul (int8: the dequantized weight times x in fp32,
    where the kernel takes a bf16 x); 4 rows, eager calls and a machine whose timing said no keep the
    matmuls, and only fp32 and int8 weights are touched."""

    def model():
        torch.manual_seed(0)
        int8 = quantize.QuantLinear(torch.nn.Linear(48, 8), bits=8)
        return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), int8)

    def reference(layers, x):  # an int8 weight read by int8_one_row has its columns in byte order
        hidden = F.silu(F.linear(x, layers[0].weight, layers[0].bias))
        weight = layers[2].weight
        weight = cpu_fast.natural_columns(weight) if type(layers[2]) is cpu_fast.OneRowQuantLinear else weight
        return F.linear(hidden, weight.float()) * layers[2].scales.float() + layers[2].bias

    for wins in (True, False):
        layers = model()
        cpu_fast.use_one_row_sums(layers, {torch.float32: wins, torch.int8: wins})
        assert getattr(layers[0], "one_row", False) is wins  # a plain layer is left as it was
        assert type(layers[2]) is (cpu_fast.OneRowQuantLinear if wins else quantize.QuantLinear)
        assert type(layers[0]) is (cpu_fast.FewRowsLinear if wins else torch.nn.Linear)
        for rows, x in ((1, torch.rand(1, 1, 32)), (4, torch.rand(4, 32))):
            with torch.inference_mode():
                want, eager = reference(layers, x), layers(x)
            y, calls = graph_calls(layers, x)
            summed = wins and rows == 1
            assert torch.allclose(y, want, atol=1e-5) if summed else torch.equal(y, eager)
            matmuls = (calls.count("linear"), calls.count("_weight_int8pack_mm"), calls.count("sum"))
            assert matmuls == ((0, 0, 2) if summed else (1, 1, 0)), calls
            assert calls.count("as_strided") == (2 if summed else 0)  # each sum's input written out once
            with torch.inference_mode():
                assert torch.equal(layers(x), eager)  # eager: the matmuls
        assert not hasattr(layers[0].weight, "prepacked")
    int4 = quantize.QuantLinear(torch.nn.Linear(64, 16), bits=4)
    others = torch.nn.Sequential(torch.nn.Linear(8, 8).bfloat16(), int4)
    cpu_fast.use_one_row_sums(others, {torch.float32: True, torch.int8: True})
    assert type(others[0]) is torch.nn.Linear and not hasattr(others[0], "one_row")
    assert others[1].bits == 4 and type(others[1]) is quantize.QuantLinear


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_linear_runs_a_compiled_one_row_as_a_sum_in_fp32_rounded_back(dtype, monkeypatch):
    """On a CPU without half matrix units (HalfLinear), where the timing took the fused sum for the dtype, a
    compiled graph's one row is a product and a sum in fp32 (no matmul: inductor reads the half weight
    once), rounded back to half as the GEMM's output; 4 rows and eager calls keep F.linear."""
    monkeypatch.setitem(quantize.HALF_UNITS, dtype, False)
    torch.manual_seed(0)
    layers = cpu_fast.use_half_linears(torch.nn.Sequential(torch.nn.Linear(64, 32).to(dtype)))
    cpu_fast.use_one_row_sums(layers, {dtype: True})
    assert type(layers[0]) is cpu_fast.HalfLinear and "one_row=True" in repr(layers)
    weight, bias = layers[0].weight.float(), layers[0].bias.float()
    for rows in (1, 4):
        x = torch.rand(rows, 64).to(dtype)
        want = x.float() @ weight.T + bias
        y, calls = graph_calls(layers, x)
        assert (calls.count("linear"), calls.count("sum")) == ((0, 1) if rows == 1 else (1, 0)), calls
        eps = torch.finfo(dtype).eps  # one rounding of the output
        assert y.dtype == dtype and ((y.float() - want).abs() <= eps * want.abs() + 1e-6).all()
    cpu_fast.use_one_row_sums(layers, {dtype: False})
    assert "one_row=False" in repr(layers) and graph_calls(layers, x[:1])[1].count("linear") == 1


def test_int8_one_row_reads_each_byte_of_a_word_as_its_value_and_a_layer_turned_back_is_as_before():
    """int8_one_row (compiled: inductor reads the int8 weight as fp32 words and splits them) gives the
    dequantized product to fp32 rounding for every byte value (the sign of each byte as it moves to the top
    bits), its weight's columns in byte_columns' order, which natural_columns undoes. A QuantLinear made
    OneRowQuantLinear holds that order (eager: x's columns put in it, the same outputs) and, turned back,
    its weight as before."""
    N, K = 64, 1024
    weight = (torch.arange(N * K).view(N, K) * 7 % 256 - 128).to(torch.int8)  # every value in each row
    x, scales = torch.rand(K), torch.rand(N).bfloat16()
    want = (weight.float() @ x) * scales.float()
    bound = 1e-6 * (weight.float().abs() @ x) * scales.float()  # fp32 sums in another order
    words = cpu_fast.byte_columns(weight)
    assert torch.equal(cpu_fast.natural_columns(words), weight) and not torch.equal(words, weight)
    for run in (cpu_fast.int8_one_row, torch.compile(cpu_fast.int8_one_row, fullgraph=True)):
        got = run(x, words, scales)
        assert ((got - want).abs() <= bound).all()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(quantize.QuantLinear(torch.nn.Linear(48, 32), bits=8))
    natural, x = layers[0].weight.clone(), torch.rand(3, 48)
    with torch.inference_mode():
        before = layers(x)
        cpu_fast.use_one_row_sums(layers, {torch.int8: True})
        assert type(layers[0]) is cpu_fast.OneRowQuantLinear
        assert torch.equal(layers[0].weight, cpu_fast.byte_columns(natural))
        assert torch.allclose(layers(x), before, rtol=1e-6, atol=1e-6)
        cpu_fast.use_one_row_sums(layers, {torch.int8: False})
        assert type(layers[0]) is quantize.QuantLinear and torch.equal(layers[0].weight, natural)
        assert torch.allclose(layers(x), before, rtol=1e-6, atol=1e-6)


def test_int4_one_row_masks_each_nibble_in_place_and_a_layer_turned_back_is_as_before():
    """int4_one_row (compiled: inductor reads 8 nibbles as one fp32 word and masks each in place) gives the
    dequantized product, w = (q - 8) scale + zero per group, to fp32 rounding for every nibble value, on the
    weight in nibble_bytes order (which int4_values reads back out of the kernel's packing). A QuantLinear
    made OneRowQuantLinear holds that order and fp32 scales only where steps run one row (eager: the
    dequantized weight's matmul), sums one row in a compiled graph (no int4 kernel) and, turned back, holds
    its weight and scales as before, to the bit."""
    N, K, group = 96, 384, 128
    q = (torch.arange(N * K).view(N, K) * 7 % 16).int()  # every value in each row and each group
    scales = torch.rand(K // group, N, 2).bfloat16()  # as QuantLinear holds them: (groups, N, (scale, zero))
    x, scale, zero = torch.rand(K), scales[..., 0].float().T, scales[..., 1].float().T
    weight = (q.float() - 8).view(N, -1, group) * scale[..., None] + zero[..., None]
    want = weight.view(N, K) @ x
    bound = 1e-6 * (weight.abs().view(N, K) @ x)  # fp32 sums in another order
    nibbles = cpu_fast.nibble_bytes(q)
    values = q.to(torch.uint8)
    assert torch.equal(cpu_fast.nibble_values(nibbles), values) and nibbles.shape == (N, K // 2)
    assert torch.equal(quantize.int4_values(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)), values)
    assert quantize.int4_values(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[:48], 1)) is None
    held = cpu_fast.group_scales(scales)
    assert torch.equal(cpu_fast.kernel_scales(held), scales)
    for run in (cpu_fast.int4_one_row, torch.compile(cpu_fast.int4_one_row, fullgraph=True)):
        got = run(x, nibbles, held, group)
        assert ((got - want).abs() <= bound).all()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(quantize.QuantLinear(torch.nn.Linear(256, 64), bits=4))
    packed, kernel_held, x = layers[0].weight.clone(), layers[0].scales.clone(), torch.rand(3, 256)
    with torch.inference_mode():
        before = layers(x)
        cpu_fast.use_one_row_sums(layers, {torch.uint8: True}, rows=4)
        assert type(layers[0]) is quantize.QuantLinear  # batches: the kernel reads the weight
        cpu_fast.use_one_row_sums(layers, {torch.uint8: True}, rows=1)
        assert type(layers[0]) is cpu_fast.OneRowQuantLinear
        assert torch.equal(layers[0].weight, cpu_fast.nibble_bytes(quantize.int4_values(packed)))
        dequantized = cpu_fast.int4_weight(layers[0].weight, layers[0].scales, 128)
        assert torch.allclose(layers(x), x @ dequantized.T + layers[0].bias, rtol=1e-6, atol=1e-6)
        assert torch.allclose(layers(x), before, atol=1e-2)  # the kernel rounds x to bf16
        y, calls = graph_calls(layers, x[:1])
        assert "_weight_int4pack_mm_for_cpu" not in calls and calls.count("sum") == 4, calls
        assert torch.allclose(y, x[:1] @ dequantized.T + layers[0].bias, rtol=1e-5, atol=1e-5)
        cpu_fast.use_one_row_sums(layers, {torch.uint8: False}, rows=1)
        assert type(layers[0]) is quantize.QuantLinear
        assert torch.equal(layers[0].weight, packed) and torch.equal(layers[0].scales, kernel_held)
        assert torch.equal(layers(x), before)
    odd = torch.nn.Sequential(quantize.QuantLinear(torch.nn.Linear(256, 48), bits=4))
    cpu_fast.use_one_row_sums(odd, {torch.uint8: True}, rows=1)
    assert type(odd[0]) is quantize.QuantLinear  # 48 outputs: not whole blocks of the kernel's packing


FROZEN = [[0, False], [4, True], [8, False]]  # a Zen 4's frozen_rows_steps: 4-row graphs on frozen weights


def test_graphs_of_the_rows_frozen_steps_take_compile_on_frozen_weights_with_plain_linears(monkeypatch):
    """frozen_graphs compiles a graph for the row counts its steps take within frozen_gemms (freezing, the
    GEMM template), every other plainly; in those graphs a FewRowsLinear is F.linear (a matmul of a
    constant weight, which the template takes), even where its compiled steps take oneDNN's op."""
    monkeypatch.setattr(cpu_fast, "AVX2_ONLY", True)  # compiled graphs take oneDNN's op at 4-64 rows
    layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
    cpu_fast.use_few_rows_linears(layers, STEPS)
    cpu_fast.use_frozen_gemms(layers, FROZEN)
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
            assert torch.allclose(cpu_fast.frozen_graphs(step, FROZEN, x), want, atol=1e-5)
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
        cpu_fast.use_frozen_gemms(layers, FROZEN)
        return layers

    x = torch.rand(4, 64)
    torch._dynamo.reset()
    templated = counters["inductor"]["cpp_templated_kernel_counter"]
    for seed in (0, 1):
        layers = model(seed)
        with torch.inference_mode():
            want = layers(x)  # eager: F.linear
            got = cpu_fast.frozen_graphs(torch.compile(layers, fullgraph=True, dynamic=False), FROZEN, x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert counters["inductor"]["cpp_templated_kernel_counter"] - templated == 4  # 2 linears, 2 models


def test_a_frozen_graphs_compile_parses_each_template_source_once(monkeypatch):
    """Inductor renders its GEMM templates many times a linear: within frozen_gemms it parses each Jinja
    source once (templates_parsed_once) and the graph computes as before; its parser is put back after."""
    from torch._inductor.codegen.common import KernelTemplate
    parse, parsed = KernelTemplate._template_from_string, []

    def counted(source):
        parsed.append(source)
        return parse(source)

    monkeypatch.setattr(KernelTemplate, "_template_from_string", staticmethod(counted))
    layers = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.SiLU(), torch.nn.Linear(80, 16))
    cpu_fast.use_frozen_gemms(layers, FROZEN)
    x = torch.rand(4, 48)
    torch._dynamo.reset()
    with torch.inference_mode():
        got = cpu_fast.frozen_graphs(torch.compile(layers, fullgraph=True, dynamic=False), FROZEN, x)
        want = layers(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert len(parsed) == len(set(parsed)) >= 2  # a source per template kind, each parsed once
    assert KernelTemplate.__dict__["_template_from_string"].__func__ is counted


def test_frozen_graphs_are_taken_only_for_cpu_fp32_unquantized_models_whose_copies_fit(monkeypatch):
    """frozen_rows: this machine's steps for a CPU fp32 model whose linear layers fit in an eighth of the
    memory available; none for a quantized or half-precision one, or where the copies would not fit."""
    monkeypatch.setattr(cpu_fast, "available_memory_bytes", lambda: 8 * (48 * 40 + 40 * 8) * 4)
    layers = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8))
    assert cpu_fast.frozen_rows(layers) == FROZEN  # conftest's untimed steps
    monkeypatch.setattr(cpu_fast, "available_memory_bytes", lambda: 8 * (48 * 40 + 40 * 8) * 4 - 1)
    assert cpu_fast.frozen_rows(layers) == [[0, False]]
    monkeypatch.setattr(cpu_fast, "available_memory_bytes", lambda: 2 ** 40)
    int8 = torch.nn.Sequential(torch.nn.Linear(48, 40), quantize.QuantLinear(torch.nn.Linear(40, 8), bits=8))
    for module in (int8, torch.nn.Sequential(torch.nn.Linear(48, 40).half()), torch.nn.SiLU()):
        assert cpu_fast.frozen_rows(module) == [[0, False]]


def test_the_frozen_rows_choice_is_timed_once_and_kept_beside_the_row_steps(decisions, monkeypatch):
    """frozen_rows_steps: timed on this machine's first call, then read from the decisions file under its own
    key;
    a value that is not row steps is timed again."""
    timed = []
    monkeypatch.setattr(cpu_fast, "timed_frozen_rows", lambda: timed.append(1) or FROZEN)
    assert cpu_fast.frozen_rows_steps() == FROZEN and cpu_fast.frozen_rows_steps() == FROZEN and timed == [1]
    key = f"{cpu_fast.machine_key(torch.device('cpu'), torch.float32)} {cpu_fast.FROZEN_KEY}"
    assert json.loads(decisions.read_text()) == {key: FROZEN}
    decisions.write_text(json.dumps({key: True}))
    assert cpu_fast.frozen_rows_steps() == FROZEN and timed == [1, 1]


def test_the_compiled_one_row_choice_is_timed_once_per_weight_dtype_and_kept_beside_the_row_steps(
        decisions, monkeypatch):
    """compiled_one_row_wins: timed on this machine's first call for a weight dtype and kept in the decisions
    file under that dtype's key (the row steps' entry untouched); an odd value is timed again.
    use_one_row_sums asks it only for the dtypes the module has, int4's (uint8) only for one-row steps."""
    timed = []
    monkeypatch.setattr(cpu_fast, "timed_one_row",
                        lambda dtype: timed.append(dtype) or dtype == torch.float32)
    path, machine = decisions, cpu_fast.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({machine: [[0, False]]}))
    cpu_fast.use_one_row_sums(torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(8, 4).bfloat16()))
    assert timed == []
    layers = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    cpu_fast.use_one_row_sums(layers)
    assert type(layers[0]) is cpu_fast.FewRowsLinear and layers[1].one_row and timed == [torch.float32]
    int8 = quantize.QuantLinear(torch.nn.Linear(8, 4), bits=8)
    cpu_fast.use_one_row_sums(torch.nn.Sequential(torch.nn.Linear(8, 4), int8))
    assert type(int8) is quantize.QuantLinear and timed == [torch.float32, torch.int8]
    int4 = torch.nn.Sequential(quantize.QuantLinear(torch.nn.Linear(128, 32), bits=4))
    cpu_fast.use_one_row_sums(int4)  # steps of any rows: int4 stays on its kernel, untimed
    assert timed == [torch.float32, torch.int8]
    cpu_fast.use_one_row_sums(int4, rows=1)
    assert type(int4[0]) is quantize.QuantLinear and timed == [torch.float32, torch.int8, torch.uint8]
    assert cpu_fast.compiled_one_row_wins() is True and cpu_fast.compiled_one_row_wins(torch.int8) is False
    fp32, int8, int4 = (cpu_fast.one_row_key(dtype) for dtype in (torch.float32, torch.int8, torch.uint8))
    int8_machine = cpu_fast.machine_key(torch.device('cpu'), torch.int8)
    assert int8 == f"{int8_machine} compiled one row in one graph as words"
    assert json.loads(path.read_text()) == {machine: [[0, False]], fp32: True, int8: False, int4: False}
    path.write_text(json.dumps({fp32: "yes"}))
    assert cpu_fast.compiled_one_row_wins() is True and timed[-1] == torch.float32 and len(timed) == 4


def test_the_many_rows_choice_is_timed_once_and_kept_beside_the_row_steps(decisions, monkeypatch):
    """many_rows_matmul (OmniVoice's flat row): timed on this machine's first call, then read from the
    decisions file under its own key, the row steps' entry untouched; a value that names no matmul is timed
    again."""
    timed = []
    monkeypatch.setattr(cpu_fast, "timed_many_rows", lambda: timed.append(1) or "mkl")
    path, machine = decisions, cpu_fast.machine_key(torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({machine: [[0, False]]}))
    assert cpu_fast.many_rows_matmul() == "mkl" and cpu_fast.many_rows_matmul() == "mkl" and timed == [1]
    key = f"{machine} {cpu_fast.MANY_ROWS_KEY}"
    assert json.loads(path.read_text()) == {machine: [[0, False]], key: "mkl"}
    for odd in (True, "blas", [[0, True]]):  # an older file's bool included
        path.write_text(json.dumps({key: odd}))
        assert cpu_fast.many_rows_matmul() == "mkl"
    assert timed == [1, 1, 1, 1]


@pytest.mark.skipif(not cpu_fast.mkl_packs(), reason="no MKL in this torch (the choice never takes it there)")
def test_mkl_packed_matmul_gives_f_linear_at_any_row_count_and_packs_once(monkeypatch):
    """MKL's copy is packed for MANY_ROWS_PROBE rows; mkl_packed_matmul runs it at every row count (within
    fp32 rounding of F.linear: odd shapes, a bias, 3-D inputs), makes it once, and again where the weight
    changed in place."""
    torch.manual_seed(0)
    for out_features, in_features in ((40, 48), (8200, 64), (24, 3072)):
        layer = torch.nn.Linear(in_features, out_features)
        with torch.inference_mode():
            for rows in (1, 3, 7, 100, cpu_fast.MANY_ROWS_PROBE, 446):
                x = torch.rand(2, rows, in_features) - 0.5
                want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
                assert torch.allclose(cpu_fast.mkl_packed_matmul(x, layer.weight, layer.bias).double(), want,
                                      atol=1e-5 * in_features ** 0.5), (out_features, in_features, rows)
    first = layer.weight.mkl_prepacked[1]
    assert cpu_fast.mkl_prepacked(layer.weight) is first  # made once
    with torch.no_grad():
        layer.weight.mul_(2)
    x = torch.rand(5, in_features)
    assert torch.allclose(cpu_fast.mkl_packed_matmul(x, layer.weight, layer.bias),
                          F.linear(x, layer.weight, layer.bias), atol=1e-3)
    assert layer.weight.mkl_prepacked[1] is not first
    # the packed copy, not the weight, is what every row count multiplies: packed from twice the weight here
    monkeypatch.setattr(cpu_fast, "mkl_pack", lambda w: MKL_PACK(2 * w))
    fresh = torch.nn.Linear(in_features, 8, bias=False)
    for rows in (1, 7, cpu_fast.MANY_ROWS_PROBE + 1):
        x = torch.rand(rows, in_features)
        assert torch.allclose(cpu_fast.mkl_packed_matmul(x, fresh.weight), 2 * F.linear(x, fresh.weight),
                              atol=1e-3), rows


@pytest.mark.skipif(not cpu_fast.mkl_packs(), reason="no MKL in this torch (the choice never takes it there)")
def test_mkl_packs_any_rows_checks_the_products_at_other_row_counts(monkeypatch):
    """timed_many_rows may take MKL only where its copy packed for MANY_ROWS_PROBE rows gives F.linear's
    products at other row counts: true of this machine's MKL, false of one whose products are off there."""
    weights = [torch.rand(24, 16), torch.rand(16, 24)]
    assert cpu_fast.mkl_packs_any_rows(weights)
    real = cpu_fast.mkl_packed_matmul

    def off(x, w, b=None):
        return real(x, w, b) * (1 if len(x) == cpu_fast.MANY_ROWS_PROBE else 1.01)

    monkeypatch.setattr(cpu_fast, "mkl_packed_matmul", off)
    assert not cpu_fast.mkl_packs_any_rows(weights)


@torch.inference_mode()
def test_the_many_rows_probe_times_each_matmul_this_torch_has_on_the_same_products(monkeypatch):
    """timed_many_rows takes the `fastest` of F.linear, oneDNN's and MKL's packed matmuls on MANY_ROWS_PROBE
    rows of a layer's shapes: each gives F.linear's products; MKL's is timed only where its packed copy gives
    them at other row counts too, oneDNN's only in a torch that has it."""
    runs = cpu_fast.many_rows_runs()
    assert set(runs) == {"torch", "onednn"} | ({"mkl"} if cpu_fast.mkl_packs() else set())
    assert {len(y) for y in runs["torch"]()} == {cpu_fast.MANY_ROWS_PROBE}
    for name in set(runs) - {"torch"}:
        assert torch.allclose(products(runs[name]), products(runs["torch"]), rtol=1e-5, atol=1e-3), name
    monkeypatch.setattr(cpu_fast, "mkl_packs_any_rows", lambda weights: False)
    assert set(cpu_fast.many_rows_runs()) == {"torch", "onednn"}
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(cpu_fast, "prepack", lambda w: pytest.fail("prepacked without oneDNN"))
    assert set(cpu_fast.many_rows_runs()) == {"torch"}
    assert cpu_fast.timed_many_rows(repeats=1) == "torch"

@pytest.mark.parametrize("dtype", cpu_fast.ONE_ROW_DTYPES)
@torch.inference_mode()
def test_the_one_row_probe_times_the_fused_sum_against_the_matmuls_on_the_same_products(dtype):
    """timed_one_row: the fused sum (compiled there; eager here) against torch's matmul (int8, int4: aten's
    kernels, bf16 activations) and, for fp32 weights, oneDNN's prepacked one, on the same bytes at each
    precision (2x the layers of fp32 for half, 4x for int8, 8x for int4): each gives the same products, to
    the rounding of its activations (x in fp32 in the sums, bf16 in the kernels)."""
    runs = cpu_fast.one_row_runs(dtype, compile=False)
    assert set(runs) == {"fused", "torch"} | ({"onednn"} if dtype == torch.float32 else set())
    want = products(runs["torch"])
    weight_bytes = 0.5 if dtype == torch.uint8 else torch.empty(0, dtype=dtype).element_size()  # uint8: int4
    layers = cpu_fast.PROBE_LAYERS * 4 / weight_bytes  # fp32's bytes
    assert want.numel() == layers * sum(out for out, _ in cpu_fast.PROBE_SHAPES)
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-2)
    for name in set(runs) - {"torch"}:
        got = products(runs[name])
        assert got.shape == want.shape and (got - want).abs().max() <= rtol * want.abs().max(), name


@pytest.mark.parametrize("dtype", cpu_fast.ONE_ROW_DTYPES)
@torch.inference_mode()
def test_the_one_row_probe_times_every_layers_sums_in_one_compiled_call_as_a_frame_step_runs_them(
        monkeypatch, dtype):
    """The fused probe is one compiled graph over every layer's linears, as a frame step's graph is: a graph
    a layer paid a call each (~0.3 ms on a Zen 3), which made fp16's sum look like torch's matmul there
    though it ran the frame step 1.2x faster."""
    calls = []

    def compiled(fn, **options):  # runs fn eagerly, counting the calls of the compiled function
        return lambda *args: calls.append(len(args[0])) or fn(*args)
    monkeypatch.setattr(torch, "compile", compiled)
    monkeypatch.setattr(cpu_fast, "PROBE_SHAPES", ((64, 128), (128, 256)))
    runs = cpu_fast.one_row_runs(dtype, compile=True)
    layers = cpu_fast.PROBE_LAYERS * {torch.float16: 2, torch.bfloat16: 2, torch.int8: 4, torch.uint8: 8}.get(
        dtype, 1)
    assert len(runs["fused"]()) == 2 * layers and calls == [2 * layers]
    assert products(runs["fused"]).numel() == layers * (64 + 128)


def test_quantized_frame_steps_and_their_probes_compile_with_fused_multiply_adds(monkeypatch):
    """A quantized model's frame step and the one-row probe of its int8 / int4 sums compile with
    quantize.CPU_COMPILE_OPTIONS (inductor's C++ contracts a * b + c into one FMA: int4's sum 1.25x faster on
    AVX2), so the probe times the sums the step runs; fp32 and half graphs keep inductor's default."""
    options = []

    def recorded(fn, recompile_limit=None, **kw):  # (nothing runs: what it would compile with is kept)
        options.append(kw.get("options"))
        return fn
    monkeypatch.setattr(torch, "compile", recorded)
    monkeypatch.setattr(cpu_fast, "PROBE_SHAPES", ((64, 128),))
    for scheme in ("none", "int8wo", "int4wo"):
        dualAR.compile_model(dualAR.load(CKPT, quant=scheme))
    for dtype in cpu_fast.ONE_ROW_DTYPES:
        cpu_fast.one_row_runs(dtype, compile=True)
    contracted = [o is not None and quantize.CPU_COMPILE_OPTIONS.items() <= o.items() for o in options]
    quantized = [dtype in (torch.int8, torch.uint8) for dtype in cpu_fast.ONE_ROW_DTYPES]
    assert contracted == [False, True, True] + quantized  # none, int8wo, int4wo; the probes
    assert options[1]["epilogue_fusion"] is False  # (CPU flex-attention takes no epilogue)


# ----------------------------------------------------------------------------- the codec's fast path
WAVE_ATOL = 1e-4  # fixture README: codec waveforms in fp32


@pytest.fixture(scope="module")
def fast_model():
    return cpu_fast.codec_fast_path(codec.load(CKPT), choices={})  # every op fast, whatever this machine says


def runs_fast(module):  # swapped for its fast class (a compiled Snake, an op on its prepacked weight)
    return type(module) is not cpu_fast.eager_class(module)


def same_op(a, b):  # one op's eager and fast modules: the same parameters
    return next(a.parameters()) is next(b.parameters())


def codec_key(model):  # the codec's entry in the decisions file
    p = next(model.parameters())
    return f"{cpu_fast.machine_key(p.device, p.dtype)} {cpu_fast.CODEC_KEY}"


def never_timed(model):  # cpu_fast.timed_choices where the decisions file decides every op
    pytest.fail("timed although the file decides")


def test_fast_path_one_shot_and_chunked_equal_eager_and_upstream(dac, fast_model):
    codes = golden("codes_random.npy")  # 40 frames
    for chunk in None, 16:
        wave = codec.decode(fast_model, codes, chunk_frames=chunk)
        assert max_diff(wave, codec.decode(dac, codes, chunk_frames=chunk)) <= 1e-5
        assert max_diff(wave[0], golden("codec_decoded_from_given_codes.npy")) <= WAVE_ATOL
    codes = codec.encode(fast_model, codec.load_audio(GOLDEN / "audio_in.wav"))
    np.testing.assert_array_equal(codes[0].numpy(), golden("codec_codes.npy").numpy())
    eager = cpu_fast.codec_fast_path(codec.load(CKPT), on=False)
    assert type(eager.decoder.model[-2]) is codec.Snake
    linears = [type(m) for m in fast_model.modules() if isinstance(m, torch.nn.Linear)]
    assert set(linears) == {cpu_fast.PackedLinear}  # oneDNN's matmul on prepacked weights
    assert {type(m) for m in eager.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert not any(hasattr(m, "packed") for m in eager.modules())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("schedule", [[1], [3], [4], [2, 5, 1, 9, 4]])
def test_fast_path_stream_equals_eager(fast_model, one_shot, batch, schedule):
    codes, waves = one_shot
    chunks = codes[:batch].split(chunk_sizes(schedule, 40), -1)
    fast = list(codec.decode_stream(fast_model, chunks))
    assert [tuple(p.shape) for p in fast] == [(batch, c.shape[-1] * 2048) for c in chunks]
    # eager streams equal eager one-shot decodes to 1e-5 (test_codec's test_stream_decode_equals_one_shot)
    assert max_diff(torch.cat(fast, -1), waves[batch]) <= 1e-5


def alternating_choices(model):
    """Every other op key fast, the rest eager: tensors cross between the two layouts everywhere."""
    keys = sorted({cpu_fast.op_key(m) for m in model.modules()} - {None})
    steps = {True: [[0, True], [4096, False]], False: [[0, False]]}  # prepacked at every size seen here
    return {key: i % 2 == 0 if key == "snake" else steps[i % 2 == 0] for i, key in enumerate(keys)}


def test_fast_path_takes_a_cached_decision_files_choices_without_timing(decisions, one_shot, monkeypatch):
    """A decision file for this machine decides each op (no timing), and any mix of fast and eager ops
    still decodes, streams and encodes as eager does."""
    monkeypatch.setattr(cpu_fast, "timed_choices", never_timed)
    mixed = codec.load(CKPT)
    choices = alternating_choices(mixed)
    other = {key: True for key in choices}
    decisions.write_text(json.dumps({codec_key(mixed): choices, "other": other}))
    cpu_fast.codec_fast_path(mixed)
    fast = {key: choice if isinstance(choice, bool) else choice[0][1] for key, choice in choices.items()}
    for module in mixed.modules():
        key = cpu_fast.op_key(module)
        if key == "snake":
            assert (type(module) is cpu_fast.CompiledSnake) == fast[key]
        elif key is not None:
            assert hasattr(module, "packed") == runs_fast(module) == fast[key], key
    assert {False, True} == set(fast.values())
    codes, waves = one_shot
    assert max_diff(codec.decode(mixed, codes[:2], chunk_frames=None), waves[2]) <= 1e-5
    stream = torch.cat(list(codec.decode_stream(mixed, codes[:1].split(chunk_sizes([2, 5, 1], 40), -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    audio = codec.load_audio(GOLDEN / "audio_in.wav")
    np.testing.assert_array_equal(codec.encode(mixed, audio)[0].numpy(), golden("codec_codes.npy").numpy())


def test_a_machine_without_decisions_is_timed_once_and_added_to_the_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / cpu_fast.DECISIONS
    monkeypatch.setattr(cpu_fast, "decisions_file", lambda: path)
    timed = []
    dac = codec.load(CKPT)
    monkeypatch.setattr(cpu_fast, "timed_choices", lambda dac: timed.append(1) or alternating_choices(dac))
    monkeypatch.setattr(cpu_fast, "checked_choices", lambda model, choices: choices)
    path.parent.mkdir()
    path.write_text(json.dumps({"another machine": {"snake": False}}))
    cpu_fast.codec_fast_path(dac)
    cpu_fast.codec_fast_path(codec.load(CKPT))  # the next load (a next process alike) reads the file
    assert timed == [1]
    kept = json.loads(path.read_text())
    assert kept == {"another machine": {"snake": False}, codec_key(dac): alternating_choices(dac)}
    path.write_text("{not json")  # unreadable: timed again, rewritten
    cpu_fast.codec_fast_path(dac)
    assert timed == [1, 1] and json.loads(path.read_text())


@pytest.mark.parametrize("edit, timed_again", [
    (lambda entry, linear: entry, False),
    (lambda entry, linear: dict(entry, **{linear: True}), True),  # the older format's one bool for all rows
    (lambda entry, linear: dict(entry, **{linear: [[1, True]]}), True),  # no choice below 1 row
    (lambda entry, linear: dict(entry, **{linear: [[0, True]]}), True),  # prepacked beyond its timed rows
    (lambda entry, linear: dict(entry, **{linear: [[0, True], [0, False]]}), True),
    (lambda entry, linear: dict(entry, **{linear: [[0, 1]]}), True),
    (lambda entry, linear: dict(entry, snake=1), True),
    (lambda entry, linear: dict(entry, snake=[[0, True], [8, False]]), True),
    (lambda entry, linear: dict(entry, **{next(k for k in entry if k.startswith("Causal")): True}), True),
    (lambda entry, linear: [entry], True)])
def test_an_older_or_odd_decision_file_is_timed_again_and_replaced(decisions, monkeypatch, edit, timed_again):
    """A decision file decides an op only with a value of its kind: a bool for Snake, size steps for a
    prepacked op (a linear layer, a conv). Anything else (the older format's bool for a linear layer or a
    conv, steps that leave sizes undecided or end prepacked, an entry that is not a dict) is timed again and
    replaced, never a crash."""
    dac = codec.load(CKPT)
    keys = sorted({cpu_fast.op_key(m) for m in dac.modules()} - {None})
    linear = next(key for key in keys if key.startswith("linear "))
    steps = {True: [[0, False], [4, True], [65, False]], False: [[0, True], [16, False]]}[timed_again]
    timed = {key: True if key == "snake" else steps for key in keys}
    monkeypatch.setattr(cpu_fast, "timed_choices", lambda model: timed)
    monkeypatch.setattr(cpu_fast, "checked_choices", lambda model, choices: choices)
    decided = {key: True if key == "snake" else [[0, True], [16, False]] for key in keys}
    entry = edit(decided, linear)
    decisions.write_text(json.dumps({codec_key(dac): entry}))
    cpu_fast.codec_fast_path(dac)
    kept = json.loads(decisions.read_text())[codec_key(dac)]
    assert kept == (timed if timed_again else entry)
    assert {str(m.steps) for m in dac.modules() if isinstance(m, cpu_fast.PackedLinear)} == {str(steps)}


def fast_kinds(model):
    """Which kinds of op run fast now: a conv on its prepacked weight, a linear layer's, a compiled Snake."""
    kinds = {"conv": any(type(m) in (cpu_fast.PackedConv, cpu_fast.PackedConvT) for m in model.modules()),
             "linear": any(isinstance(m, cpu_fast.PackedLinear) for m in model.modules()),
             "snake": any(type(m) is cpu_fast.CompiledSnake for m in model.modules())}
    return frozenset(kind for kind, fast in kinds.items() if fast)


@pytest.mark.parametrize("costs, kept", [
    ({"encode": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 0.5}}, "choices"),
    ({"one shot": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.2,
                   frozenset({"linear", "snake"}): 0.9}}, "convs eager"),
    ({"stream 4": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.1,
                   frozenset({"linear", "snake"}): 1.1, frozenset({"snake"}): 1.0}}, "snake only"),
    ({"encode": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 0.5},
      "stream 1": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.5,
                   frozenset({"linear", "snake"}): 2, frozenset({"snake"}): 1.01}}, "eager")])
def test_checked_choices_keep_the_first_fallback_no_slower_on_any_whole_path(monkeypatch, capsys, costs,
                                                                             kept):
    """Each op can win alone and a whole path still lose: checked_choices times every probe path eager and
    with each fallback in turn (a fake clock: each path costs what its table says for the kinds of op fast
    now, 1 where it does not say) and keeps the first that loses on none; the model is left eager."""
    dac = codec.load(CKPT)
    choices = {key: [[0, True], [4096, False]] if key.startswith("linear ") else True
               for key in {cpu_fast.op_key(m) for m in dac.modules()} - {None}}
    now, runs = [0.0], []

    def path(name):
        def run():
            runs.append(name)
            now[0] += costs.get(name, {}).get(fast_kinds(dac), 1)
        return run

    paths = ["encode", "stream 1", "stream 4", "one shot"]
    monkeypatch.setattr(cpu_fast, "probe_paths", lambda model: {name: path(name) for name in paths})
    candidates = cpu_fast.fallbacks(choices)
    names = {"choices": 0, "convs eager": 1, "snake only": 2, "eager": 3}
    assert cpu_fast.checked_choices(dac, choices, clock=lambda: now[0]) == candidates[names[kept]]
    assert fast_kinds(dac) == frozenset()
    tried = min(names[kept] + 1, 3)
    assert len(runs) == 4 * 5 * tried  # 4 paths, 5 turns (a warm-up) per candidate tried
    said = capsys.readouterr().err.splitlines()  # each candidate's speed on each path, said as it is timed
    assert len(said) == tried and said[0].startswith("codec: whole paths with ")
    if "encode" in costs:
        assert "encode 2.00x" in said[0]


def test_fallbacks_turn_the_convs_then_every_prepacked_op_eager():
    conv, convt = "CausalConv [8, 8, 7] stride 1 dilation 1", "CausalConvT [8, 4, 4] stride 2 dilation 1"
    choices = {"snake": True, "linear [8, 8]": [[0, True], [65, False]], conv: True, convt: True}
    choices_, convs, snake, eager = cpu_fast.fallbacks(choices)
    assert choices_ == choices
    assert convs == dict(choices, **{conv: [[0, False]], convt: [[0, False]]})
    assert snake == {"snake": True, "linear [8, 8]": [[0, False]], conv: [[0, False]], convt: [[0, False]]}
    assert eager == dict(snake, snake=False)


def test_checked_choices_on_the_tiny_codec_time_its_real_paths_and_keep_a_fallback():
    """Untimed by a fake clock: whichever fallback wins here, it is one of them, every op is decided, and
    the model is left eager and still decodes as eager does."""
    dac = codec.load(CKPT)
    choices = alternating_choices(dac)
    assert set(cpu_fast.probe_paths(dac)) == {"encode", "stream 1", "stream 4", "stream 16", "one shot"}
    kept = cpu_fast.checked_choices(dac, choices, rounds=1)
    assert kept in cpu_fast.fallbacks(choices) and set(kept) == set(choices)
    assert fast_kinds(dac) == frozenset()


def test_timed_choices_time_every_op_in_every_probe_and_leave_the_model_eager(monkeypatch):
    """The timing itself (its figures replaced by a fake clock: tests time nothing): Snake is fast only if
    it is no slower in every probe (an encode, streams of 1, 4 and 16 frames), a prepacked op at each of its
    sizes in them (here a conv that loses at a 1-frame stream's), and the model is left eager. A conv is
    timed on a channels-last input, as the fast path hands it over (timed on contiguous ones, the convs that
    won inside a 16-frame decode went eager on an AVX2 CPU)."""
    dac = codec.load(CKPT)
    probes = cpu_fast.probe_inputs(dac)
    assert {probe for by_probe in probes.values() for probe in by_probe} == {"encode", "stream 1", "stream 4",
                                                                            "stream 16"}
    loser = dac.decoder.model[0]  # fast loses only in 1-frame streams (the first of its probes)
    losing = probes[loser]["stream 1"]
    assert len(probes[loser]) == 3 and not losing & (probes[loser]["stream 4"] | probes[loser]["stream 16"])
    assert {cpu_fast.op_rows(loser, x) for x in losing} == {4}  # the latent's 4 positions a frame

    layouts = set()  # (kind of op, its input channels-last in memory)

    def fake_seconds(module, x):
        if cpu_fast.eager_class(module) in (codec.CausalConv, codec.CausalConvT):
            layouts.add((cpu_fast.eager_class(module).__name__, x.mT.is_contiguous()))
        return 2.0 if runs_fast(module) and same_op(module, loser) and tuple(x.shape) in losing else 1.0

    monkeypatch.setattr(cpu_fast, "seconds", fake_seconds)
    choices = cpu_fast.timed_choices(dac)
    assert layouts == {("CausalConv", True), ("CausalConvT", True)}
    top = {}  # a prepacked op's largest size in any probe: eager above it
    for m, by_probe in probes.items():
        if cpu_fast.eager_class(m) is not codec.Snake:
            rows = max(cpu_fast.op_rows(m, x) for xs in by_probe.values() for x in xs)
            top[cpu_fast.op_key(m)] = max(top.get(cpu_fast.op_key(m), 0), rows)
    assert top[cpu_fast.op_key(loser)] == 64  # a 16-frame stream's
    want = {key: [[0, True], [top[key] + 1, False]] for key in top}
    want.update({"snake": True, cpu_fast.op_key(loser): [[0, False], [16, True], [65, False]]})
    assert choices == want
    assert not any(hasattr(m, "packed") for m in dac.modules())
    assert all(type(m) is codec.Snake for m in dac.modules() if cpu_fast.eager_class(m) is codec.Snake)


def test_timed_choices_decide_a_linear_layer_for_each_row_count(monkeypatch):
    """A linear layer is timed by its inputs' rows (streams: 1 to 64 here, an encode 16 to 64) and takes
    what won at each; a row count between two timed ones, what won at the one below it; above them, eager."""
    dac = codec.load(CKPT)
    attention, convnext = dac.quantizer.post_module.layers[0].attention, dac.quantizer.upsample[0][1]
    qkv, out, pointwise = (cpu_fast.op_key(m) for m in (attention.wqkv, attention.wo, convnext.pwconv1))
    losing = {qkv: lambda rows: rows >= 16, out: lambda rows: rows == 1, pointwise: lambda rows: rows == 8}

    def fake_seconds(module, x):
        loses = losing.get(cpu_fast.op_key(module), lambda rows: False)
        return 2.0 if runs_fast(module) and loses(cpu_fast.linear_rows(x.shape)) else 1.0

    monkeypatch.setattr(cpu_fast, "seconds", fake_seconds)
    choices = cpu_fast.timed_choices(dac)
    assert {key: choices[key] for key in losing} == {  # qkv and out: rows 1, 4, 16, 64; pointwise: 2 to 64
        qkv: [[0, True], [16, False]], out: [[0, False], [4, True], [65, False]],
        pointwise: [[0, True], [8, False], [16, True], [65, False]]}
    assert [cpu_fast.step_at(choices[pointwise], rows) for rows in (1, 7, 8, 15, 16, 64, 65, 999)] == [
        1, 1, 0, 0, 1, 1, 0, 0]
    linears = {key for key in choices if key.startswith("linear ")}
    assert {str(choices[key]) for key in linears - set(losing)} == {"[[0, True], [65, False]]"}
    assert choices["snake"] is True and all(choices[key][0] == [0, True] for key in set(choices) - linears
                                            - {"snake"})
    assert not any(hasattr(m, "packed") for m in dac.modules())


def test_a_conv_runs_prepacked_at_the_sizes_its_steps_say_even_within_one_stream(one_shot, monkeypatch):
    """Every decoding conv and transposed conv prepacked below 3 frames' positions (the least of those of
    its shape) and eager from there: in a stream of 1, 4, 2, 9 and 24 frames each conv takes both sides (its
    past kept in one layout for both), a one-shot decode (40 frames) runs them all eager, and both equal
    eager's to 1e-5."""
    dac = codec.load(CKPT)
    frame = {}  # each decoding conv's positions for one frame of codes
    hooks = [m.register_forward_pre_hook(lambda m, args: frame.__setitem__(m, args[0].shape[-1]))
             for m in dac.modules() if isinstance(m, (codec.CausalConv, codec.CausalConvT))]
    codec.decode(dac, torch.zeros(10, 1, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    convs = list(frame)
    choices = {cpu_fast.op_key(m): False if isinstance(m, codec.Snake) else [[0, False]]
               for m in dac.modules() if cpu_fast.op_key(m)}
    limit = {}  # convs of one shape share a choice: the smallest of their 3 frames' positions
    for m in convs:
        limit[cpu_fast.op_key(m)] = min(limit.get(cpu_fast.op_key(m), 3 * frame[m]), 3 * frame[m])
    choices.update({key: [[0, True], [n, False]] for key, n in limit.items()})
    cpu_fast.codec_fast_path(dac, choices=choices)  # the linear layers and Snakes eager
    convs = [m for m in dac.modules() if cpu_fast.op_key(m) and any(same_op(m, conv) for conv in convs)]
    calls = []  # (conv, positions, prepacked)
    conv_pointwise, matmul = torch.ops.mkldnn._convolution_pointwise, cpu_fast.packed_matmul
    for m in convs:
        m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0].shape[-1], [])))
    monkeypatch.setattr(torch.ops.mkldnn, "_convolution_pointwise",
                        lambda *args: calls[-1][2].append(1) or conv_pointwise(*args), raising=False)
    monkeypatch.setattr(cpu_fast, "packed_matmul", lambda *args: calls[-1][2].append(1) or matmul(*args))
    codes, waves = one_shot
    stream = torch.cat(list(codec.decode_stream(dac, codes[:1].split([1, 4, 2, 9, 24], -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    assert {(n < limit[cpu_fast.op_key(m)]) == bool(packed) for m, n, packed in calls} == {True}
    assert {bool(packed) for _, _, packed in calls} == {True, False}
    prepacked, eager = ({m for m, _, packed in calls if bool(packed) == side} for side in (True, False))
    assert prepacked == eager == set(convs)
    calls.clear()
    assert max_diff(codec.decode(dac, codes[:1], chunk_frames=None), waves[1]) <= 1e-5
    assert calls and not any(packed for _, _, packed in calls)


def test_timing_both_sides_makes_each_prepacked_weight_once():
    """Given one `copies` dict (the choices' timing, the benchmark), an op turned fast, eager and fast again
    gets the same prepacked weight back: no hundreds of MB made and freed between timed calls. Without it,
    each turn makes its own (equal) copy."""
    dac = codec.load(CKPT)
    copies = {}
    for module in (dac.decoder.model[0], dac.quantizer.post_module.layers[0].attention.wqkv):
        fast = cpu_fast.use_fast(module, True, copies)
        eager = cpu_fast.use_fast(fast, False, copies)
        assert type(eager) is type(module) and not hasattr(eager, "packed")
        assert cpu_fast.use_fast(eager, [[0, True], [8, False]], copies).packed is fast.packed
        alone = cpu_fast.use_fast(module, True).packed
        assert alone is not fast.packed and torch.equal(alone.to_dense(), fast.packed.to_dense())
    assert len(copies) == 2


def test_an_op_turned_fast_takes_its_place_with_the_same_parameters_and_says_so():
    """use_fast gives the module that takes an op's place in the model (the same parameters and names, its
    eager class remembered; `print(model)` names it); eager again, the eager class with nothing of the fast
    path, and the eager module itself is never changed."""
    dac = codec.load(CKPT)
    ops = {"snake": dac.decoder.model[-2], "conv": dac.decoder.model[0],
           "linear": dac.quantizer.post_module.layers[0].attention.wqkv}
    fast = {"snake": cpu_fast.CompiledSnake, "conv": cpu_fast.PackedConv, "linear": cpu_fast.PackedLinear}
    for kind, module in ops.items():
        eager, names = type(module), list(module.state_dict())
        assert cpu_fast.use_fast(module, False) is None  # eager already
        swapped = cpu_fast.use_fast(module, True)
        assert type(swapped) is fast[kind] and cpu_fast.eager_class(swapped) is eager
        assert same_op(swapped, module)
        assert list(swapped.state_dict()) == names and f"in place of {eager.__name__}" in repr(swapped)
        assert type(module) is eager and not {"eager", "steps", "packed"} & set(vars(module)), kind
        back = cpu_fast.use_fast(swapped, False)
        assert type(back) is eager and cpu_fast.eager_class(back) is eager and same_op(back, module), kind
        assert not {"eager", "steps", "packed"} & set(vars(back)), kind
    tuned = cpu_fast.codec_fast_path(dac, choices={})
    assert tuned is dac and "CompiledSnake(in place of Snake)" in repr(dac)


def test_only_weights_onednn_can_reorder_on_this_cpu_are_prepacked():
    """fp32 always; bf16 only where the CPU converts it in hardware (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    elsewhere oneDNN's reorder raises, and the benchmark's matmul peak in bf16 crashed on an AVX2 EPYC."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight = torch.rand(16, 8).to(dtype)
        try:
            cpu_fast.prepack(weight)
            reorders = True
        except RuntimeError:
            reorders = False
        assert cpu_fast.can_prepack(weight) == (reorders and dtype != torch.float16), dtype
    assert not cpu_fast.can_prepack(torch.rand(16, 8, dtype=torch.float64))


def test_a_linear_layer_runs_prepacked_at_the_row_counts_its_steps_say(decisions, one_shot, monkeypatch):
    """A decision file's step between a stream's rows and an encode's: each linear layer's call takes the
    prepacked weight below it and nn.Linear's matmul from it on; the stream and the encode stay as eager's."""
    monkeypatch.setattr(cpu_fast, "timed_choices", never_timed)
    dac = codec.load(CKPT)
    keys = {cpu_fast.op_key(m): m for m in dac.modules()}
    choices = {key: [[0, True], [8, False]] if isinstance(m, torch.nn.Linear) else False if key == "snake"
               else [[0, False]] for key, m in keys.items() if key}
    decisions.write_text(json.dumps({codec_key(dac): choices}))
    cpu_fast.codec_fast_path(dac)
    packed, eager = [], []  # rows of each linear layer's call (every other op is eager: no packed_matmul)
    packed_matmul, linear = cpu_fast.packed_matmul, torch.nn.Linear.forward
    rows = cpu_fast.linear_rows
    monkeypatch.setattr(cpu_fast, "packed_matmul", lambda x, *args: packed.append(rows(x.shape))
                        or packed_matmul(x, *args))
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: eager.append(rows(x.shape))
                        or linear(self, x))
    codes, waves = one_shot
    stream = torch.cat(list(codec.decode_stream(dac, codes[:1].split(chunk_sizes([1, 4], 40), -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    assert (set(packed), set(eager)) == ({1, 2, 4}, {8, 16})  # the upsampling ConvNeXts' 2 and 4 a frame
    audio = codec.load_audio(GOLDEN / "audio_in.wav")
    np.testing.assert_array_equal(codec.encode(dac, audio)[0].numpy(), golden("codec_codes.npy").numpy())
    assert max(packed) < 8 <= min(eager) and max(eager) == 64  # the encode: 6 to 64 rows


# ----------------------------------------------------------------------------- decisions and the busy rule
@pytest.mark.parametrize("others, kept", [((0.0, 0.05), True), ((0.0, 3.0), False)], ids=["idle", "busy"])
def test_a_timing_while_other_processes_use_the_cpu_is_used_once_and_not_kept(decisions, others, kept,
                                                                             monkeypatch, capsys):
    """decision: the other processes' CPU seconds during the timing (here 0.05 or 3 core-seconds over a
    1-second timing, on a machine whose cores our threads all use): a busy machine's decision is used
    this once, said on stderr and not kept (the next call times again); an idle one's is kept and read."""
    monkeypatch.setattr(cpu_fast.os, "cpu_count", lambda: torch.get_num_threads())
    clock = iter([0.0, 1.0] * 2)
    monkeypatch.setattr(cpu_fast.time, "perf_counter", lambda: next(clock))
    readings = iter(others * 2)
    monkeypatch.setattr(cpu_fast, "others_cpu_seconds", lambda: next(readings))
    timed = []
    for _ in range(2):
        decided = cpu_fast.decision("key", lambda v: v == "x", lambda old: timed.append(1) or "x", "timing x")
        assert decided == "x"
    err = capsys.readouterr().err
    assert timed == ([1] if kept else [1, 1])
    assert json.loads(decisions.read_text()) == {"key": "x"} if kept else \
        not decisions.exists()
    assert ("NOT kept: other processes used 300% of a core" in err) != kept
    assert (f"kept in {decisions}" in err) == kept


def test_busy_share_leaves_the_cores_our_threads_do_not_use_to_others(monkeypatch):
    monkeypatch.setattr(cpu_fast.os, "cpu_count", lambda: torch.get_num_threads() + 2)
    assert cpu_fast.busy_share(1.0, 3.2, 1.0) is None  # two free cores, and a quarter of one more
    assert cpu_fast.busy_share(1.0, 3.3, 1.0) == pytest.approx(2.3)
    assert cpu_fast.busy_share(None, None, 1.0) is None  # no /proc: nothing to subtract, no error
    assert cpu_fast.busy_share(0.0, 9.0, cpu_fast.BUSY_MIN_SECONDS / 2) is None  # too short to count in ticks


def test_the_cli_lists_the_kept_decisions(decisions, capsys):
    path = decisions  
    cpu_fast.show_decisions([])
    assert capsys.readouterr().out == f"{path}: no decisions kept yet\n"
    path.write_text(json.dumps({"AVX512 fp32": [[0, False]], "AVX512 codec fast path": {"snake": True}}))
    cpu_fast.show_decisions([])
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: 2 decision(s)", "  AVX512 fp32: [[0, false]]", "  AVX512 codec fast path: 1 ops"]


def test_tune_takes_the_three_models_and_refuses_anything_else():
    with pytest.raises(TypeError, match="cpu_fast.tune takes a DualAR, DAC or OmniVoice, not Linear"):
        cpu_fast.tune(torch.nn.Linear(2, 2))
    meta = torch.nn.Linear(2, 2, device="meta")
    assert cpu_fast.tune(meta) is meta and type(meta) is torch.nn.Linear  # not on the CPU: left as it is


def test_tune_takes_frozen_graphs_only_where_batches_of_their_rows_come():
    """A compiled S2 model's batched steps go on frozen weights where this machine's decision takes them (the
    session's: 4-row graphs) and the caller's rows say batches come: the one-row CLI (rows=1) never compiles
    one (a minute each process); an eager model or a second tune wraps nothing more."""
    import dualAR
    from conftest import CKPT

    def tuned(rows, compile=True):
        model = dualAR.load(CKPT)
        if compile:
            dualAR.compile_model(model)  # inductor; nothing compiles until the step first runs
        return cpu_fast.tune(model, rows=rows)

    def frozen(model):
        return getattr(model.compiled_step, "func", None) is cpu_fast.frozen_graphs

    assert not frozen(tuned(1)) and frozen(tuned(4)) and frozen(tuned(None))
    assert tuned(4, compile=False).compiled_step is None
    twice = tuned(4)
    step = twice.compiled_step
    assert cpu_fast.tune(twice, rows=4).compiled_step is step  # not wrapped again
    layer = twice.layers[0].attention.wqkv
    assert type(layer) is cpu_fast.FewRowsLinear and layer.frozen_steps == [[0, False], [4, True], [8, False]]


def test_the_cpu_time_of_children_that_ended_counts_as_ours_not_as_other_processes():
    """The compilers inductor runs are children that end within a timing: their CPU time is this process's
    family's (cutime), so compiling is never taken for a busy machine."""
    import os
    import subprocess
    import sys
    before = cpu_fast.family_ticks()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert cpu_fast.family_ticks() - before >= 0.4 * os.sysconf("SC_CLK_TCK")


def test_a_machine_without_proc_keeps_its_decisions(decisions, monkeypatch):
    """Where the other processes' CPU time cannot be read (no /proc: macOS), a timing is kept as on an idle
    machine, never a crash."""
    monkeypatch.setattr(cpu_fast, "others_cpu_seconds", lambda: None)
    assert cpu_fast.decision("key", lambda v: v == "x", lambda old: "x", "timing x") == "x"
    assert json.loads(decisions.read_text()) == {"key": "x"}


def test_again_times_a_kept_valid_decision_anew_and_keeps_the_new_value(decisions, monkeypatch):
    """`again` (python cpu_fast.py --again): decide runs even where the kept value is valid, is given that
    value, and what it returns replaces it; the other keys stay."""
    path = decisions
    monkeypatch.setattr(cpu_fast, "others_cpu_seconds", lambda: None)  # no busy rule: a timing is kept
    path.write_text(json.dumps({"key": "x", "other": "y"}))
    given = []

    def decide(old):
        given.append(old)
        return "z"
    valid = {"x", "z"}.__contains__
    assert cpu_fast.decision("key", valid, decide, "timing x") == "x" and given == []  # kept: not timed
    assert cpu_fast.decision("key", valid, decide, "timing x", again=True) == "z" and given == ["x"]
    assert json.loads(path.read_text()) == {"key": "z", "other": "y"}


# ----------------------------------------------------------------------------- S2's sampler
def random_logits(kind, rows, size, generator):
    """Logits of one kind: continuous, on a coarse grid (ties everywhere, as bf16 logits have), bf16-rounded,
    or mostly -inf (the slow head's bias)."""
    logits = torch.randn(rows, size, generator=generator) * 3
    if kind == "grid":
        return torch.round(logits * 2) / 2
    if kind == "bf16":
        return logits.bfloat16().float()
    if kind == "masked":
        return torch.where(torch.rand(rows, size, generator=generator) < 0.9, float("-inf"), logits)
    return logits


def test_a_decision_timed_on_one_cpu_kind_is_not_reused_on_another(monkeypatch):
    """The machine key holds the CPU kind: another capability (ATEN_CPU_CAPABILITY), a library's cap or
    another thread count is another key, so its choices are timed anew."""
    cpu = torch.device("cpu")
    key = cpu_fast.machine_key(cpu, torch.float32)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
        assert cpu_fast.machine_key(cpu, torch.float32) != key
    with monkeypatch.context() as patch:
        patch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        assert cpu_fast.machine_key(cpu, torch.float32) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert cpu_fast.machine_key(cpu, torch.float32) != key
    finally:
        torch.set_num_threads(threads)
    assert cpu_fast.machine_key(cpu, torch.float32) == key != cpu_fast.machine_key(cpu, torch.int8)


@pytest.mark.parametrize("kind", ["continuous", "grid", "bf16", "masked"])
def test_ordering_only_the_best_candidates_samples_what_the_full_sort_samples(kind, monkeypatch):
    """The top-k candidates then a small sort give the probabilities of upstream's whole-row sort bit for
    bit, ties included, over many rows and parameters; a batch is sorted whole only where it must be (ties
    across the kept tokens' end: often on a coarse grid, rarely for continuous logits)."""
    sort, whole = dualAR.sorted_removal, []
    monkeypatch.setattr(dualAR, "sorted_removal", lambda *args: whole.append(1) or sort(*args))
    generator, batches = torch.Generator().manual_seed(0), 0
    for top_k in (0, 1, 2, 7, 30, 32, 100, 1000):
        for top_p in (0.05, 0.3, 0.7, 0.9, 1.0):
            logits = random_logits(kind, 16, 4096, generator)
            top_ks = torch.randint(0, top_k + 1, (16,), generator=generator)
            top_ks[0] = top_k
            params = torch.full((16,), 0.7), torch.full((16,), top_p), top_ks
            got = dualAR.logits_to_probs(logits, *params, dualAR.candidate_removal(top_k))
            assert torch.equal(got, probs_by_full_sort(sort, logits, *params)), (top_k, top_p)
            batches += 1
    if kind == "continuous":  # (top_p = 1 is near a cumulative probability wherever the tail is tiny)
        assert len(whole) <= batches // 10
    elif kind == "grid":
        assert len(whole) > 0


def test_a_compiled_sampler_branches_in_one_graph_and_sorts_the_whole_row_only_where_it_must(monkeypatch):
    """Compiled (one graph, inductor), the candidates' removal is upstream's whole-row one, taken from the
    candidates for continuous logits and from the whole sorted row for logits with ties."""
    sort, whole = dualAR.sorted_removal, []
    monkeypatch.setattr(dualAR, "sorted_removal", lambda *args: whole.append(1) or sort(*args))
    compiled = torch.compile(dualAR.top_candidates, fullgraph=True, backend="inductor")
    generator = torch.Generator().manual_seed(0)
    top_p, top_k = torch.full((16,), 0.7), torch.randint(0, 31, (16,), generator=generator)
    for kind, sorted_whole in (("continuous", []), ("grid", [1])):
        logits = random_logits(kind, 16, 4096, generator)
        assert torch.equal(compiled(logits, top_p, top_k, 32), sort(logits, top_p, top_k)), kind
        assert whole == sorted_whole, kind


def test_a_model_file_run_as_a_script_gets_the_same_filter_and_names_it(monkeypatch):
    """dualAR.py run as a script (another module object, as __main__ is; cpu_fast imports no model file) is
    tuned as the imported one: its sampler's filter orders only the best candidates (`print(model)` says
    so), and gives upstream's whole-row removal on ties."""
    spec = importlib.util.spec_from_file_location("not_dualAR", ROOT / "dualAR.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "not_dualAR", script)  # as sys.modules["__main__"] is a script
    spec.loader.exec_module(script)
    model = cpu_fast.tune(script.load(CKPT), rows=1)
    assert type(model.top_filter) is script.TopFilter and model.top_filter.candidates
    assert "(top_filter): TopFilter(candidates=True)" in repr(model)
    removal = model.top_filter.narrowed(30)
    assert removal is script.candidate_removal(30) and removal.keywords == {"candidates": 32}
    logits, top_p, top_k = torch.arange(64.0)[None] % 7, torch.tensor([0.9]), torch.tensor([30])  # ties
    assert torch.equal(removal(logits, top_p, top_k), script.sorted_removal(logits, top_p, top_k))


def probs_by_full_sort(sort, logits, temperature, top_p, top_k):
    logits = torch.where(sort(logits, top_p, top_k), float("-inf"), logits)
    return torch.softmax(logits / temperature[:, None], dim=-1)


def test_candidates_cover_every_busy_rows_top_k_and_a_tuned_model_samples_with_them():
    top_ks = (0, 1, 30, 32, 33, 4096)
    assert [dualAR.candidate_removal(k).keywords["candidates"] for k in top_ks] == [
        32, 32, 32, 32, 64, 4096]
    model = cpu_fast.tune(dualAR.load(CKPT), rows=1)
    removal = dualAR.sampling_params(model, [(0.7, 0.7, 30), (0.7, 0.7, 100)])["removal"]
    assert removal is dualAR.candidate_removal(100) and removal.keywords["candidates"] == 128
