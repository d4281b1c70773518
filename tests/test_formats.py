"""Checkpoint formats: byte layouts, round trips, agreement with compressed-tensors, config validity."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.config import QuantConfig
from quantkit.formats import CheckpointScheme, detect_format, get_format
from quantkit.qtensor import QuantizationError, QuantizedWeight, fp8_quantize

GROUPS = (-1, 32, 64, 128)
# (format, bits, sym) combinations each format can hold
LAYOUTS = [("gptq", 4, True), ("gptq", 8, True), ("awq", 4, True), ("awq", 4, False)] + [
    ("compressed-tensors", bits, sym) for bits in (4, 8) for sym in (True, False)
]


def random_qweight(out_features: int, in_features: int, bits: int, group_size: int, sym: bool,
                   seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    n_groups = 1 if group_size == -1 else in_features // group_size
    maxq = 2**bits - 1
    codes = torch.randint(0, maxq + 1, (out_features, in_features), generator=gen, dtype=torch.uint8)
    if sym:
        zeros = torch.full((out_features, n_groups), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zeros = torch.randint(0, maxq + 1, (out_features, n_groups), generator=gen, dtype=torch.uint8)
    # fp16-representable scales, as compute_qparams produces
    scales = (torch.rand(out_features, n_groups, generator=gen) * 0.1 + 1e-3).half().float()
    return QuantizedWeight(codes, scales, zeros, bits, group_size, sym)


def config_for(fmt: str, bits: int, group_size: int, sym: bool, act_bits: int = 16) -> dict:
    cfg = QuantConfig(bits=bits, group_size=group_size, sym=sym, act_bits=act_bits).validate()
    return get_format(fmt).quantization_config(cfg, ["lm_head"])


def assert_same_weight(actual: QuantizedWeight, expected: QuantizedWeight) -> None:
    assert torch.equal(actual.codes, expected.codes)
    assert torch.equal(actual.zeros, expected.zeros)
    assert torch.equal(actual.scales, expected.scales)
    assert (actual.bits, actual.group_size, actual.sym) == (expected.bits, expected.group_size, expected.sym)
    assert actual.codes.dtype == actual.zeros.dtype == torch.uint8 and actual.scales.dtype == torch.float32


def words(t: torch.Tensor) -> list[int]:
    """int32 tensor -> unsigned 32-bit values, row-major."""
    return [w & 0xFFFFFFFF for w in t.flatten().tolist()]


def diagonal_codes(out_features: int, in_features: int, bits: int) -> torch.Tensor:
    """codes[o, i] = (o + i) mod 2**bits: every word of every format is easy to write by hand."""
    codes = torch.arange(out_features)[:, None] + torch.arange(in_features)[None, :]
    return (codes % 2**bits).to(torch.uint8)


def hand_qweight(codes: torch.Tensor, bits: int, sym: bool,
                 zeros: torch.Tensor | None = None) -> QuantizedWeight:
    out_features = codes.shape[0]
    if zeros is None:
        zeros = torch.full((out_features, 1), 2 ** (bits - 1), dtype=torch.uint8)
    return QuantizedWeight(codes, torch.full((out_features, 1), 0.5), zeros, bits, -1, sym)


# ---- round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("fmt,bits,sym", LAYOUTS)
def test_pack_unpack_round_trip(fmt: str, bits: int, sym: bool, group_size: int) -> None:
    qw = random_qweight(48, 256, bits, group_size, sym, seed=bits + group_size)
    form = get_format(fmt)
    qconfig = config_for(fmt, bits, group_size, sym)
    tensors = form.pack(qw, torch.float32)
    assert all(t.is_contiguous() for t in tensors.values())
    back = form.unpack(tensors, qconfig)
    assert_same_weight(back, qw)
    assert torch.equal(back.dequantize(), qw.dequantize())


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    out_words=st.integers(1, 6),
    in_groups=st.integers(1, 4),
    group_size=st.sampled_from(GROUPS),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(layout: tuple[str, int, bool], out_words: int, in_groups: int, group_size: int,
                             seed: int) -> None:
    fmt, bits, sym = layout
    in_features = in_groups * (32 if group_size == -1 else group_size)
    qw = random_qweight(8 * out_words, in_features, bits, group_size, sym, seed)
    form = get_format(fmt)
    assert_same_weight(form.unpack(form.pack(qw, torch.float32), config_for(fmt, bits, group_size, sym)), qw)


@settings(max_examples=30, deadline=None)
@given(out_features=st.integers(1, 37), in_features=st.integers(1, 45), bits=st.sampled_from([4, 8]),
       sym=st.booleans(), seed=st.integers(0, 2**16))
def test_compressed_tensors_pads_ragged_shapes(out_features: int, in_features: int, bits: int, sym: bool,
                                               seed: int) -> None:
    qw = random_qweight(out_features, in_features, bits, -1, sym, seed)
    form = get_format("compressed-tensors")
    tensors = form.pack(qw, torch.float32)
    per_word = 32 // bits
    assert tensors["weight_packed"].shape == (out_features, -(-in_features // per_word))
    if not sym:
        assert tensors["weight_zero_point"].shape == (-(-out_features // per_word), 1)
    assert_same_weight(form.unpack(tensors, config_for("compressed-tensors", bits, -1, sym)), qw)


# ---- byte layouts written by hand ------------------------------------------------------------------------


def test_gptq_4bit_words() -> None:
    qw = hand_qweight(diagonal_codes(8, 16, 4), 4, sym=True)
    t = get_format("gptq").pack(qw, torch.bfloat16)
    # qweight[r, o], nibble k = code of input 8r + k = (o + 8r + k) mod 16
    assert t["qweight"].shape == (2, 8) and t["qweight"].dtype == torch.int32
    assert words(t["qweight"][:, :2]) == [0x76543210, 0x87654321, 0xFEDCBA98, 0x0FEDCBA9]
    assert words(t["qzeros"]) == [0x77777777]  # zero 8 stored as 8 - 1
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].tolist() == [0] * 16


def test_gptq_8bit_words_and_g_idx() -> None:
    codes = diagonal_codes(4, 64, 8)
    qw = QuantizedWeight(codes, torch.ones(4, 2), torch.full((4, 2), 128, dtype=torch.uint8), 8, 32, True)
    t = get_format("gptq").pack(qw, torch.float16)
    assert t["qweight"].shape == (16, 4)
    assert words(t["qweight"][:2, :2]) == [0x03020100, 0x04030201, 0x07060504, 0x08070605]
    assert words(t["qzeros"]) == [0x7F7F7F7F, 0x7F7F7F7F]  # [groups=2, out/4=1], zero 128 stored as 127
    assert t["g_idx"].tolist() == [0] * 32 + [1] * 32


def test_compressed_tensors_words() -> None:
    zeros = torch.arange(8, dtype=torch.uint8)[:, None] + torch.tensor([[0, 3]], dtype=torch.uint8)
    codes = diagonal_codes(8, 16, 4)
    qw = QuantizedWeight(codes, torch.full((8, 2), 0.25), zeros, 4, 8, sym=False)
    t = get_format("compressed-tensors").pack(qw, torch.bfloat16)
    # weight_packed[o, c], nibble k = code[o, 8c + k]
    assert t["weight_packed"].shape == (8, 2) and t["weight_packed"].dtype == torch.int32
    assert words(t["weight_packed"][:2]) == [0x76543210, 0xFEDCBA98, 0x87654321, 0x0FEDCBA9]
    # weight_zero_point[c, g], nibble k = zero[8c + k, g] (packed along the output dimension)
    assert words(t["weight_zero_point"]) == [0x76543210, 0xA9876543]
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_scale"].shape == (8, 2)
    assert t["weight_shape"].dtype == torch.int64 and t["weight_shape"].tolist() == [8, 16]


def test_compressed_tensors_symmetric_has_no_zero_point() -> None:
    qw = hand_qweight(diagonal_codes(8, 16, 4), 4, sym=True)
    t = get_format("compressed-tensors").pack(qw, torch.float16)
    assert set(t) == {"weight_packed", "weight_scale", "weight_shape"}


def test_awq_issue_example() -> None:
    """[out=8, in=16], codes (o + i) mod 16: qweight rows 0x75316420, 0x86427531, 0x97538642, ..."""
    zeros = torch.arange(8, dtype=torch.uint8)[:, None]  # zero[o] = o
    qw = hand_qweight(diagonal_codes(8, 16, 4), 4, sym=False, zeros=zeros)
    t = get_format("awq").pack(qw, torch.bfloat16)
    assert t["qweight"].shape == (16, 1) and t["qweight"].dtype == torch.int32
    assert words(t["qweight"][:3]) == [0x75316420, 0x86427531, 0x97538642]
    # nibble j of word c holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]; zeros stored as they are
    assert words(t["qzeros"]) == [0x75316420]
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)


def test_awq_symmetric_stores_zero_eight() -> None:
    t = get_format("awq").pack(hand_qweight(diagonal_codes(16, 32, 4), 4, sym=True), torch.float16)
    assert words(t["qzeros"]) == [0x88888888, 0x88888888]


# ---- agreement with compressed-tensors' own packer and compressor ----------------------------------------


def ct_scheme(qconfig: dict):
    ct_quantization = pytest.importorskip("compressed_tensors.quantization")
    return ct_quantization.QuantizationConfig.model_validate(qconfig).config_groups["group_0"]


@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("bits,sym,act_bits", [(4, True, 16), (4, False, 16), (8, True, 16), (8, False, 16),
                                               (4, True, 8)])
def test_matches_compressed_tensors_compressor(bits: int, sym: bool, act_bits: int, group_size: int) -> None:
    ct_compressors = pytest.importorskip("compressed_tensors.compressors")
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    qconfig = config_for("compressed-tensors", bits, group_size, sym, act_bits)
    scheme = ct_scheme(qconfig)
    # compressed-tensors resolves a module's compressor from its scheme's format (decompress_module)
    compressor = ct_compressors.BaseCompressor.get_value_from_registry(scheme.format)
    assert compressor is ct_compressors.PackedQuantizationCompressor

    qw = random_qweight(40, 256, bits, group_size, sym, seed=7)
    ours = get_format("compressed-tensors").pack(qw, torch.float32)
    offset = 2 ** (bits - 1)
    signed_codes = (qw.codes.int() - offset).to(torch.int8)
    signed_zeros = (qw.zeros.int() - offset).to(torch.int8)
    assert torch.equal(ours["weight_packed"], pack_to_int32(signed_codes, bits))

    state = {"weight": qw.dequantize(), "weight_scale": qw.scales}
    if not sym:
        assert torch.equal(ours["weight_zero_point"], pack_to_int32(signed_zeros, bits, packed_dim=0))
        state["weight_zero_point"] = signed_zeros
    theirs = compressor.compress(state, scheme)
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name

    decompressed = compressor.decompress(ours, scheme)["weight"]
    assert torch.equal(decompressed, qw.dequantize())


def test_fp8_matches_compressed_tensors_float_compressor() -> None:
    """The FP8 export is what compressed-tensors' own float-quantized compressor writes from our scales (its
    quantize rounds w / scale to e4m3 as we do), and decompresses to our dequantized weight."""
    ct_compressors = pytest.importorskip("compressed_tensors.compressors")
    config = QuantConfig(method="fp8").validate()
    qconfig = get_format("compressed-tensors").quantization_config(config, ["lm_head"])
    scheme = ct_scheme(qconfig)
    compressor = ct_compressors.BaseCompressor.get_value_from_registry(scheme.format)
    assert compressor is ct_compressors.FloatQuantizationCompressor
    torch.manual_seed(8)
    weight = torch.randn(40, 256) * torch.logspace(-3, 0, 40)[:, None]
    qw = fp8_quantize(weight)
    ours = get_format("compressed-tensors").pack(qw, torch.float16)
    assert ours["weight"].dtype == torch.float8_e4m3fn and ours["weight"].shape == (40, 256)
    assert ours["weight_scale"].dtype == torch.float32 and ours["weight_scale"].shape == (40, 1)
    theirs = compressor.compress({"weight": weight, "weight_scale": ours["weight_scale"]}, scheme)
    assert set(theirs) == set(ours)
    assert torch.equal(theirs["weight"].view(torch.uint8), ours["weight"].view(torch.uint8))
    decompressed = compressor.decompress(ours, scheme)["weight"]
    assert torch.equal(decompressed, qw.dequantize())
    assert_same_fp8(get_format("compressed-tensors").unpack(ours, qconfig), qw)


def assert_same_fp8(actual: QuantizedWeight, expected: QuantizedWeight) -> None:
    assert actual.fp8 and (actual.bits, actual.group_size, actual.sym) == (8, -1, True)
    assert torch.equal(actual.codes, expected.codes) and torch.equal(actual.scales, expected.scales)


def test_fp8_config_is_what_vllm_serves_as_w8a8_fp8() -> None:
    """float8 weights per channel, dynamic per-token float8 activations, format float-quantized: vLLM's
    CompressedTensorsW8A8Fp8 (its _is_fp8_w8a8: float 8-bit weights with static channel strategy and dynamic token
    activations); transformers parses the same scheme; detect_format reads it back as FP8."""
    ct_quantization = pytest.importorskip("compressed_tensors.quantization")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    qconfig = get_format("compressed-tensors").quantization_config(QuantConfig(method="fp8").validate(), ["lm_head"])
    parsed = ct_quantization.QuantizationConfig.model_validate(qconfig)
    group = parsed.config_groups["group_0"]
    assert parsed.format == "float-quantized" and group.format == "float-quantized"
    assert (group.weights.num_bits, group.weights.type, group.weights.strategy, group.weights.dynamic,
            group.weights.symmetric) == (8, "float", "channel", False, True)
    inputs = group.input_activations
    assert (inputs.num_bits, inputs.type, inputs.strategy, inputs.dynamic, inputs.symmetric) == (
        8, "float", "token", True, True)
    hf = CompressedTensorsConfig.from_dict({"quantization_config": qconfig})
    assert hf.quantization_config.config_groups["group_0"] == group
    fmt, scheme = detect_format({"quantization_config": qconfig})
    assert (fmt.name, scheme.bits, scheme.group_size, scheme.act_bits, scheme.fp8) == (
        "compressed-tensors", 8, -1, 8, True)


# ---- quantization_config validity -----------------------------------------------------------------------


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits,sym,act_bits", [(4, True, 16), (4, False, 16), (8, False, 16), (4, True, 8)])
def test_compressed_tensors_config_is_valid(bits: int, sym: bool, act_bits: int, group_size: int) -> None:
    ct_quantization = pytest.importorskip("compressed_tensors.quantization")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    qconfig = config_for("compressed-tensors", bits, group_size, sym, act_bits)
    parsed = ct_quantization.QuantizationConfig.model_validate(qconfig)
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    assert parsed.ignore == ["lm_head"]
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.symmetric, weights.type) == (bits, sym, "int")
    assert weights.strategy == ("channel" if group_size == -1 else "group")
    assert weights.group_size == (None if group_size == -1 else group_size)
    inputs = parsed.config_groups["group_0"].input_activations
    if act_bits == 8:
        assert (inputs.num_bits, inputs.type, inputs.symmetric, inputs.strategy, inputs.dynamic) == (
            8, "int", True, "token", True)
    else:
        assert inputs is None
    hf = CompressedTensorsConfig.from_dict({"quantization_config": qconfig})
    assert hf.quantization_config.config_groups["group_0"] == parsed.config_groups["group_0"]


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_config_is_valid(bits: int, group_size: int) -> None:
    from transformers import GPTQConfig

    qconfig = config_for("gptq", bits, group_size, sym=True)
    # keys vLLM's gptq / gptq_marlin read (get_from_keys fails on a missing one)
    required = ("quant_method", "bits", "group_size", "desc_act", "sym", "lm_head")
    assert {key: qconfig[key] for key in required} == {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
        "lm_head": False}
    assert qconfig["checkpoint_format"] == "gptq"
    hf = GPTQConfig.from_dict(qconfig)
    assert (hf.bits, hf.group_size, hf.sym, hf.desc_act, hf.format) == (bits, group_size, True, False, "gptq")


def test_gptq_dynamic_rules_skip_exactly_the_ignored_modules() -> None:
    cfg = QuantConfig(bits=4, group_size=128).validate()
    qconfig = get_format("gptq").quantization_config(cfg, ["model.layers.1.mlp.down_proj", "lm_head"])

    def skipped(name: str) -> bool:  # vLLM / GPTQModel: "-:" rules are re.match'ed against the module name
        return any(re.match(rule[2:], name) for rule in qconfig["dynamic"] if rule.startswith("-:"))

    assert skipped("model.layers.1.mlp.down_proj") and skipped("lm_head")
    assert not skipped("model.layers.11.mlp.down_proj") and not skipped("model.layers.1.mlp.up_proj")
    assert "dynamic" not in get_format("gptq").quantization_config(cfg, [])


@pytest.mark.parametrize("group_size", GROUPS)
def test_awq_config_is_valid(group_size: int) -> None:
    from transformers import AwqConfig

    qconfig = get_format("awq").quantization_config(QuantConfig(bits=4, group_size=group_size).validate(),
                                                    ["lm_head"])
    assert qconfig == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size,
                       "zero_point": True, "modules_to_not_convert": ["lm_head"]}
    hf = AwqConfig.from_dict(qconfig)
    assert (hf.bits, hf.group_size, hf.zero_point, hf.format) == (4, group_size, True, "gemm")


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("fmt,bits,sym", LAYOUTS)
def test_detect_format_reads_back_the_scheme(fmt: str, bits: int, sym: bool, group_size: int) -> None:
    detected, scheme = detect_format({"quantization_config": config_for(fmt, bits, group_size, sym)})
    assert detected.name == fmt
    # AWQ always writes zero points (see awq.py), so its scheme reads asymmetric
    assert scheme == CheckpointScheme(bits, group_size, sym and fmt != "awq", 16)


def test_detect_format_w4a8() -> None:
    _, scheme = detect_format({"quantization_config": config_for("compressed-tensors", 4, 128, True, 8)})
    assert scheme == CheckpointScheme(4, 128, True, 8)


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,options,message", [
    ("gptq", {"sym": False}, "use --format compressed-tensors or awq"),
    ("gptq", {"act_bits": 8}, "compressed-tensors"),
    ("awq", {"bits": 8}, "4-bit"),
    ("awq", {"act_bits": 8}, "compressed-tensors"),
])
def test_check_rejects_what_the_format_cannot_hold(fmt: str, options: dict, message: str) -> None:
    with pytest.raises(QuantizationError, match=re.escape(message)):
        get_format(fmt).check(QuantConfig(**options).validate())


# What each format holds, (bits, sym, act_bits) over every valid scheme (any group size): the README's format table.
HOLDS = {
    "compressed-tensors": {(4, True, 16), (4, False, 16), (8, True, 16), (8, False, 16), (4, True, 8)},
    "gptq": {(4, True, 16), (8, True, 16)},
    "awq": {(4, True, 16), (4, False, 16)},
}


@pytest.mark.parametrize("fmt", sorted(HOLDS))
def test_each_format_holds_exactly_its_schemes(fmt: str) -> None:
    held = set()
    for bits, sym, act_bits, group in itertools.product((4, 8), (True, False), (16, 8), (-1, 32, 64, 128)):
        try:
            config = QuantConfig(method="rtn", bits=bits, sym=sym, act_bits=act_bits, group_size=group).validate()
        except QuantizationError:
            continue  # not a valid scheme at all (W4A8 needs 4-bit symmetric weights)
        try:
            get_format(fmt).check(config)
        except QuantizationError:
            continue
        held.add((bits, sym, act_bits))
    assert held == HOLDS[fmt]


def test_unknown_format_and_method() -> None:
    with pytest.raises(QuantizationError, match="available: awq, compressed-tensors, gptq"):
        get_format("exl2")
    with pytest.raises(QuantizationError, match="not a quantized checkpoint"):
        detect_format({"model_type": "llama"})
    with pytest.raises(QuantizationError, match="unsupported quant_method 'bitsandbytes'"):
        detect_format({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_pack_rejects_shapes_the_format_cannot_pack() -> None:
    with pytest.raises(QuantizationError, match="output size in words of 8, but it is 12"):
        get_format("awq").pack(random_qweight(12, 32, 4, -1, True), torch.float16)
    with pytest.raises(QuantizationError, match="input size in words of 8, but it is 20"):
        get_format("gptq").pack(random_qweight(16, 20, 4, -1, True), torch.float16)
    with pytest.raises(QuantizationError, match="symmetric"):
        get_format("gptq").pack(random_qweight(16, 32, 4, -1, False), torch.float16)


def test_unpack_rejects_unsupported_checkpoints() -> None:
    qw = random_qweight(16, 64, 4, 32, True)
    gptq = get_format("gptq")
    tensors = gptq.pack(qw, torch.float16)
    tensors["g_idx"] = tensors["g_idx"].flip(0)
    with pytest.raises(QuantizationError, match="act-order"):
        gptq.unpack(tensors, config_for("gptq", 4, 32, True))

    ct_config = config_for("compressed-tensors", 4, 32, True)
    with pytest.raises(QuantizationError, match="config groups"):
        detect_format({"quantization_config": {**ct_config, "config_groups": {}}})
    int_quantized = {**ct_config, "format": "int-quantized",
                     "config_groups": {"group_0": {**ct_config["config_groups"]["group_0"], "format": None}}}
    with pytest.raises(QuantizationError, match="'int-quantized' is not supported"):
        detect_format({"quantization_config": int_quantized})
    with pytest.raises(QuantizationError, match="'gemv'"):
        detect_format({"quantization_config": {**config_for("awq", 4, 32, True), "version": "gemv"}})


def test_gptq_reads_v1_wrapped_zero_and_v2_zeros() -> None:
    """Third-party asymmetric checkpoints: v1 stores zero - 1 (zero 0 wraps to 15), v2 the zero itself."""
    gptq = get_format("gptq")
    qconfig = {**config_for("gptq", 4, -1, True), "sym": False}
    codes = diagonal_codes(8, 8, 4)
    zeros = torch.tensor([0, 1, 2, 3, 4, 5, 6, 15], dtype=torch.uint8)
    tensors = {"qweight": gptq.pack(hand_qweight(codes, 4, True), torch.float16)["qweight"],
               "scales": torch.ones(1, 8, dtype=torch.float16)}
    # v1 words: nibble k = (zero[k] - 1) mod 16 = [15, 0, 1, 2, 3, 4, 5, 14] -> 0xE543210F
    tensors["qzeros"] = torch.tensor([[0xE543210F - 2**32]], dtype=torch.int32)
    assert gptq.unpack(tensors, qconfig).zeros[:, 0].tolist() == zeros.tolist()
    tensors["qzeros"] = torch.tensor([[0xF6543210 - 2**32]], dtype=torch.int32)
    v2 = gptq.unpack(tensors, {**qconfig, "checkpoint_format": "gptq_v2"})
    assert v2.zeros[:, 0].tolist() == zeros.tolist() and not v2.sym


# ---- transformers loads the compressed-tensors export ------------------------------------------------------


@pytest.mark.parametrize("bits,group_size,sym,act_bits", [(4, 32, True, 8), (8, -1, False, 16)])
def test_transformers_loads_compressed_tensors_export(tmp_path, bits: int, group_size: int, sym: bool,
                                                      act_bits: int) -> None:
    """A tiny Llama with every projection packed loads through transformers + compressed-tensors with no
    missing or unexpected tensors, and decompresses to exactly QuantizedWeight.dequantize."""
    pytest.importorskip("compressed_tensors")
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(hf_config).half()
    form = get_format("compressed-tensors")
    tensors, expected = {}, {}
    for index, (name, weight) in enumerate(model.state_dict().items()):
        module = name.removesuffix(".weight")
        if not (name.endswith("proj.weight") and "layers." in name):
            tensors[name] = weight.contiguous()
            continue
        qw = random_qweight(*weight.shape, bits, group_size, sym, seed=index)
        expected[module] = qw.dequantize(torch.float16)
        tensors.update({f"{module}.{key}": t for key, t in form.pack(qw, torch.float16).items()})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = QuantConfig(bits=bits, group_size=group_size, sym=sym, act_bits=act_bits).validate()
    config_json = {**hf_config.to_dict(), "quantization_config": form.quantization_config(cfg, ["lm_head"])}
    (tmp_path / "config.json").write_text(json.dumps(config_json))

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16,
                                                        output_loading_info=True)
    assert not any(info.values()), info
    loaded(torch.tensor([[1, 2, 3]]))  # the first forward decompresses the packed weights
    for module, weight in expected.items():
        assert torch.equal(loaded.get_submodule(module).weight, weight), module
