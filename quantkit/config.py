"""QuantConfig: every option of a quantization run, validated once, recorded in the export."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from quantkit.qtensor import QuantizationError

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SMOOTH_SEARCHES = ("refine", "grid")


@dataclass
class QuantConfig:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = True
    act_bits: int = 16  # 8: per-token dynamic int8 activations (W4A8)
    # GPTQ
    act_order: bool = False  # static groups: no g_idx permutation at inference
    damp_percent: float = 0.01
    block_size: int = 128
    mse: bool = False  # grid search of a shrunk range per group instead of plain min-max
    # AWQ / QQQ smoothing (used by the methods that smooth)
    awq_duo_scaling: bool = False
    awq_grid: int = 20
    awq_clip: bool = True
    smooth_steps: int | None = None  # QQQ thresholds; None: the reference's max(100, max|x| / 0.5)
    smooth_search: str = "refine"  # QQQ: "grid" evaluates every threshold (the reference), "refine" coarse-to-fine
    # QQQ: calibration sequences its smoothing loss runs on, rounded up to whole calibration batches (None: all)
    smooth_samples: int | None = None
    # QQQ: keep a layer group's smoothing only if it lowers the block loss after GPTQ too (not only after rounding)
    smooth_check: bool = True
    # MoE: every expert's statistics from every calibration token (the layer's output still follows the routing);
    # off: each expert's from the tokens routed to it, too few tokens handled by models/moe.py's LowTokenGuard
    moe_all_tokens: bool = False
    # modules never quantized (matched as name suffixes); lm_head and embeddings never are
    ignore: list[str] = field(default_factory=list)

    def validate(self) -> QuantConfig:
        if self.bits not in (4, 8):
            raise QuantizationError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise QuantizationError(
                f"group size must be one of {SUPPORTED_GROUP_SIZES} (-1 = per channel), got {self.group_size}"
            )
        if self.act_bits not in (8, 16):
            raise QuantizationError(f"activation bits must be 8 or 16, got {self.act_bits}")
        if self.act_bits == 8 and self.bits != 4:
            raise QuantizationError("W4A8 needs 4-bit weights (--bits 4)")
        if self.act_bits == 8 and not self.sym:
            raise QuantizationError("W4A8 needs symmetric weights (drop --asym)")
        if not 0 < self.damp_percent < 1:
            raise QuantizationError(f"damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.smooth_steps is not None and self.smooth_steps < 1:
            raise QuantizationError(f"smooth_steps must be at least 1, got {self.smooth_steps}")
        if self.smooth_search not in SMOOTH_SEARCHES:
            raise QuantizationError(f"smooth_search must be one of {SMOOTH_SEARCHES}, got {self.smooth_search!r}")
        if self.smooth_samples is not None and self.smooth_samples < 1:
            raise QuantizationError(f"smooth_samples must be at least 1, got {self.smooth_samples}")
        return self

    def label(self) -> str:
        """Short human-readable name of the scheme, e.g. 'gptq W4A16 g64 sym act-order'."""
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        order = " act-order" if self.act_order and self.method == "gptq" else ""
        return f"{self.method} W{self.bits}A{self.act_bits} {group} {'sym' if self.sym else 'asym'}{order}"

    def to_dict(self) -> dict:
        return asdict(self)
