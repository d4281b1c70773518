"""Triton GEMM kernels for quantized linears (imported as quantkit.kernels).

`make_kernel_forward(layer)` returns a fast forward for a QuantLinear (W4A16, or W4A8 when act_bits == 8),
or None with the reason logged when the layer's shape or scheme has no kernel. The kernels run as the
custom ops torch.ops.quantkit.w4a16_linear / w4a8_linear, so torch.compile treats them as opaque calls and
CUDA graphs capture their launches (no host syncs; per-call allocations only through PyTorch's allocator).
Triton is imported lazily: importing this package never needs it.

The package, from the ground up (a module imports only those above it; the house test checks it):
  layout.py        weight and activation layouts (nibble packing, swap layouts, int8 tokens): torch only
  spec.py          TileConfig, Problem, KernelSpec, the split heuristics: plain Python
  common.py        the Triton kernels' shared helpers; gluon_common.py the Gluon (Hopper) ones
  w4a16*.py, w4a8*.py  one kernel family each, declaring its KernelSpecs (SPECS); none imports another
  moe_w4a16.py, moe_w4a8.py  the grouped W4A16 / W4A8 GEMMs over an MoE layer's routed tokens (every expert in
                   one launch) and the block forwards quantkit.models.moe runs on CUDA (registry.MOE_FORWARDS);
                   outside the dense registry, their own candidates (common.py)
  registry.py      every kernel's spec, the one list; autotune.py the tuner's candidates and cache over it
  api.py           the entry points above, re-exported here
"""

# Python started in the repository root puts this folder on sys.path as a top-level `kernels`, the name of the
# PyPI package transformers imports: handed over to that package where it is installed, so the checkout imports as
# an install does. Where it is not (vLLM's own environment), this folder stays what `kernels` names, as before.
_spec = None
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
if _spec is not None and _spec.loader is not None:
    sys.modules[__name__] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[__name__])
else:
    from .api import (  # noqa: F401 - the package's interface
        SWAP_BLOCK,
        decode_attention_for,
        decode_attention_rows,
        keeps_plain_copy,
        make_kernel_forward,
        swap_block,
        swap_weight_for,
        two_level_int8_overflow,
        unsupported_reason,
        w4a8_operands,
        w4a8_run,
        w4a16_run,
    )
