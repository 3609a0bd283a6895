"""Native ``vllm/v1/worker/gpu/sample/thinking_budget.py``: a reasoning request's ``thinking_token_budget``. The
marker cache finds the last reasoning-start / natural-end marker in the committed tokens; the budget kernel adds
this step's drafts and, once the budget is spent inside an open reasoning block, forces the next token of the
end marker (logit 1e9).

Both kernels scan a few markers per request: plain Python over numpy views, program by program in the kernel's
order (a later program sees what an earlier one stored, as in Triton's interpreter).
"""

from __future__ import annotations

import numpy as np

from mmcpu.kernels.buffer_utils import flat
from mmcpu.kernels.dispatch import native


def _matches_at(row: np.ndarray, marker: list[int], start: int) -> bool:
    return all(int(row[start + j]) == m for j, m in enumerate(marker))


@native(
    "vllm.v1.worker.gpu.sample.thinking_budget",
    "_update_committed_marker_cache_kernel",
    sha256="875775ff6893b93dbd26a2f49d99e788aca8014061a1b5ea85152add91ff3a76",
)
def _update_committed_marker_cache_kernel(
    grid,
    req_ids_ptr,
    thinking_token_budget_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    total_len_ptr,
    cached_last_start_ptr,
    cached_last_end_ptr,
    cached_scan_pos_ptr,
    reasoning_start_token_ids_ptr,
    natural_reasoning_end_token_ids_ptr,
    START_LEN,
    NATURAL_END_LEN,
    MAX_LEN,
    BLOCK,
):
    n = grid[0]
    if n <= 0:
        return
    start_ids = flat(reasoning_start_token_ids_ptr)[:START_LEN].tolist()
    end_ids = flat(natural_reasoning_end_token_ids_ptr)[:NATURAL_END_LEN].tolist()
    tokens, stride = flat(all_token_ids_ptr), int(all_token_ids_stride)
    budget, total_len = flat(thinking_token_budget_ptr), flat(total_len_ptr)
    c_start, c_end, c_scan = flat(cached_last_start_ptr), flat(cached_last_end_ptr), flat(cached_scan_pos_ptr)
    for r in flat(req_ids_ptr)[:n].tolist():
        if int(budget[r]) < 0:
            continue
        total, scan = int(total_len[r]), int(c_scan[r])
        last_start, last_end = int(c_start[r]), int(c_end[r])
        if scan > total:
            scan, last_start, last_end = 0, -1, -1
        row = tokens[r * stride : r * stride + max(total, 0)]

        def found(lo: int, hi: int) -> tuple[int, int]:
            # The last start / end marker beginning in [lo, hi) and ending by total (-1: none).
            s = max((i for i in range(lo, hi) if i + START_LEN <= total and _matches_at(row, start_ids, i)), default=-1)  # noqa: B023
            ends = (i for i in range(lo, hi) if i + NATURAL_END_LEN <= total and _matches_at(row, end_ids, i))  # noqa: B023
            e = max(ends, default=-1)
            return s, e

        if scan == 0 and last_start < 0 and last_end < 0:
            # Cold scan: BLOCK-wide blocks from the end, down to the first block holding either marker.
            hi = total
            while hi > 0 and last_start < 0 and last_end < 0:
                lo = max(hi - BLOCK, 0)
                last_start, last_end = found(lo, hi)
                hi = lo
        else:
            s, e = found(scan, total)
            last_start = s if s >= 0 else last_start
            last_end = e if e >= 0 else last_end
        c_start[r], c_end[r] = last_start, last_end
        c_scan[r] = max(total - (MAX_LEN - 1), 0)


@native(
    "vllm.v1.worker.gpu.sample.thinking_budget",
    "_thinking_budget_kernel",
    sha256="2522a256cd32c407c046fefb309fc53355812605be43c45dd8bc77c67704ed98",
)
def _thinking_budget_kernel(
    grid,
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    thinking_token_budget_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    total_len_ptr,
    input_ids_ptr,
    expanded_local_pos_ptr,
    cached_last_start_ptr,
    cached_last_end_ptr,
    reasoning_start_token_ids_ptr,
    natural_reasoning_end_token_ids_ptr,
    reasoning_end_token_ids_ptr,
    START_LEN,
    NATURAL_END_LEN,
    END_LEN,
):
    n = grid[0]
    if n <= 0:
        return
    start_ids = flat(reasoning_start_token_ids_ptr)[:START_LEN].tolist()
    natural_ids = flat(natural_reasoning_end_token_ids_ptr)[:NATURAL_END_LEN].tolist()
    end_ids = flat(reasoning_end_token_ids_ptr)[:END_LEN].tolist()
    tokens, stride, inputs = flat(all_token_ids_ptr), int(all_token_ids_stride), flat(input_ids_ptr)
    budget, total_len = flat(thinking_token_budget_ptr), flat(total_len_ptr)
    c_start, c_end, local = flat(cached_last_start_ptr), flat(cached_last_end_ptr), flat(expanded_local_pos_ptr)
    logits = flat(logits_ptr)
    for t, r in enumerate(flat(expanded_idx_mapping_ptr)[:n].tolist()):
        b = int(budget[r])
        if b < 0:
            continue
        local_pos = int(local[t])
        first, total = t - local_pos, int(total_len[r])
        effective = total + local_pos

        def token(pos: int) -> int:
            # Committed tokens, then this step's drafts: input_ids at local position 0 is the last committed one.
            return int(tokens[r * stride + pos]) if pos < total else int(inputs[first + pos - total + 1])  # noqa: B023

        def last(marker: list[int], lo: int, default: int) -> int:
            hits = [
                i
                for i in range(max(lo, 0), effective - len(marker) + 1)  # noqa: B023
                if all(token(i + j) == m for j, m in enumerate(marker))
            ]
            return hits[-1] if hits else default

        last_start = last(start_ids, total - START_LEN + 1, int(c_start[r]))
        last_end = last(natural_ids, total - NATURAL_END_LEN + 1, int(c_end[r]))
        if last_start < 0 or last_start <= last_end:
            continue
        if effective - (last_start + START_LEN) < b:
            continue
        # A tail that already ends with a prefix of the end marker continues with the marker's next token.
        prefix = 0
        for k in range(1, min(END_LEN - 1, effective) + 1):
            if all(token(effective - k + j) == end_ids[j] for j in range(k)):
                prefix = k
        logits[t * int(logits_stride) + end_ids[prefix]] = 1.0e9
