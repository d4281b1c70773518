"""The kernel registry: every GEMM kernel's KernelSpec (kernels/spec.py), declared in its own file and listed here,
the one place. Dispatch (kernels/__init__.py: w4a16_run / w4a8_run) and the tuner's candidates (autotune.py) are
lookups over it. Adding a kernel: its file (kernel, launch function, SPECS) and its SPECS added to KERNELS below;
the tuner then times it after the kernels that autotune.PREFERENCES ranks, until it is given a place there.

Importing this needs Triton; the Gluon kernels (Hopper) join only where Triton has Gluon's Hopper module."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import moe_w4a8, moe_w4a16, w4a8, w4a8_swap, w4a16, w4a16_swap, w8a8_fp8
from .spec import KernelSpec, Scheme

KERNELS: tuple[KernelSpec, ...] = (w4a16.SPECS + w4a16_swap.SPECS + w4a8.SPECS + w4a8_swap.SPECS
                                   + w8a8_fp8.SPECS)
try:
    from . import w4a8_wgmma, w4a16_tma_gemv, w4a16_wgmma
except ImportError:  # a Triton without Gluon's Hopper module: no Gluon kernels
    pass
else:
    KERNELS += w4a16_tma_gemv.SPECS + w4a16_wgmma.SPECS + w4a8_wgmma.SPECS
BY_NAME = {(spec.scheme, spec.name): spec for spec in KERNELS}
SWAP_LAYOUT_KERNELS = frozenset(spec.name for spec in KERNELS if spec.layout == "swap")  # read the swap-layout copy
# The grouped MoE GEMMs' block forwards (x, topk_ids, topk_weights, gate_up, down, act, configs=None), by the experts'
# scheme: apart from KERNELS, whose specs are the dense linears' candidates; quantkit.models.moe dispatches here.
MOE_FORWARDS: dict[Scheme, Callable[..., torch.Tensor]] = {"w4a16": moe_w4a16.moe_w4a16_forward,
                                                            "w4a8": moe_w4a8.moe_w4a8_forward}


def kernel(scheme: Scheme, name: str) -> KernelSpec:
    """The kernel that runs configs of this name, else a ValueError."""
    spec = registered(scheme, name)
    if spec is None:
        raise ValueError(f"no {scheme} kernel {name!r}; registered: {sorted(n for s, n in BY_NAME if s == scheme)}")
    return spec


def registered(scheme: Scheme, name: str) -> KernelSpec | None:
    return BY_NAME.get((scheme, name))
