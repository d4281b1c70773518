"""Decode attention over a static KV cache, split along the cache (flash-decoding).

A decode step has a few query rows per kv head and a cache of hundreds to thousands of slots: one program per kv
head would leave most SMs idle, so each (kv head, cache chunk) pair gets its own program.

Shapes (quantkit.decode.StaticDecoder's): q [B, KVH, R, D] with R = group * tokens rows (row r = g * tokens + t is
query head kvh * group + g at the step's token t), cache_k / cache_v [B, KVH, L, D], positions [tokens] (int64):
row r attends to cache slots 0..positions[r % tokens], or with a sliding window W only to the last W of them
(slots > position - W, as transformers masks). Output [B, KVH, R, D] in q's dtype.

One kernel, grid (B * KVH, splits): the splits share the span of slots the step can see (the whole cache, or with a
window the W + tokens - 1 slots from the first row's window start, found on the device: no host sync), and a program
runs an online softmax over its chunk of that span in BLOCK_L-slot tiles (q k^T and p v on tensor cores, fp32
accumulation, p rounded to the cache's dtype for the second product as flash attention does; fp32 under Triton's CPU
interpreter, whose bf16 tl.dot is wrong) and writes its rows' normalised partial output and log-sum-exp (a chunk
past every row's position reads nothing: lse = -inf); the last of a kv head's programs to finish (a counter, as
w4a16's split-K) combines them, out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse), without a second
launch (which cost ~1.8 us a layer on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting, tile_counters
from .spec import decode_attention_rows

BLOCK_L = 64  # cache slots per tile
# One program per SM at most: on an H100 more splits lost everywhere (the last program reads every split's partial;
# one token at position 8192: 21 / 27 / 36 / 56 us at 1 / 2 / 4 / 8 per SM)
PROGRAMS_PER_SM = 1


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, part_ptr, lse_ptr, count_ptr, scale, rows,
                             tokens, length, chunk, window, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_L: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                             UPCAST_DOT: tl.constexpr):
    head, split = tl.program_id(0), tl.program_id(1)
    heads, splits = tl.num_programs(0), tl.num_programs(1)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    live = r < rows
    pos = tl.load(pos_ptr + r % tokens, mask=live, other=-1)
    q = tl.load(q_ptr + (head * rows + r)[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    base = 0
    if HAS_WINDOW:  # the earliest slot any row's window reaches
        base = tl.maximum(tl.min(tl.where(live, pos, length), 0) - window + 1, 0)
    start = base + split * chunk
    stop = tl.minimum(tl.max(pos, 0) + 1, length)
    if split < splits - 1:  # the last split also takes slots past the span (positions that are not consecutive)
        stop = tl.minimum(stop, start + chunk)
    cache = head.to(tl.int64) * length * HEAD_DIM
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for first in range(start, stop, BLOCK_L):
        slots = first + tl.arange(0, BLOCK_L)
        offsets = cache + slots[:, None] * HEAD_DIM + d[None, :]
        inside = (slots < stop)[:, None]
        k = tl.load(k_ptr + offsets, mask=inside, other=0.0)
        v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = slots[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible = visible & (slots[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no slot yet: exp(-inf) = 0, not NaN
        p = tl.exp(s - shift[:, None])
        rescale = tl.exp(m - shift)
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    seen = total > 0
    denominator = tl.where(seen, total, 1.0)  # a row no slot of this chunk reaches: out 0, lse -inf
    out = acc / denominator[:, None]
    out_offsets = (head * rows + r)[:, None] * HEAD_DIM + d[None, :]
    if IS_SPLIT:
        lse = tl.where(seen, m + tl.log(denominator), float("-inf"))
        row = (split * heads + head) * rows + r
        tl.store(lse_ptr + row, lse, mask=live)
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=live[:, None])
        tl.debug_barrier()  # every thread's partial is written before the release below
        if tl.atomic_add(count_ptr + head, 1, sem="acq_rel") == splits - 1:  # the last split combines them all
            out = _combined(part_ptr, lse_ptr, head, heads, splits, rows, r, d, live, HEAD_DIM, BLOCK_R)
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=live[:, None])
            tl.atomic_xchg(count_ptr + head, 0)
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _combined(part_ptr, lse_ptr, head, heads, splits, rows, r, d, live, HEAD_DIM: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s), read from L2 (.cg: never a stale L1 line).
    Every row sees its own position's slot, in some split: the max is finite."""
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(splits):
        lse = tl.load(lse_ptr + (s * heads + head) * rows + r, mask=live, other=0.0, cache_modifier=".cg")
        top = tl.maximum(top, lse)
    weights = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for s in range(splits):
        row = (s * heads + head) * rows + r
        weight = tl.exp(tl.load(lse_ptr + row, mask=live, other=0.0, cache_modifier=".cg") - top)
        part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0,
                       cache_modifier=".cg")
        acc += weight[:, None] * part
        weights += weight
    return acc / weights[:, None]


def split_count(heads: int, span: int, device: torch.device) -> int:
    """Chunks of the span per kv head: enough programs for PROGRAMS_PER_SM per SM, at least one tile each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, heads), triton.cdiv(span, BLOCK_L)))


def tile_shape(head_dim: int, rows: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps) for `rows` query rows per kv head: the fewest warps (4 or 8) with which Triton 3.6 and
    3.9 compile the tiles for sm_90 without spilling registers (the sm_90 compile test checks every head size and
    row tile). 4 warps hold Llama-3-8B's decode step (4 rows of 128: BLOCK_R 16, the H100 measurements' case);
    with 4, 128 x 32 spilled 52 bytes (Triton 3.6), 256 x 16 520 and 64 x 16 8 (Triton 3.9)."""
    block_r = max(16, triton.next_power_of_2(rows))
    eight = head_dim * block_r >= 128 * 32 or (head_dim, block_r) == (64, 16)
    return block_r, 8 if eight else 4


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int = 0, splits: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked to slots <= each row's position and, with a window > 0, > position - window)
    v; shapes in the module docstring. With a window the positions should be consecutive (a decode step, a prefill
    chunk), else the last split reads the slots past the span alone."""
    batch, kv_heads, rows, head_dim = q.shape
    length, tokens = cache_k.shape[2], positions.shape[0]
    if rows > decode_attention_rows(head_dim) or rows % tokens:
        raise ValueError(f"decode attention takes head_dim a power of two in [16, 256] and at most 64 rows (32 at "
                         f"head_dim 256) of whole tokens per kv head, not head_dim {head_dim}, {rows} rows, "
                         f"{tokens} tokens")
    if cache_k.shape != (batch, kv_heads, length, head_dim) or cache_v.shape != cache_k.shape:
        raise ValueError(f"caches {tuple(cache_k.shape)} / {tuple(cache_v.shape)} do not match q {tuple(q.shape)}")
    heads = batch * kv_heads
    if window < 0:
        raise ValueError(f"window {window}: 0 (none) or the number of slots a row sees")
    span = min(length, window + tokens - 1) if window else length
    splits = splits or split_count(heads, span, q.device)
    chunk = triton.cdiv(triton.cdiv(span, splits), BLOCK_L) * BLOCK_L
    splits = triton.cdiv(span, chunk)
    q, cache_k, cache_v = q.contiguous(), cache_k.contiguous(), cache_v.contiguous()
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    parts = torch.empty(splits, heads, rows, head_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, heads, rows, device=q.device, dtype=torch.float32)
    counters = tile_counters(q.device, heads)
    block_r, num_warps = tile_shape(head_dim, rows)
    _decode_attention_kernel[(heads, splits)](
        q, cache_k, cache_v, positions, out, parts, lse, counters, scale, rows, tokens, length, chunk, window,
        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_L=BLOCK_L, IS_SPLIT=splits > 1, HAS_WINDOW=window > 0,
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(), num_warps=num_warps)
    return out


@torch.library.custom_op("quantkit::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                        scale: float, window: int) -> torch.Tensor:
    """decode_attention as a custom op: torch.compile calls it as one opaque kernel."""
    return decode_attention(q, cache_k, cache_v, positions, scale, window)


decode_attention_op.register_fake(lambda q, *args: q.new_empty(q.shape))


def decode_attention_reference(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                               positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """The same in float64 with an explicit mask (the tests' reference)."""
    rows, tokens = q.shape[2], positions.shape[0]
    row_positions = positions[torch.arange(rows, device=q.device) % tokens][:, None]
    slots = torch.arange(cache_k.shape[2], device=q.device)[None]
    mask = (slots <= row_positions) & ((slots > row_positions - window) if window else True)
    scores = (q.double() @ cache_k.double().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ cache_v.double()).to(q.dtype)
