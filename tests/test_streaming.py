"""Streaming quantization (quantkit.streaming): same bytes as the in-memory path, one decoder layer in
memory at a time, and a resume after SIGKILLs that ends in the same bytes as an uninterrupted run."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_engine import random_calibration
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import quantkit.export
import quantkit.outputs
from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.eval.layerwise import layerwise_scores
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter
from quantkit.models.loading import is_quantkit_export
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.gptq import GPTQOptions
from quantkit.quantizers.qqq import QQQOptions
from quantkit.reload import load_quantized
from quantkit.streaming import StreamedRun, open_streamed_model, quantize_streaming
from quantkit.streaming.checkpoint import SAFETENSORS_DTYPE_NAMES, SAFETENSORS_DTYPES, SafetensorsCheckpoint
from quantkit.streaming.resident import ResidentCheckpoint
from quantkit.streaming.skeleton import StreamedLayers
from quantkit.streaming.workdir import PAUSE_ENV, PAUSE_MARK, work_dir_for

CONFIGS = {
    "rtn": QuantConfig(method="rtn", group_size=32),
    "gptq": QuantConfig(method="gptq", group_size=32, options=GPTQOptions(act_order=True)),
    "awq": QuantConfig(method="awq", group_size=32, sym=False),
    "qqq": QuantConfig(method="qqq", group_size=32, act_bits=8, options=QQQOptions(smooth_steps=8)),
}
FORMATS = {"rtn": "compressed-tensors", "gptq": "gptq", "awq": "awq", "qqq": "compressed-tensors"}


def _checkpoint(folder: Path, layers: int = 2, vocab: int = 128, tokenizer=None, tied: bool = False) -> Path:
    """A random Llama saved by transformers in shards of a few tens of KB (so several shards)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="40KB")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _digest(folder: Path) -> dict[str, str]:
    """Every weight file and the index, and config.json: the bytes both paths must agree on."""
    names = [p.name for p in folder.glob("model*.safetensors*")] + ["config.json"]
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in sorted(names)}


def _in_memory(source: Path, config: QuantConfig, fmt: str, output: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True).eval()  # load_model's call
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    return export_checkpoint(model, None, output, config, fmt, dtype="float16")


def _streamed(source: Path, config: QuantConfig, fmt: str, output: Path, **kwargs) -> tuple[Path, object]:
    model, ckpt = open_streamed_model(str(source), torch.float32)
    kwargs.setdefault("resume_interval", 0)  # every layer's outputs saved: each one a resume point
    layer_source = kwargs.pop("layer_source", None)
    run = StreamedRun(config, fmt, output, dtype="float16", device="cpu", show_progress=False, **kwargs)
    return quantize_streaming(model, ckpt, None, random_calibration(), run, layer_source)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("src") / "llama")


@pytest.mark.parametrize("method", list(CONFIGS))
def test_streamed_export_has_the_in_memory_bytes(sharded, tmp_path, single_thread, method: str) -> None:
    before = _digest(sharded)
    config, fmt = CONFIGS[method], FORMATS[method]
    expected = _digest(_in_memory(sharded, config, fmt, tmp_path / "memory"))
    out, report = _streamed(sharded, config, fmt, tmp_path / "streamed")
    assert _digest(out) == expected
    assert [e["layer"] for e in report.layers] == [0, 1]
    assert set(json.loads((out / "quantkit.json").read_text())["report"]["layers"][0]["linears"]) == set(
        get_adapter("llama").linear_names())
    assert not work_dir_for(out).exists()
    assert _digest(sharded) == before  # the source is never written


def test_several_output_shards_cut_alike(sharded, tmp_path, single_thread, monkeypatch) -> None:
    monkeypatch.setattr(quantkit.export, "SHARD_BYTES", 50_000)
    config = CONFIGS["gptq"]
    expected = _digest(_in_memory(sharded, config, "gptq", tmp_path / "memory"))
    assert "model.safetensors.index.json" in expected
    out, _ = _streamed(sharded, config, "gptq", tmp_path / "streamed")
    assert _digest(out) == expected


def test_tied_embeddings_written_once_as_in_memory(tmp_path, single_thread) -> None:
    source = _checkpoint(tmp_path / "src", tied=True)
    expected = _digest(_in_memory(source, CONFIGS["rtn"], "gptq", tmp_path / "memory"))
    out, _ = _streamed(source, CONFIGS["rtn"], "gptq", tmp_path / "streamed")
    assert _digest(out) == expected


def test_killed_after_publishing_is_finished_on_rerun(sharded, tmp_path, single_thread, monkeypatch) -> None:
    import quantkit.streaming.run as run

    def publish_then_die(folder: Path, output: Path) -> None:
        quantkit.outputs.replace_atomically(folder, output)
        raise _Crash

    monkeypatch.setattr(run, "replace_atomically", publish_then_die)
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        _streamed(sharded, CONFIGS["rtn"], "gptq", out)
    monkeypatch.undo()
    expected = _digest(out)
    assert _streamed(sharded, CONFIGS["rtn"], "gptq", out) == (out, None)
    assert _digest(out) == expected and not work_dir_for(out).exists()
    with pytest.raises(QuantizationError, match="already exists"):  # a finished export is not redone
        _streamed(sharded, CONFIGS["rtn"], "gptq", out)


class _Crash(Exception):
    pass


class _CountingLayers(StreamedLayers):
    """Also counts how many layers hold real weights, seen from the module tree itself."""

    def load(self, index, layer, device) -> None:
        super().load(index, layer, device)
        real = [m for m in get_adapter("llama").get_layers(self.model) if not next(m.parameters()).is_meta]
        self.peak_seen = max(getattr(self, "peak_seen", 0), len(real))


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("depth", [2, 4])
def test_one_layer_materialized_and_at_most_one_read_ahead(tmp_path, single_thread, depth: int,
                                                          read_ahead: bool) -> None:
    source = _checkpoint(tmp_path / "src", layers=depth)
    model, ckpt = open_streamed_model(str(source), torch.float32)
    counting = _CountingLayers(ckpt, get_adapter(model), torch.float32, read_ahead=read_ahead)
    counting.model = model
    layers = get_adapter(model).get_layers(model)
    assert all(next(layer.parameters()).is_meta for layer in layers)
    _, report = quantize_streaming(model, ckpt, None, random_calibration(),
                                   StreamedRun(CONFIGS["rtn"], "gptq", tmp_path / "out", device="cpu",
                                               show_progress=False), counting)
    assert len(report.layers) == depth
    assert counting.peak_live == 1 and counting.peak_seen == 1  # independent of depth
    assert counting.peak_held == 1 + read_ahead and counting.held == 0  # and the next layer's tensors, read ahead
    assert all(next(layer.buffers()).is_meta for layer in layers)  # each released after its step


def _moe_checkpoint(folder: Path, kind: str, tokenizer=None) -> Path:
    from test_moe import tiny_moe

    vocab = {} if tokenizer is None else {"vocab_size": len(tokenizer)}
    model = tiny_moe(kind, num_hidden_layers=3, **vocab)
    model.save_pretrained(folder, max_shard_size="40KB")  # per-expert tensors on disk
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind,config,fmt", [("qwen3_moe", CONFIGS["gptq"], "gptq"),
                                            ("mixtral", CONFIGS["awq"], "awq"),  # its checkpoints' own names
                                            ("qwen2_moe", CONFIGS["rtn"], "compressed-tensors"),  # shared expert
                                            ("deepseek_v3", CONFIGS["gptq"], "compressed-tensors")])  # MLA, router
def test_moe_streams_one_layer_at_a_time_with_the_in_memory_bytes(tmp_path, single_thread, kind: str,
                                                                   config: QuantConfig, fmt: str) -> None:
    """Each layer's experts are read from the checkpoint's per-expert tensors as the layer is reached."""
    source = _moe_checkpoint(tmp_path / "src", kind)
    expected = _digest(_in_memory(source, config, fmt, tmp_path / "memory"))
    model, ckpt = open_streamed_model(str(source), torch.float32)
    counting = _CountingLayers(ckpt, get_adapter(model), torch.float32)
    counting.model = model
    out, report = quantize_streaming(model, ckpt, None, random_calibration(),
                                     StreamedRun(config, fmt, tmp_path / "streamed", dtype="float16", device="cpu",
                                                 show_progress=False, resume_interval=0), counting)
    assert _digest(out) == expected
    assert counting.peak_live == 1 and counting.peak_seen == 1
    expert_linears = [n for n in report.layers[0]["linears"] if ".experts." in n]
    assert len(expert_linears) == 3 * getattr(model.config, get_adapter(model).experts.count)


def _fp8_copies(source: Path, fp8: Path, widened: Path) -> None:
    """`source` with every decoder-layer linear weight but the router's in DeepSeek's FP8 form (float8_e4m3fn, one
    fp32 scale per 128 x 128 block: here 32 x 32, as weight_block_size says), and the same values widened to fp32."""
    from safetensors.torch import load_file, save_file

    from quantkit.streaming.checkpoint import dequantize_fp8_blocks

    block = (32, 32)
    for folder in (fp8, widened):
        folder.mkdir()
        for other in source.iterdir():
            if other.suffix != ".safetensors":
                (folder / other.name).write_bytes(other.read_bytes())
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(config))
    for shard in source.glob("*.safetensors"):
        codes, wide = {}, {}
        for name, tensor in load_file(shard).items():
            if ".layers." not in name or not name.endswith("proj.weight"):
                codes[name] = wide[name] = tensor
                continue
            blocks = tensor.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))  # [R, b0, C, b1]
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
            codes[name] = (tensor / scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)).to(
                torch.float8_e4m3fn)
            codes[name + "_scale_inv"] = scale
            wide[name] = dequantize_fp8_blocks(codes[name], scale, block)
        save_file(codes, fp8 / shard.name)
        save_file(wide, widened / shard.name)
    index = fp8 / "model.safetensors.index.json"
    weights = json.loads(index.read_text())
    weights["weight_map"].update({f"{n}_scale_inv": f for n, f in weights["weight_map"].items()
                                  if ".layers." in n and n.endswith("proj.weight")})
    index.write_text(json.dumps(weights))


def test_deepseek_fp8_block_scaled_source_streams_as_its_dequantized_values(tmp_path, single_thread) -> None:
    """An FP8 DeepSeek checkpoint is dequantized weight by weight as it streams: its export has the bytes of the
    export of a checkpoint holding the dequantized values, and it carries no FP8 quantization_config."""
    source = _moe_checkpoint(tmp_path / "src", "deepseek_v3")
    _fp8_copies(source, tmp_path / "fp8", tmp_path / "widened")
    expected, _ = _streamed(tmp_path / "widened", CONFIGS["gptq"], "compressed-tensors", tmp_path / "from_widened")
    out, _ = _streamed(tmp_path / "fp8", CONFIGS["gptq"], "compressed-tensors", tmp_path / "from_fp8")
    weights = [name for name in _digest(out) if name != "config.json"]  # config.json names its source
    assert weights and {n: _digest(out)[n] for n in weights} == {n: _digest(expected)[n] for n in weights}
    config, reference = (json.loads((folder / "config.json").read_text()) for folder in (out, expected))
    assert {**config, "_name_or_path": None} == {**reference, "_name_or_path": None}
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    # the FP8 original is a source, not an export, to the evaluation too: layer by layer it scores as its values
    assert not is_quantkit_export(tmp_path / "fp8") and is_quantkit_export(out)
    windows = {"random": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}
    fp8, widened = layerwise_scores([tmp_path / "fp8", tmp_path / "widened"], windows, device="cpu",
                                    dtype=torch.float32)["random"]
    assert fp8["nll"] == widened["nll"] and widened["kl"] == 0


def _with_mtp_layer(source: Path, folder: Path) -> list[str]:
    """`source` plus DeepSeek-V3's multi-token-prediction layer as its checkpoints hold it: layer N (the model has
    0..N-1) with a decoder layer's tensors and its own enorm, hnorm, eh_proj, embeddings and shared head. Returns
    the names of the added tensors."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for other in source.iterdir():
        (folder / other.name).write_bytes(other.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    depth, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    layer0 = {}
    for shard in source.glob("*.safetensors"):
        layer0 |= {n: t for n, t in load_file(shard).items() if n.startswith("model.layers.0.")}
    gen = torch.Generator().manual_seed(5)
    mtp = {n.replace("model.layers.0.", f"model.layers.{depth}."): t + 0.01 for n, t in layer0.items()}
    prefix = f"model.layers.{depth}."
    mtp |= {prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
            prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
            prefix + "shared_head.norm.weight": torch.ones(hidden),
            prefix + "shared_head.head.weight": torch.randn(vocab, hidden, generator=gen),
            prefix + "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    save_file(mtp, folder / "model-mtp.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted(mtp)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_deepseek_mtp_layer_is_carried_unquantized_and_left_out_of_the_scheme(tmp_path, single_thread,
                                                                             fmt: str) -> None:
    """The layer transformers does not build is copied into the export in its dtype, its linears (not its norms)
    named in the quantization_config's ignore list; the model's own tensors are those of the export without it."""
    from safetensors.torch import load_file

    source = _moe_checkpoint(tmp_path / "src", "deepseek_v3")
    added = _with_mtp_layer(source, tmp_path / "with_mtp")
    plain, _ = _streamed(source, CONFIGS["gptq"], fmt, tmp_path / "plain")
    out, _ = _streamed(tmp_path / "with_mtp", CONFIGS["gptq"], fmt, tmp_path / "out")
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    expected = {k: v for f in plain.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(exported) - set(expected) == set(added)
    assert all(torch.equal(exported[k], v) for k, v in expected.items())
    source_mtp = load_file(tmp_path / "with_mtp" / "model-mtp.safetensors")
    assert all(torch.equal(exported[k], source_mtp[k].half()) for k in added)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    ignored = set(qconfig["ignore"]) if fmt == "compressed-tensors" else {
        re.fullmatch(r"-:(.*)\$", key).group(1).replace("\\", "") for key in qconfig["dynamic"]}
    assert {"model.layers.3.eh_proj", "model.layers.3.mlp.experts.1.gate_proj", "model.layers.3.self_attn.q_a_proj",
            "model.layers.3.shared_head.head"} <= ignored
    assert not any("norm" in name for name in ignored)
    reloaded, _ = load_quantized(out, dtype=torch.float32)
    reference, _ = load_quantized(plain, dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)


def test_dtype_names_are_those_safetensors_writes(tmp_path) -> None:
    """SAFETENSORS_DTYPES names each dtype as safetensors' headers do (a checkpoint's stored_spec reads them)."""
    from safetensors.torch import save_file

    tensors = {name.lower(): torch.zeros(2, 3, dtype=dtype) for name, dtype in SAFETENSORS_DTYPES.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert {name: ckpt.stored_spec(name.lower()) for name in SAFETENSORS_DTYPES} == \
        {name: (name, [2, 3]) for name in SAFETENSORS_DTYPES}
    assert all(SAFETENSORS_DTYPES[name] == dtype for dtype, name in SAFETENSORS_DTYPE_NAMES.items())


def test_a_missing_expert_or_a_wrong_index_is_one_line_before_any_work(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = _moe_checkpoint(tmp_path / "src", "qwen3_moe")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    lost = "model.layers.2.mlp.experts.3.down_proj.weight"
    shard = source / index["weight_map"][lost]
    with safe_open(shard, "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != lost}  # noqa: SIM118
    save_file(kept, str(shard), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="index places there.*disagree"):
        open_streamed_model(str(source), torch.float32)
    del index["weight_map"][lost]  # the index agrees now: the expert is simply not on disk
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    model, ckpt = open_streamed_model(str(source), torch.float32)
    with pytest.raises(QuantizationError, match=re.escape(f"no tensor {lost!r} (1 missing in layer 2)")):
        quantize_streaming(model, ckpt, None, random_calibration(),
                           StreamedRun(CONFIGS["rtn"], "gptq", tmp_path / "out", device="cpu", show_progress=False))
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()


@pytest.mark.parametrize("read_ahead", [False, True])
def test_moe_streams_from_fused_expert_tensors(tmp_path, single_thread, read_ahead: bool) -> None:
    """A checkpoint holding transformers 5's fused 3-D experts (gate_up_proj, down_proj) streams to the bytes the
    per-expert checkpoint of the same weights gives."""
    from safetensors.torch import save_file
    from test_moe import tiny_moe

    per_expert = _moe_checkpoint(tmp_path / "per_expert", "qwen3_moe")
    expected = _digest(_in_memory(per_expert, CONFIGS["gptq"], "gptq", tmp_path / "memory"))
    fused = tmp_path / "fused"
    fused.mkdir()
    state = tiny_moe("qwen3_moe", num_hidden_layers=3).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()},
              str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_bytes((per_expert / "config.json").read_bytes())
    model, ckpt = open_streamed_model(str(fused), torch.float32)
    layers = StreamedLayers(ckpt, get_adapter(model), torch.float32, read_ahead=read_ahead)
    out, _ = quantize_streaming(model, ckpt, None, random_calibration(),
                                StreamedRun(CONFIGS["gptq"], "gptq", tmp_path / "out", dtype="float16", device="cpu",
                                            show_progress=False), layers)
    weights = {name: digest for name, digest in _digest(out).items() if name != "config.json"}
    assert weights == {name: digest for name, digest in expected.items() if name != "config.json"}
    config = json.loads((out / "config.json").read_text())
    assert config.pop("_name_or_path") == str(fused)  # the one difference: the source's path
    assert config == {k: v for k, v in json.loads((tmp_path / "memory" / "config.json").read_text()).items()
                      if k != "_name_or_path"}
    assert layers.peak_held == 1 + read_ahead


class _CrashAfter(StreamedLayers):
    def __init__(self, *args, crash_at: int) -> None:
        super().__init__(*args)
        self.crash_at = crash_at

    def load(self, index, layer, device) -> None:
        if index == self.crash_at:
            raise _Crash
        super().load(index, layer, device)


def _crash_at(source: Path, output: Path, config: QuantConfig, layer: int, resume_interval: float = 0) -> None:
    model, ckpt = open_streamed_model(str(source), torch.float32)
    crashing = _CrashAfter(ckpt, get_adapter(model), torch.float32, crash_at=layer)
    with pytest.raises(_Crash):
        quantize_streaming(model, ckpt, None, random_calibration(),
                           StreamedRun(config, "gptq", output, device="cpu", show_progress=False,
                                       resume_interval=resume_interval), crashing)
    assert not output.exists() and work_dir_for(output).is_dir()


def test_resume_matches_and_changed_settings_start_over(sharded, tmp_path, single_thread, caplog) -> None:
    config = CONFIGS["gptq"]
    expected = _digest(_streamed(sharded, config, "gptq", tmp_path / "whole")[0])
    out = tmp_path / "out"
    _crash_at(sharded, out, config, layer=1)
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        _, report = _streamed(sharded, config, "gptq", out)
    assert "resuming" in caplog.text and "layers 0-0 are already quantized" in caplog.text
    assert _digest(out) == expected and [e["layer"] for e in report.layers] == [0, 1]

    changed = tmp_path / "changed"
    _crash_at(sharded, changed, config, layer=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        _streamed(sharded, QuantConfig(method="gptq", group_size=32, options=GPTQOptions(act_order=False)), "gptq", changed)
    assert "starting over (the settings changed)" in caplog.text

    forced = tmp_path / "forced"
    _crash_at(sharded, forced, config, layer=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        _streamed(sharded, config, "gptq", forced, resume=False)
    assert "starting over (--no-resume)" in caplog.text
    assert _digest(forced) == expected


def _loaded_whole(source: Path) -> tuple[nn.Module, ResidentCheckpoint]:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True).eval()
    return model, ResidentCheckpoint.take(model, "a model in memory")


def test_a_model_loaded_whole_goes_through_the_engine_with_the_in_memory_bytes(sharded, tmp_path,
                                                                              single_thread) -> None:
    """What `quantkit quantize` does with a GGUF file, a hub name or remote code: the loaded model is the source
    (ResidentCheckpoint), its layers quantized one at a time with the work folder; a crash at layer 1 resumes from
    layer 1, to the bytes of quantize_model + export_checkpoint on the same model."""
    config = CONFIGS["gptq"]
    expected = _digest(_in_memory(sharded, config, "gptq", tmp_path / "memory"))
    out = tmp_path / "out"
    model, resident = _loaded_whole(sharded)
    assert all(p.is_meta for p in get_adapter(model).get_layers(model).parameters())  # the resident copy serves them
    crashing = _CrashAfter(resident, get_adapter(model), torch.float32, crash_at=1)
    run = StreamedRun(config, "gptq", out, dtype="float16", device="cpu", show_progress=False, resume_interval=0)
    with pytest.raises(_Crash):
        quantize_streaming(model, resident, None, random_calibration(), run, crashing)
    assert not out.exists() and work_dir_for(out).is_dir()
    model, resident = _loaded_whole(sharded)
    _, report = quantize_streaming(model, resident, None, random_calibration(), run)
    assert [e["layer"] for e in report.layers] == [0, 1] and _digest(out) == expected


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_an_moe_model_loaded_whole_goes_through_the_engine_with_the_in_memory_bytes(tmp_path, single_thread,
                                                                                   kind: str) -> None:
    """Fused 3-D experts in memory, read per expert; Mixtral's tensors also under its checkpoints' names."""
    from test_moe import tiny_moe

    model, config = tiny_moe(kind, num_hidden_layers=2), CONFIGS["gptq"]
    in_memory = copy.deepcopy(model)
    quantize_model(in_memory, get_adapter(in_memory), random_calibration(), config, device="cpu", show_progress=False)
    expected = _digest(export_checkpoint(in_memory, None, tmp_path / "memory", config, "gptq", dtype="float16"))
    resident = ResidentCheckpoint.take(model, "a model in memory")
    run = StreamedRun(config, "gptq", tmp_path / "out", dtype="float16", device="cpu", show_progress=False)
    out, _ = quantize_streaming(model, resident, None, random_calibration(), run)
    assert _digest(out) == expected


def test_the_original_loaded_whole_scores_as_its_checkpoint_layer_by_layer(sharded, single_thread) -> None:
    """The layer-by-layer evaluation reads a model loaded whole from memory: the same scores as the checkpoint."""
    windows = {"text": torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))}
    on_disk = layerwise_scores([sharded], windows, device="cpu", dtype=torch.float32)
    in_memory = layerwise_scores([_loaded_whole(sharded)[1]], windows, device="cpu", dtype=torch.float32)
    assert in_memory == on_disk


def test_outputs_saved_only_each_resume_interval_and_a_resume_redoes_the_layers_after_them(
        sharded, tmp_path, single_thread, caplog) -> None:
    """A long interval saves no hidden states in a short run: the layer files are kept, yet a resume can only
    start at layer 0, says so, and still ends in the uninterrupted bytes; interval 0 keeps one file of them."""
    config = CONFIGS["gptq"]
    expected = _digest(_streamed(sharded, config, "gptq", tmp_path / "whole")[0])
    out = tmp_path / "out"
    _crash_at(sharded, out, config, layer=1, resume_interval=3600)
    work = work_dir_for(out)
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["hidden_at"] == 0 and len(manifest["layers"]) == 1 and not list(work.glob("hidden-*"))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        _, report = _streamed(sharded, config, "gptq", out)
    assert "no layer's outputs were saved yet, layer 0 is redone" in caplog.text
    assert _digest(out) == expected and [e["layer"] for e in report.layers] == [0, 1]

    every = tmp_path / "every"
    _crash_at(sharded, every, config, layer=1)
    assert [f.name for f in work_dir_for(every).glob("hidden-*")] == ["hidden-00001.safetensors"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_is_one_line_and_keeps_the_work(sharded, tmp_path, single_thread, monkeypatch,
                                                              code: int) -> None:
    import quantkit.streaming.workdir as workdir

    real_save = workdir.save_file
    calls = []

    def failing_save(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) > 2:  # layer 0 and its hidden states fit; layer 1 does not
            raise OSError(code, os.strerror(code), str(path))
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(workdir, "save_file", failing_save)
    out = tmp_path / "out"
    with pytest.raises(QuantizationError) as err:
        _streamed(sharded, CONFIGS["rtn"], "gptq", out)
    message = str(err.value)
    assert "\n" not in message and os.strerror(code) in message and "rerun the same command" in message
    assert not out.exists() and (work_dir_for(out) / "layer-00000.safetensors").is_file()
    monkeypatch.setattr(workdir, "save_file", real_save)
    _streamed(sharded, CONFIGS["rtn"], "gptq", out)
    assert out.is_dir() and not work_dir_for(out).exists()


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def with_tokenizer(request, tmp_path_factory, smollm2_gguf) -> tuple[Path, int, int]:
    """A dense and an MoE checkpoint a real `quantkit quantize` reads (SmolLM2's tokenizer), its depth, and the
    kills its test makes (the MoE one fewer: the suite's time)."""
    from quantkit.models.loading import load_tokenizer

    tokenizer, folder = load_tokenizer(str(smollm2_gguf)), tmp_path_factory.mktemp("tok") / request.param
    if request.param == "llama":
        return _checkpoint(folder, layers=4, vocab=len(tokenizer), tokenizer=tokenizer), 4, KILLS
    return _moe_checkpoint(folder, request.param, tokenizer), 3, 3


def _command(source: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "quantkit", "quantize", str(source), "--method", "gptq", "--group-size", "32",
            "--format", "gptq", "--nsamples", "4", "--seqlen", "32", "--device", "cpu", "--no-eval",
            "--resume-interval", "0", "--output", str(output)]


def test_a_hub_name_streams_from_its_snapshot_folder(sharded, tmp_path, monkeypatch) -> None:
    """`quantkit quantize org/model` streams from the folder of the hub's files (here a cached snapshot, offline);
    local paths, the default and a name the hub cannot give are not looked up (they load as before)."""
    from huggingface_hub import constants

    from quantkit.models.loading import hub_snapshot
    from quantkit.streaming import streamable_reason

    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(sharded, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = hub_snapshot("acme/tiny")
    assert snapshot == repo / "snapshots" / "0123abcd" and streamable_reason(str(snapshot), False) is None
    assert hub_snapshot("acme/absent") is None and hub_snapshot(str(sharded)) is None and hub_snapshot(None) is None


def _env(pause: float) -> dict[str, str]:
    # one thread: the same float reductions in every run; the pause makes each write phase killable
    return {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", PAUSE_ENV: str(pause)}


KILLS, PAUSE = 4, 0.3
PAUSES_PER_LAYER, PAUSES_TO_PUBLISH = 4, 2  # pre-write, after layer file, after hidden states, after manifest


def _pauses_left(out: Path, layers: int) -> int:
    manifest = work_dir_for(out) / "manifest.json"
    done = len(json.loads(manifest.read_text())["layers"]) if manifest.exists() else 0
    return PAUSES_PER_LAYER * (layers - done) + PAUSES_TO_PUBLISH


def _kill_at_pause(proc: subprocess.Popen, pause: int, delay: float) -> str:
    """SIGKILL `proc` `delay` seconds after its `pause`-th pause mark; returns its stderr."""
    lines, marks = [], 0
    for line in proc.stderr:
        lines.append(line)
        marks += PAUSE_MARK in line
        if marks == pause:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=30)
    return "".join(lines) + proc.stderr.read()


def test_sigkill_at_seeded_moments_then_resume_gives_the_same_bytes(with_tokenizer, tmp_path) -> None:
    """SIGKILL a real `quantkit quantize` at seeded moments: a seeded fraction of a pause after a seeded one
    of its write steps (mid-layer before its files, between its layer file, hidden states and manifest;
    the last kill in the assembly or before the publishing rename); rerun the same command each time.
    The export that finally appears has the uninterrupted run's bytes; no folder is ever at the output
    path before that. Dense and MoE (experts streamed from per-expert tensors)."""
    source, layers, kills = with_tokenizer
    whole = tmp_path / "whole"
    subprocess.run(_command(source, whole), env=_env(0), check=True, capture_output=True, timeout=120)
    expected = _digest(whole)
    out, rng, logs = tmp_path / "out", random.Random(29), []
    for kill in range(kills):
        left = _pauses_left(out, layers)
        # up to two layers on per kill, the last kill inside the assembly
        pause = left - rng.randint(0, 1) if kill == kills - 1 else rng.randint(1, min(left, 2 * PAUSES_PER_LAYER))
        proc = subprocess.Popen(_command(source, out), env=_env(PAUSE), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        logs.append(_kill_at_pause(proc, pause, rng.uniform(0, PAUSE)))
        assert proc.returncode == -signal.SIGKILL, logs[-1]
        assert not out.exists(), "a folder at the output path before the run finished"
    final = subprocess.run(_command(source, out), env=_env(0), capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    assert _digest(out) == expected
    assert not work_dir_for(out).exists()
    assert "resuming" in " ".join("".join(logs).split())


@pytest.mark.parametrize("method", ["rtn", "awq", "qqq"])
def test_every_method_quantizes_a_deepseek_fp8_source_as_its_dequantized_values(tmp_path, single_thread,
                                                                                method: str) -> None:
    """The other methods (GPTQ above) on the FP8 copy: the export's weights are those of the dequantized copy's."""
    source = _moe_checkpoint(tmp_path / "src", "deepseek_v3")
    _fp8_copies(source, tmp_path / "fp8", tmp_path / "widened")
    fmt = "compressed-tensors"
    expected, _ = _streamed(tmp_path / "widened", CONFIGS[method], fmt, tmp_path / "from_widened")
    out, _ = _streamed(tmp_path / "fp8", CONFIGS[method], fmt, tmp_path / "from_fp8")
    weights = [name for name in _digest(out) if name != "config.json"]
    assert weights and {n: _digest(out)[n] for n in weights} == {n: _digest(expected)[n] for n in weights}
