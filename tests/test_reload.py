"""quantkit's reload builds the quantized model without ever holding it in full precision: a meta skeleton, then
one module at a time onto the target device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.reload import load_quantized

# Eight layers of 1024 x 4096 linears: 268 MB of fp16 weights in the linears, 76 MB as a W4 g128 export.
WIDE = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=128, vocab_size=512, max_position_embeddings=64)
PEAK_PROBE = """
import json, sys, torch
from pathlib import Path
from quantkit.reload import load_quantized

def status(key):  # kB
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1])

load_quantized(sys.argv[1], dtype=torch.float16)  # the first load imports the model's code
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current resident set
before = status("VmRSS:")
model, _ = load_quantized(sys.argv[1], dtype=torch.float16)
print(json.dumps({"grew_mib": (status("VmHWM:") - before) / 1024}))
"""


def _wide_export(folder: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(WIDE, dtype=torch.float16).eval()
    config = QuantConfig(method="rtn", group_size=128)
    quantize_model(model, get_adapter(model), None, config, device="cpu", show_progress=False)
    return export_checkpoint(model, None, folder, config, "compressed-tensors", dtype="float16")


def test_reload_never_holds_the_fp_weights(tmp_path) -> None:
    """A load's peak resident memory grows by the export's size and a little (measured 88-96 MiB for this 68 MiB
    export), never by the fp16 weights' 256 MiB (the whole-model reload it replaced: 275 MiB)."""
    folder = _wide_export(tmp_path / "wide")
    fp16_mib = sum(m.in_features * m.out_features for m in quantized_modules(
        load_quantized(folder, dtype=torch.float16)[0]).values()) * 2 / 2**20
    export_mib = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    run = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(folder)], capture_output=True, text=True,
                         timeout=300, check=True)
    grew = json.loads(run.stdout.strip().splitlines()[-1])["grew_mib"]
    assert fp16_mib > 3 * export_mib
    assert grew < export_mib + 0.25 * (fp16_mib - export_mib), (grew, export_mib, fp16_mib)


def test_reload_reads_shards_without_an_index(tmp_path) -> None:
    """Other tools' exports: *.safetensors files under any name, no index."""
    torch.manual_seed(0)
    small = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=32, vocab_size=64, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(small).eval()
    config = QuantConfig(method="rtn", group_size=32)
    quantize_model(model, get_adapter(model), None, config, device="cpu", show_progress=False)
    folder = export_checkpoint(model, None, tmp_path / "one", config, "gptq", dtype="float16")
    (folder / "model.safetensors").rename(folder / "gptq_model-4bit-32g.safetensors")
    reloaded, _ = load_quantized(folder, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    original, _ = load_quantized(export_checkpoint(model, None, tmp_path / "two", config, "gptq", dtype="float16"),
                                 dtype=torch.float32)
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)
