"""QuantLinear through quantkit.kernels.make_kernel_forward (Triton CPU interpreter), fallbacks, tuning cache."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import json
import logging

import pytest
import torch
from quantkit.kernels import make_kernel_forward, registry, w4a8_operands
from quantkit.kernels.autotune import TuningCache, candidates, pick_config
from quantkit.kernels.layout import (
    int8_tokens,
    k_blocked,
    repack_for_swap,
    repack_for_w4a8_swap,
    unpack_along_rows,
)
from quantkit.kernels.spec import TileConfig
from test_kernels_w4a8_swap import qqq_layer
from test_kernels_w4a16 import random_layer, relative_error

from quantkit.nn.qlinear import QuantLinear


@pytest.mark.parametrize(("act_bits", "group", "two_level", "dtype"), [
    (16, 32, False, torch.float16), (16, -1, False, torch.bfloat16), (8, -1, False, torch.float16),
    (8, 64, True, torch.bfloat16)])
def test_kernel_forward_matches_reference_forward(act_bits, group, two_level, dtype):
    layer = random_layer(128, 48, group, dtype, sym=False, act_bits=act_bits, two_level=two_level)
    if two_level:  # integer group scales: the reference's (q - z) * s is then already an int8 value
        layer.scales.copy_(torch.randint(1, 9, layer.scales.shape).to(dtype))
    forward = make_kernel_forward(layer)
    assert forward is not None
    x = torch.randn(2, 3, 128, dtype=dtype)
    out = forward(x)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    assert relative_error(out, layer.reference_forward(x).double()) < 2e-2


def _record_launches(monkeypatch, scheme: str, name: str) -> list[TileConfig]:
    """The configs the registered kernel `name` is launched with from now on (its registry entry wrapped)."""
    spec, configs = registry.kernel(scheme, name), []
    monkeypatch.setitem(registry.BY_NAME, (scheme, name),
                        replace(spec, launch=lambda *args: configs.append(args[-1]) or spec.launch(*args)))
    return configs


@pytest.mark.parametrize(("act_bits", "group", "sym"), [(16, 64, True), (16, 64, False), (16, -1, False),
                                                       (8, 64, True), (8, -1, True)])
def test_layers_run_the_swap_kernel_through_quantlinear(monkeypatch, act_bits, group, sym):
    """From 2 to 64 tokens the swap kernel is the default; its weight copy (in K blocks) exists for every W4A16 layer and for
    symmetric W4A8 ones (per channel, or two-level with integer group scales, as quantkit's QQQ writes them)."""
    from quantkit.kernels import SWAP_BLOCK, swap_weight_for

    two_level = act_bits == 8 and group != -1
    repack = repack_for_swap if act_bits == 16 else repack_for_w4a8_swap

    k = 1024  # whole K blocks for both schemes: the kernels run on the layers' k_blocked copies

    def layer_in(dtype: torch.dtype) -> QuantLinear:
        if act_bits == 16:
            return random_layer(k, 128, group, dtype, sym=sym)
        return qqq_layer(k, 128, group, dtype)

    layer = layer_in(torch.float16)
    assert torch.equal(swap_weight_for(layer, sym), k_blocked(repack(layer.qweight), k, SWAP_BLOCK[act_bits]))
    if act_bits == 8:
        assert swap_weight_for(layer, False) is None  # W4A8 zero points: the other kernels
    assert swap_weight_for(layer_in(torch.bfloat16), sym) is not None
    configs = _record_launches(monkeypatch, "w4a16" if act_bits == 16 else "w4a8", "swap")
    forward = make_kernel_forward(layer)
    for m in (5, 64):  # W4A8 two-level: 64-token tiles make QQQ's int8 weights in registers, 16-token ones drain
        x = torch.randn(m, k, dtype=torch.float16)
        assert relative_error(forward(x), layer.reference_forward(x).double()) < 2e-3
    assert [(c.kernel, c.block_m) for c in configs] == [("swap", 16), ("swap", 64)]
    if two_level:  # fractional group scales (a QQQ-reference checkpoint): the other kernels
        layer.scales.add_(0.5)
        assert swap_weight_for(layer, True) is None
    monkeypatch.setenv("QUANTKIT_SWAP_KERNEL", "0")
    assert swap_weight_for(layer, sym) is None


@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(k=128, n=44, group=32), "out_features"), (dict(k=96, n=48, group=48), "group size"),
    (dict(k=104, n=48, group=-1), "multiple of 32"),
    (dict(k=128, n=48, group=32, act_bits=8), "one-level group"),
])
def test_unsupported_layers_fall_back_with_a_reason(kwargs, reason, caplog):
    k, n, group = kwargs["k"], kwargs["n"], kwargs["group"]
    layer = QuantLinear(k, n, 4, group, False, kwargs.get("act_bits", 16), False, torch.float16)
    with caplog.at_level(logging.INFO, logger="quantkit.kernels"):
        assert make_kernel_forward(layer) is None
    assert reason in caplog.text
    layer.prepare_kernels()  # CPU weights: no kernel, and forward is the reference path
    x = torch.randn(3, k, dtype=torch.float16)
    torch.testing.assert_close(layer(x), layer.reference_forward(x))


def test_two_level_overflow_falls_back(caplog):
    layer = random_layer(64, 16, 32, torch.float16, sym=True, act_bits=8, two_level=True)
    layer.scales[0, 0] = 20.0  # (0 - 8) * 20 = -160 is no int8
    with caplog.at_level(logging.INFO, logger="quantkit.kernels"):
        assert make_kernel_forward(layer) is None
    assert "outside int8" in caplog.text


def test_tuning_cache_round_trip_and_defaults(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path / "sub" / "tuning.json")
    cache.put("a|b", TileConfig("gemv", block_n=64))
    assert TuningCache(cache.path).get("a|b") == TileConfig("gemv", block_n=64)
    assert json.loads(cache.path.read_text()) == {"a|b": {"kernel": "gemv", "BLOCK_N": 64}}  # the file's form
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_AUTOTUNE", "0")
    x = torch.randn(3, 256)

    def never(cfg):
        raise AssertionError("tuning ran")

    assert pick_config("w4a16", x, 512, 256, 128, never) == candidates("w4a16", 3, 512, 256, 128)[0]


def _fake_gpu(monkeypatch, tmp_path) -> None:
    """pick_config's tuning path on CPU: a CUDA-looking input, timings by graph_time (faked by the test)."""
    from types import SimpleNamespace

    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_AUTOTUNE", "1")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake-gpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=48))


def test_tuner_picks_the_fastest_candidate_timed_cold(tmp_path, monkeypatch):
    """Each candidate is timed after overwriting twice the L2 (whose own time comes off), a failing one loses,
    the fastest is cached and reused (GPU timing faked: the logic is what is checked here)."""
    import quantkit.kernels.autotune as autotune

    _fake_gpu(monkeypatch, tmp_path)
    options = candidates("w4a16", 3, 512, 256, 128)
    cost = {i: 10.0 + i for i in range(len(options))} | {2: 1.0}  # candidate 2 is the fastest
    ran, flushed = [], []

    def run(cfg: TileConfig) -> None:
        if options.index(cfg) == 1:
            raise RuntimeError("out of shared memory")
        ran.append(options.index(cfg))

    def graph_time(fn) -> float:
        flush = getattr(fn, "__self__", None)
        if flush is not None:  # the flush alone: twice the L2
            flushed.append(flush.numel())
            return 100.0
        before = len(ran)
        fn()
        return 100.0 + cost[ran[-1]] if len(ran) > before else 0.0

    monkeypatch.setattr(autotune, "_graph_time", graph_time)
    x = torch.randn(3, 256)
    assert autotune._cold_times([lambda i=i: run(options[i]) for i in (0, 1, 2)], x.device) == [10.0, float("inf"),
                                                                                             1.0]
    assert flushed == [96]
    stale_key = autotune.tuning_key("fake-gpu", "w4a16", x.dtype, 512, 256, 128, 3, False, None, False)
    stale_key = stale_key.replace(f"v{autotune.TUNING_VERSION}|", f"v{autotune.TUNING_VERSION - 1}|")
    autotune.tuning_cache().put(stale_key, TileConfig("from an earlier version"))  # never read back
    assert pick_config("w4a16", x, 512, 256, 128, run) == options[2]
    ran.clear()
    assert pick_config("w4a16", x, 512, 256, 128, run) == options[2] and ran == []  # from the cache


def _op_arguments(layer: QuantLinear) -> tuple:
    """The arguments make_kernel_forward gives the layer's custom op, after x."""
    if layer.act_bits == 16:
        zeros = None if bool((layer.zeros == 8).all()) else layer.zeros
        return layer.qweight, layer.scales, zeros, layer.bias, layer.group_size
    channel, group_scales, zeros = w4a8_operands(layer)
    return layer.qweight, channel, group_scales, zeros, layer.bias, layer.group_size


@pytest.mark.parametrize(("act_bits", "group", "sym", "two_level"), [
    (16, 32, False, False), (16, -1, True, False), (16, 128, True, False), (8, -1, False, False), (8, -1, True, False),
    (8, 64, True, True), (8, 64, False, True)])
def test_op_references_compute_what_quantlinear_computes(monkeypatch, act_bits, group, sym, two_level):
    """The tuner's check of every candidate compares against these: the layer's own reference forward (fp32, so
    only summation order differs), dequantizing a few output columns at a time."""
    import quantkit.kernels.reference as reference

    monkeypatch.setattr(reference, "COLUMNS", 40)  # blocks of 40 columns, the last one short
    layer = random_layer(256, 96, group, torch.float32, sym, act_bits=act_bits, two_level=two_level)
    if two_level:  # quantkit's QQQ: integer group multipliers
        layer.scales.copy_(torch.randint(1, 17, layer.scales.shape).float())
    x = torch.randn(5, 256)
    op = reference.w4a16_reference if act_bits == 16 else reference.w4a8_reference
    assert relative_error(op(x, *_op_arguments(layer)), layer.reference_forward(x).double()) < 1e-6


def test_tuner_drops_configs_that_give_wrong_results(tmp_path, monkeypatch, caplog):
    """A candidate whose output is not the reference's (a miscompile, a GPU it was never run on) is logged and
    never timed or cached, however fast; with no candidate right, the op's torch reference serves the layer."""
    import quantkit.kernels.autotune as autotune
    from quantkit.kernels import w4a16_run

    _fake_gpu(monkeypatch, tmp_path)
    layer = random_layer(256, 48, 128, torch.float32, sym=False)
    x = torch.randn(3, 256)
    args = _op_arguments(layer)
    expected = layer.reference_forward(x)
    options = candidates("w4a16", 3, 48, 256, 128)
    wrong = {0, 2}  # the default and the fastest
    timed = []

    def run(cfg: TileConfig) -> torch.Tensor:
        timed.append(options.index(cfg))
        if options.index(cfg) == 1:  # fails to run: kept, without a warning (the timing makes it lose)
            raise RuntimeError("out of shared memory")
        out = expected + 1e-3 * torch.randn_like(expected)  # rounding: right
        return out.flip(1) if options.index(cfg) in wrong else out

    monkeypatch.setattr(autotune, "_cold_times", lambda calls, device: [float(i) for i in range(len(calls))][::-1])
    with caplog.at_level(logging.WARNING, logger="quantkit.kernels.autotune"):
        best = pick_config("w4a16", x, 48, 256, 128, run, True, reference=lambda: expected)
    assert best == [c for i, c in enumerate(options) if i not in wrong][-1]  # the fastest right one
    assert sorted(timed) == list(range(len(options)))  # every candidate checked once (the timing itself is faked)
    assert sum("gives wrong results" in r.message for r in caplog.records) == len(wrong)
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "fresh"))
    with caplog.at_level(logging.ERROR, logger="quantkit.kernels.autotune"):
        best = pick_config("w4a16", x, 48, 256, 128, lambda cfg: expected.flip(1), True, reference=lambda: expected)
    assert best == autotune.REFERENCE and any("plain torch path" in r.message for r in caplog.records)
    assert relative_error(w4a16_run(x, *args[:4], 128, None, best), expected.double()) < 1e-6
    nan = torch.full_like(expected, float("nan"))  # an input the reference cannot judge: nothing is dropped
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "nan"))
    assert pick_config("w4a16", x, 48, 256, 128, lambda cfg: expected.flip(1), True, reference=lambda: nan) != \
        autotune.REFERENCE


def test_moving_a_layer_rebuilds_or_drops_its_kernel_forward(monkeypatch):
    """model.to(...) reaches QuantLinear._apply: a kernel forward (which holds the old buffers) is dropped,
    and rebuilt when the layer lands on a GPU, or loads a state dict there, unless QUANTKIT_KERNELS=0."""
    layer = random_layer(128, 48, 32, torch.float16, sym=True)
    layer._kernel = lambda x: x  # a stale forward made for other buffers
    layer.to(torch.float16)
    assert layer._kernel is None
    built = []
    monkeypatch.setattr(QuantLinear, "prepare_kernels", lambda self: built.append(self))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # pretend the move was to a GPU
    torch.nn.Sequential(layer).to(torch.float16)
    assert built == [layer]
    layer.load_state_dict(random_layer(128, 48, 32, torch.float16, sym=False).state_dict())
    assert built == [layer, layer]  # rebuilt: the loaded zero points are no longer symmetric
    monkeypatch.setenv("QUANTKIT_KERNELS", "0")
    layer.to(torch.float16)
    assert built == [layer, layer]


def test_a_cached_dense_weight_takes_precedence_over_the_kernel(monkeypatch):
    layer = random_layer(128, 48, 32, torch.float16, sym=True)
    x = torch.randn(3, 128, dtype=torch.float16)
    expected = layer.reference_forward(x)
    layer.cache_dense_weight()
    layer._kernel = lambda x: pytest.fail("kernel used although the dense weight is cached")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # as if x were on the GPU
    torch.testing.assert_close(layer(x), expected)


def test_copies_and_pickles_never_share_the_kernel_forward():
    import copy
    import pickle

    layer = random_layer(128, 48, 32, torch.float16, sym=True)
    layer._kernel = lambda x: x  # a closure over this layer's buffers (and not picklable)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone._kernel is None and torch.equal(clone.qweight, layer.qweight)
    assert layer._kernel is not None


@pytest.mark.parametrize(("act_bits", "group"), [(16, 64), (8, 64), (8, -1)])
def test_one_weight_copy_on_the_device_where_the_swap_kernels_serve_every_m(monkeypatch, act_bits, group):
    """Where the plain copy is not kept (QUANTKIT_PLAIN_COPY=0 here; Hopper's default) only the swap-layout kernels
    run, at every token count (past 512 without the Gluon kernels: the swap kernel's largest tiles), their results
    right; qweight moves to host memory, and exports, fusing and the reference path still read it."""
    from quantkit.kernels import keeps_plain_copy
    from quantkit.kernels.registry import SWAP_LAYOUT_KERNELS

    assert keeps_plain_copy(torch.device("cpu"))  # off Hopper the plain copy stays by default
    monkeypatch.setenv("QUANTKIT_PLAIN_COPY", "0")
    layer = random_layer(512, 128, group, torch.float16, sym=True) if act_bits == 16 else qqq_layer(
        512, 128, group, torch.float16)
    for m in (1, 3, 64, 300, 1030):
        options = candidates("w4a16" if act_bits == 16 else "w4a8", m, 128, 512, layer.group_size, swap=True,
                             plain=False)
        assert options and {c.kernel for c in options} <= set(SWAP_LAYOUT_KERNELS)
    configs = _record_launches(monkeypatch, "w4a16" if act_bits == 16 else "w4a8", "swap")
    forward = make_kernel_forward(layer)
    assert forward.plain_qweight.device.type == "cpu"
    for m in (3, 600):
        x = torch.randn(m, 512, dtype=torch.float16)
        assert relative_error(forward(x), layer.reference_forward(x).double()) < 2e-3
    assert [c.kernel for c in configs] == ["swap", "swap"]
    fused = QuantLinear.concatenated([layer, layer])
    assert torch.equal(fused.qweight, torch.cat([layer.qweight] * 2, dim=1))
    narrow = random_layer(512, 64, 64, torch.float16, sym=True)  # no swap tile takes 64 outputs at 64 tokens
    assert make_kernel_forward(narrow).plain_qweight is narrow.qweight


@pytest.mark.parametrize(("group", "sym", "two_level", "dtype"), [
    (-1, False, False, torch.float16), (-1, True, False, torch.float32), (64, True, True, torch.bfloat16)])
def test_w4a8_reference_path_is_the_kernels_integer_function(group, sym, two_level, dtype):
    """A W4A8 layer with integer weights (per channel, two-level) computes on the reference path what the kernels
    compute: int8 activations times int8 weights summed exactly (int64 here), read as fp32, times the token then the
    channel scale, plus the bias: bit for bit, with the weight cached or not (K = 1280: past the 1024 products an
    fp32 sum holds exactly)."""
    layer = random_layer(1280, 96, group, dtype, sym, act_bits=8, two_level=two_level)
    rows = torch.arange(1280) // layer.group_size
    q_minus_z = unpack_along_rows(layer.qweight, 4).long() - layer.zeros.long()[rows]  # [K, N]
    if two_level:  # quantkit's QQQ: integer group multipliers
        layer.scales.copy_(torch.randint(1, 17, layer.scales.shape).to(dtype))
        weight, channel = q_minus_z * layer.scales.long()[rows], layer.channel_scales.float()
    else:
        weight, channel = q_minus_z, layer.scales[0].float()
    x = (3 * torch.randn(2, 5, 1280)).to(dtype)
    codes, token_scales = int8_tokens(x.reshape(10, 1280))
    expected = ((codes.long() @ weight).float() * token_scales * channel + layer.bias.float()).to(dtype)
    assert torch.equal(layer.reference_forward(x), expected.reshape(2, 5, 96))
    layer.cache_dense_weight()
    assert torch.equal(layer(x), expected.reshape(2, 5, 96))
