"""quantize.py: its CPU kernels (QuantLinear, W8A8Linear, int8 products) and what this CPU's units allow.
Each model's quantized goldens are in its own tests (test_dualAR, test_omnivoice)."""
import pytest
import torch
import torch.nn.functional as F

import quantize
from conftest import MatmulDtypes


def test_int8_weights_of_a_whole_sequence_multiply_in_bf16_or_fp32_as_the_cpu_has_units(monkeypatch):
    """QuantLinear(matmul_rows): from that many rows the int8 weight is converted (exactly) for one plain
    matmul, in bf16 where the CPU has bf16 matrix units, else in fp32 (bf16 there is 4-5x slower than fp32);
    the scales multiply its output. Fewer rows take torch's int8 kernel."""
    torch.manual_seed(0)
    layer = quantize.QuantLinear(torch.nn.Linear(64, 24, bias=False), 8, matmul_rows=8)
    x = torch.rand(2, 8, 64)
    dequantized = layer.weight.float() * layer.scales.float()[:, None]
    for units, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setitem(quantize.HALF_UNITS, torch.bfloat16, units)
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
        layer = quantize.QuantLinear(linear, bits)
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
    layer = quantize.W8A8Linear(linear)
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
    over = "w8a8: a linear layer of 133200 inputs is over int32's sums"
    with pytest.raises(quantize.UserError, match=over):
        quantize.W8A8Linear(torch.nn.Linear(133_200, 1))


@pytest.mark.parametrize("int8_units", [True, False])
def test_int8_products_are_torchs_int_mm_bit_for_bit_with_or_without_int8_units(monkeypatch, int8_units):
    """quantize.int_mm: torch._int_mm where the CPU has int8 dot products, else fp32 matmuls of EXACT_TERMS
    inputs at a time (exact integer sums) added in int32: the same int32 sums either way. The second
    pair of inputs sums to an odd integer above 2^24 (2000 products of 127 x 127, 999 of 127 x 1), which
    no fp32 value holds: one fp32 matmul over all 3000 inputs rounds, in whatever order it adds."""
    monkeypatch.setattr(quantize, "INT8_UNITS", int8_units)
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (5, 3000), dtype=torch.int8)
    b = torch.randint(-127, 128, (3000, 7), dtype=torch.int8)
    big_a = torch.full((1, 3000), 127, dtype=torch.int8)
    big_b = torch.cat([torch.full((2000, 2), 127), torch.ones(999, 2), torch.zeros(1, 2)]).to(torch.int8)
    for x, w in ((a, b), (big_a, big_b)):
        want = (x.long() @ w.long()).int()
        assert torch.equal(torch._int_mm(x, w), want) and torch.equal(quantize.int_mm(x, w), want)
    assert want[0, 0] % 2 == 1 and want[0, 0] > 2 ** 24
    assert (big_a.float() @ big_b.float()).double().ne(want.double()).all()  # one fp32 sum rounds: chunks


def test_a_cpu_limited_to_avx2_counts_no_vnni_amx_or_avx512_units():
    """ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA or MKL_ENABLE_INSTRUCTIONS at AVX2 or below (the emulated
    smaller CPU of docs/tests.md): int8 products then take int_mm's exact fp32 path, as on a real AVX2 CPU,
    not torch._int_mm in a library capped below VNNI (16-bit saturating sums: w8a8 lost its argmax share)."""
    flags = {"avx2": True, "avx512_vnni": True, "avx_vnni": True, "amx_int8": True, "avx512_bf16": True,
             "amx_bf16": True, "avx_ne_convert": True, "avx512_bw": True}
    assert quantize.usable_cpu_flags(flags, {}) == flags
    assert quantize.usable_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == flags
    for variable, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                            ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "SSE41"),
                            ("ATEN_CPU_CAPABILITY", "default")):
        usable = quantize.usable_cpu_flags(flags, {variable: value})
        assert usable == dict.fromkeys(flags, False) | {"avx2": True}, (variable, value)
