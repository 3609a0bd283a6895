"""Native ``vllm/v1/sample/ops/topk_topp_triton.py``: ``_topk_topp_kernel``.

The kernel is not exact top-p: its pivot is an fp32 bisection over probabilities that stops after 18 steps or at
a 1e-9 bracket, "duplicates" are values within 1e-9 counted tile by tile, and the cut goes back to logits via
log/exp. So this replays its algorithm, rows vectorised: same passes, tiles, fp32 operation order, uint32
wrap-around and stopping rules, with exp/log/sums in numpy as Triton's interpreter computes them. Sorted copies
and an fp64 error bound skip tile passes whose outcome is already decided. The scratch ``BUFFER`` is not written:
the kernel reads only what it wrote for the same row, and nothing else reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from mmcpu.kernels.dispatch import native

F32 = np.float32
EPS = F32(1e-9)
INF = F32(np.inf)
U32 = 0xFFFFFFFF
MAX_ITERS = 18
_DELTA = F32(3e-9)  # values closer than this above a minimum can join its chained 1e-9 count
_WINDOW = 4096
_LITERAL = False  # tests: replay every statistic over the tiles instead of using the sorted shortcuts


def _u32_of_f32(v: np.ndarray) -> np.ndarray:
    """fp32 -> uint32 as the interpreter casts a scalar: truncate through int64, keep the low 32 bits."""
    v64 = v.astype(np.float64)
    ok = np.isfinite(v64) & (np.abs(v64) < 2.0**63)
    return np.trunc(np.where(ok, v64, 0.0)).astype(np.int64) & U32


def _i32_of_f32(v: np.ndarray) -> np.ndarray:
    """fp32 -> int32 as the interpreter casts a scalar: out of range or NaN gives INT32_MIN."""
    v64 = v.astype(np.float64)
    ok = np.isfinite(v64) & (v64 > -(2.0**31) - 1) & (v64 < 2.0**31)
    return np.where(ok, np.trunc(np.where(ok, v64, 0.0)), -(2.0**31)).astype(np.int64)


def _tiles(a: np.ndarray, ts: int, fill: float) -> np.ndarray:
    """[b, n] -> [b, nt, ts], padded with the kernel's masked-load value; at least one tile."""
    b, n = a.shape
    nt = max(1, -(-n // ts))
    if n == nt * ts and a.flags.c_contiguous:
        return a.reshape(b, nt, ts)
    out = np.full((b, nt * ts), fill, dtype=F32)
    out[:, :n] = a
    return out.reshape(b, nt, ts)


def _seq_sum(v3: np.ndarray) -> np.ndarray:
    """A kernel's ``acc += tl.sum(tile)``: pairwise sum inside each tile, then fp32 tile by tile."""
    return np.add.accumulate(np.sum(v3, axis=-1, dtype=F32), axis=1, dtype=F32)[:, -1]


def _min_larger(d3: np.ndarray, above: np.ndarray, sentinel: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``_update_min_larger_stats`` chained over the tiles, in closed form.

    The chain keeps the running min exactly; its count restarts at the first tile holding the global min and
    then adds the counts of later tiles whose own min is within 1e-9 of it.
    """
    tm = np.where(above, d3, sentinel).min(axis=-1)
    tc = (above & (np.abs(d3 - tm[..., None]) < EPS)).sum(axis=-1)
    m = tm.min(axis=1)
    first = np.argmax(tm == m[:, None], axis=1)
    later = np.arange(tm.shape[1])[None, :] >= first[:, None]
    cnt = (tc * ((np.abs(tm - m[:, None]) < EPS) & later)).sum(axis=1)
    return m, cnt.astype(np.int64)


class _Layout:
    """One pivot search's data laid out as the kernel tiles it, plus a sorted copy for fast statistics.

    Counts above a pivot and the smallest value above it come from the sorted copy; the kernel's chained
    1e-9 "duplicate" count needs the tiles only when distinct values sit within 1e-9 of that minimum, and then
    only the tiles of the values just above it (or the literal tile pass when there are very many).
    """

    def __init__(self, data: np.ndarray, ts: int, fill: float, sentinel: np.float32):
        self.d3 = _tiles(data, ts, fill)
        b, self.nt, _ = self.d3.shape
        self.L, self.ts, self.S = self.nt * ts, ts, sentinel
        self.s = np.sort(self.d3.reshape(b, self.L), axis=1)
        self.st = torch.from_numpy(self.s)
        self.top = np.zeros((b, 1))  # top[:, n]: fp64 mass of each row's n largest values (grown lazily)

    def _pos(self, v: np.ndarray) -> np.ndarray:
        """Per row, the number of values <= v (so values above v start there)."""
        q = torch.from_numpy(np.ascontiguousarray(v, dtype=F32)[:, None])
        return torch.searchsorted(self.st, q, right=True).numpy()[:, 0]

    def stats(self, v: np.ndarray):
        """Per row: count above v, its sorted position, the min above v (or the sentinel), and the chained
        count of that min where it is just its number of copies (``clean``); :meth:`count` does the rest."""
        L, r = self.L, np.arange(v.size)
        if _LITERAL:
            d = self.d3
            above = d > v[:, None, None]
            m, c = _min_larger(d, above, self.S)
            n = above.sum(axis=(1, 2))
            return n, L - n, m, c, np.ones(v.size, bool)
        pos = self._pos(v)
        has = pos < L
        m = np.where(has, self.s[r, np.minimum(pos, L - 1)], self.S)
        nxt = self._pos(m)
        # The next larger value is >= 1e-9 away: no other tile can join the min's count.
        clean = ~has | (nxt >= L) | ((self.s[r, np.minimum(nxt, L - 1)] - m) >= EPS)
        return L - pos, pos, m, np.where(has, nxt - pos, 0).astype(np.int64), clean

    def count(self, need: np.ndarray, v, pos, m, c, clean) -> np.ndarray:
        """The chained count ``c``, made exact for the ``need`` rows."""
        todo = np.nonzero(need & ~clean)[0]
        if todo.size:
            c = c.copy()
            c[todo] = self._window(todo, pos[todo], m[todo], v[todo])
        return c

    def _window(self, rows, pos, m, v):
        """Chained count from the values in [min, min + _DELTA) alone: only their tiles can take part."""
        flat = self.d3.reshape(self.d3.shape[0], self.L)
        c = np.zeros(rows.size, np.int64)
        for i, row in enumerate(rows):
            d = flat[row]
            idx = np.flatnonzero((d > v[i]) & ((d - m[i]) < _DELTA))  # index order, so tiles ascend
            if idx.size > _WINDOW:  # many: the literal tile pass
                c[i] = _min_larger(self.d3[row : row + 1], self.d3[row : row + 1] > v[i], self.S)[1][0]
                continue
            e, tiles = d[idx], idx // self.ts
            starts = np.flatnonzero(np.r_[True, tiles[1:] != tiles[:-1]])
            tm = np.minimum.reduceat(e, starts)  # each window tile's min (its other values are >= min + _DELTA)
            tm_e = np.repeat(tm, np.diff(np.r_[starts, e.size]))
            first = tiles[e == m[i]].min()
            c[i] = ((np.abs(e - tm_e) < EPS) & (np.abs(tm_e - m[i]) < EPS) & (tiles >= first)).sum()
        return c

    def exact_sum(self, v: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The kernel's fp32 mass above v (tile sums accumulated in order) for ``rows``."""
        d = self.d3 if rows.size == self.d3.shape[0] else self.d3[rows]
        return _seq_sum(d * (d > v[rows, None, None]))

    def mass(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """fp64 mass above each row's sorted position, and a bound on how far the kernel's fp32 sum can be."""
        if _LITERAL:
            return np.zeros(pos.size), np.full(pos.size, np.inf)
        n = self.L - pos
        done = self.top.shape[1] - 1
        if n.max() > done:  # pivots rarely go deep: sum the largest values only as far as needed
            w = min(self.L, max(int(n.max()), 2 * done, 1024))
            more = np.cumsum(self.s[:, ::-1][:, done:w], axis=1, dtype=np.float64) + self.top[:, -1:]
            self.top = np.concatenate([self.top, more], axis=1)
        mass = self.top[np.arange(n.size), n]
        # Pairwise tile sums (depth <= 20) then nt sequential adds: at most (nt + 20) roundings of 2^-24.
        return mass, (self.nt + 48) * 2.0**-24 * mass + 1e-10


def _search_k(lay: _Layout, k: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """The top-k ternary pivot search: k_pivot, count above it, min_larger, its count."""
    b = k.size
    kp, ml = np.full(b, INF), np.full(b, INF)
    kpn, nml = np.zeros(b, np.int64), np.zeros(b, np.int64)
    lo, hi = lo.copy(), hi.copy()
    act = np.ones(b, bool)
    it = 0
    while act.any():
        p0 = (hi - lo) * F32(1.0) / F32(3.0) + lo
        p1 = (hi - lo) * F32(2.0) / F32(3.0) + lo
        st0, st1 = lay.stats(p0), lay.stats(p1)
        n0, n1, m0, m1 = st0[0], st1[0], st0[2], st1[2]
        lo_n = np.where(n1 > k, p1, np.where(n0 > k, p0, lo))
        hi_n = np.where(n0 < k, p0, np.where(n1 < k, p1, hi))
        it += 1
        stop = (np.abs(lo_n - hi_n) < EPS) | (it >= MAX_ITERS)
        # Counts are needed where a pivot may be found, and pivot 0's when the search gives up.
        c0 = lay.count(act & ((n0 >= k) | stop), p0, *st0[1:])
        c1 = lay.count(act & (n1 >= k), p1, *st1[1:])
        f0 = (n0 >= k) & (n0 - c0 < k)
        f1 = (n1 >= k) & (n1 - c1 < k)
        kp_n = np.where(f1, p1, np.where(f0, p0, kp))
        kpn = np.where(act & f1, n1, np.where(act & f0, n0, kpn))
        ml_n = np.where(f1, m1, np.where(f0, m0, ml))
        nml_n = np.where(f1, c1, np.where(f0, c0, nml))
        kp = np.where(act, np.where(stop, (hi_n + lo_n) / F32(2.0), kp_n), kp)
        ml = np.where(act, np.where(stop, m0, ml_n), ml)
        nml = np.where(act, np.where(stop, c0, nml_n), nml)
        lo, hi = np.where(act, lo_n, lo), np.where(act, hi_n, hi)
        act &= ~(f0 | f1 | stop)
    return kp, kpn, ml, nml


def _search_p(lay: _Layout, p: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """The top-p bisection: p_pivot, min_larger prob, its count, mass above.

    The kernel's fp32 mass is computed (literally, over the tiles) only where a comparison with p is too
    close to call from the fp64 mass and its error bound, and for the final step, whose mass feeds num_keep.
    """
    b = p.size
    pp, ml = np.ones(b, F32), np.ones(b, F32)
    nml, ps = np.zeros(b, np.int64), np.zeros(b, F32)
    lo, hi = lo.copy(), hi.copy()
    p64 = p.astype(np.float64)
    act = np.ones(b, bool)
    it = 0
    while act.any():
        pv = (hi - lo) * F32(0.5) + lo
        st = lay.stats(pv)
        m0 = st[2]
        mass, err = lay.mass(st[1])
        s0, exact = np.zeros(b, F32), np.zeros(b, bool)

        def make_exact(mask):
            rows = np.nonzero(mask & ~exact)[0]  # noqa: B023
            if rows.size:
                s0[rows] = lay.exact_sum(pv, rows)  # noqa: B023
                exact[rows] = True  # noqa: B023

        sure_gt, sure_lt = mass - p64 > err, p64 - mass > err
        make_exact(act & ~sure_gt & ~sure_lt)
        gt = np.where(exact, s0 > p, sure_gt)
        lt = np.where(exact, s0 < p, sure_lt)
        lo_n = np.where(gt, pv, lo)
        hi_n = np.where(~gt & lt, pv, hi)
        it += 1
        stop = ((hi_n - lo_n) < EPS) | (it >= MAX_ITERS)
        ge = np.where(exact, s0 >= p, sure_gt)
        c0 = lay.count(act & (ge | stop), pv, *st[1:])
        mc = m0 * c0.astype(F32)
        d2 = mass - mc.astype(np.float64)
        e2 = err + 2.0**-24 * (np.abs(d2) + err) + 1e-12
        make_exact(act & ge & ~(d2 + e2 < p64) & ~(d2 - e2 >= p64))
        found = ge & np.where(exact, s0 - mc < p, d2 + e2 < p64)
        fin = act & (found | stop)
        make_exact(fin)  # the final step's mass is kept: make it the kernel's
        pp = np.where(fin, np.where(stop, (hi_n + lo_n) / F32(2.0), pv), pp)
        ml, nml, ps = np.where(fin, m0, ml), np.where(fin, c0, nml), np.where(fin, s0, ps)
        lo, hi = np.where(act, lo_n, lo), np.where(act, hi_n, hi)
        act &= ~fin
    return pp, ml, nml, ps


def _rows(a: np.ndarray, r: np.ndarray) -> np.ndarray:
    # r comes from np.nonzero (ascending, unique): all rows means a itself, no copy.
    return a if r.size == a.shape[0] else a[r]


def _compact(vals: np.ndarray, mask: np.ndarray, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``vals[mask]`` in index order, left-aligned and padded: the kernel's buffer gathering."""
    cnt = mask.sum(axis=1)
    out = np.full((vals.shape[0], int(cnt.max(initial=0))), fill, dtype=F32)
    out[np.arange(out.shape[1])[None, :] < cnt[:, None]] = vals[mask]
    return out, cnt


def _dup_ranks(vals: np.ndarray, dup: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Within-1e-9 matches of each row's ``dup`` and their running count (the kernel's num_kept cumsum)."""
    m = np.abs(vals - dup[:, None]) < EPS
    return m, np.cumsum(m, axis=1)


def _block0_stats(x: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of the finite logits of the first BLOCK_SIZE lanes (the kernel's zeroth pass)."""
    blk = _tiles(x[:, :bs], bs, -np.inf)[:, 0]
    fin = blk > -np.inf
    nf = fin.sum(axis=1).astype(F32)
    fl = np.where(fin, blk, F32(0.0))
    avg = np.where(nf > 0, np.sum(fl, axis=1, dtype=F32) / nf, F32(0.0))
    sq = np.where(nf > 0, np.sum(fl * fl, axis=1, dtype=F32) / nf, F32(0.0))
    return avg, np.sqrt(np.maximum(sq - avg * avg, F32(0.0)))


@native(
    "vllm.v1.sample.ops.topk_topp_triton",
    "_topk_topp_kernel",
    sha256="539ec5f2f0f9f2875500c41022a65414960beae210562c4def55ba945cc84a36",
)
def _topk_topp_kernel(
    grid,
    LOGITS,
    LOGITS_STRIDE_0,
    BUFFER,
    PERCENTILE_TO_STD_TABLE,
    NORMAL_CDF_TO_SIGMA_TABLE,
    K,
    P,
    BATCH_SIZE,
    VOCAB_SIZE,
    MASK_VALUE,
    BLOCK_SIZE,
    BLOCK_SIZE_TRUNC,
    TOPK_ENABLED,
    TOPP_ENABLED,
    SPLIT_COVERS_PONLY,
):
    # The kernel loads logits in their own dtype; its launcher admits fp32 only, which is what this computes in.
    # Every row < BATCH_SIZE is handled exactly once whatever the grid; only the scratch row would differ.
    B, V, BS, BT = int(BATCH_SIZE), int(VOCAB_SIZE), int(BLOCK_SIZE), int(BLOCK_SIZE_TRUNC)
    if B == 0:
        return
    view = LOGITS.as_strided((B, V), (int(LOGITS_STRIDE_0), 1))
    with np.errstate(all="ignore"):
        keep, rows = _keep_mask(
            view,
            B,
            V,
            BS,
            BT,
            PERCENTILE_TO_STD_TABLE,
            NORMAL_CDF_TO_SIGMA_TABLE,
            K if TOPK_ENABLED else None,
            P if TOPP_ENABLED else None,
            bool(SPLIT_COVERS_PONLY and TOPK_ENABLED),
        )
    if rows.size:
        # Masked lanes get MASK_VALUE as the kernel stores it: an fp32 constant, then cast to the logits dtype.
        fill = torch.tensor(float(F32(MASK_VALUE)), dtype=torch.float32).to(view.dtype)
        if rows.size == B:
            drop = ~keep[:, :V]
        else:
            drop = np.zeros((B, V), bool)
            drop[rows] = ~keep[:, :V]
        if view.dtype == torch.float32:
            np.putmask(view.numpy(), drop, F32(MASK_VALUE))  # in place, through the shared memory
        else:
            view.masked_fill_(torch.from_numpy(drop), fill)


def _keep_mask(view, B, V, BS, BT, pct_table, cdf_table, K, P, split_covers_ponly=False):
    """(keep mask of the rows the kernel rewrites, those rows' indices). ``split_covers_ponly``: the split top-p
    pipeline (CUDA only) handles the rows without an active top-k (k >= vocab), so standalone top-p skips them."""
    # fp32 copy padded to whole BLOCK_SIZE tiles with the kernel's masked-load value, so tiles are views.
    x = np.full((B, max(1, -(-V // BS)) * BS), -INF)
    x[:, :V] = view.detach().to(torch.float32).numpy()
    valid = np.arange(x.shape[1]) < V
    fin_min = np.min(x, axis=1, where=x > -np.inf, initial=np.inf)  # min over finite logits (inf if none)
    final = np.full(B, -INF)
    dup_logit = np.full(B, INF)
    num_dup, num_keep = np.zeros(B, np.int64), np.zeros(B, np.int64)
    max_logit, min_logit = np.full(B, -INF), np.full(B, INF)

    if K is not None:
        k = K[:B].to(torch.int64).numpy()
        ku = k & U32  # the kernel compares k with uint32 counts
        r = np.nonzero(k < V)[0]
        if r.size:
            xr, kr = _rows(x, r), ku[r]
            avg, std = _block0_stats(xr, BS)
            pct = np.minimum(_u32_of_f32(k[r].astype(F32) / F32(V) * F32(200)), 199)
            sigma = pct_table.to(torch.float32).numpy()[pct]
            sigma = sigma + np.abs(sigma) * F32(-0.15)
            opiv = avg + std * sigma
            max_logit[r] = xr.max(axis=1)
            min_logit[r] = np.minimum(fin_min[r], max_logit[r])
            n_fin = (xr > -np.inf).sum(axis=1)
            omask = xr > opiv[:, None]
            n_out = omask.sum(axis=1)

            kp, kpn = np.empty(r.size, F32), np.empty(r.size, np.int64)
            ml, nml = np.empty(r.size, F32), np.empty(r.size, np.int64)
            buf_path = n_out > kr
            for sel, on_buf in ((np.nonzero(buf_path)[0], True), (np.nonzero(~buf_path)[0], False)):
                if not sel.size:
                    continue
                if on_buf:  # pivot search over the gathered outliers, from the outlier pivot up
                    data, ts, lo = _compact(xr[sel], omask[sel], -np.inf)[0], BT, opiv[sel]
                else:  # gathering failed: the whole row, from its finite min up
                    data, ts, lo = xr[sel], BS, min_logit[r[sel]]
                kp[sel], kpn[sel], ml[sel], nml[sel] = _search_k(
                    _Layout(data, ts, -np.inf, INF), kr[sel], lo, max_logit[r[sel]]
                )
            dup_logit[r], num_dup[r] = ml, nml
            num_keep[r] = (nml - ((kpn - kr) & U32)) & U32
            has_more = n_fin > kr
            final[r] = np.where(has_more, kp, -INF)

            if P is not None:
                p_r = P[:B].to(torch.float32).numpy()[r]
                s = np.nonzero(has_more & (p_r < F32(1.0)))[0]
                if s.size:
                    _topk_then_topp(
                        s,
                        r,
                        xr,
                        kr,
                        kp,
                        omask,
                        buf_path,
                        p_r,
                        BT,
                        BS,
                        final,
                        dup_logit,
                        num_dup,
                        num_keep,
                        max_logit,
                        min_logit,
                    )

    if P is not None:
        p = P[:B].to(torch.float32).numpy()
        standalone = (final == -INF) & (p < F32(1.0))
        if split_covers_ponly:
            standalone &= K[:B].to(torch.int64).numpy() < V
        r = np.nonzero(standalone)[0]
        if r.size:
            _topp_alone(
                r,
                _rows(x, r),
                p[r],
                BS,
                BT,
                cdf_table,
                final,
                dup_logit,
                num_dup,
                num_keep,
                max_logit,
                min_logit,
                fin_min[r],
                valid,
            )

    # Sixth pass: keep logits above the pivot; of the pivot's duplicates keep only the first num_keep.
    rows = np.nonzero((final < max_logit) & (final != -INF))[0]
    if not rows.size:
        return np.zeros((0, V), bool), rows
    xm = _rows(x, rows)
    keep = xm > final[rows, None]
    d = np.nonzero(num_keep[rows] < num_dup[rows])[0]
    if d.size:
        m, rank = _dup_ranks(xm[d], dup_logit[rows[d]])
        keep[d] &= ~(m & (rank > num_keep[rows[d], None]))
    return keep, rows


def _topk_then_topp(
    s, r, xr, kr, kp, omask, buf_path, p_r, BT, BS, final, dup_logit, num_dup, num_keep, max_logit, min_logit
):
    """Top-p over the top-k survivors (the kernel's third to fifth passes after a top-k pivot)."""
    rows = r[s]
    min_logit[rows] = kp[s]
    mx = max_logit[rows]
    sum_exp = np.empty(s.size, F32)
    probs_list = [None, None]
    groups = (np.nonzero(buf_path[s])[0], np.nonzero(~buf_path[s])[0])
    for gi, g in enumerate(groups):
        if not g.size:
            continue
        gr = rows[g]
        lo_logit, dl, nk, nd = kp[s[g]], dup_logit[gr], num_keep[gr], num_dup[gr]
        if gi == 0:  # survivors from the outlier buffer; dedup only when the top-k cut splits a tie
            vals, cnt = _compact(xr[s[g]], omask[s[g]], -np.inf)
            inr = np.arange(vals.shape[1])[None, :] < cnt[:, None]
            om = (vals > lo_logit[:, None]) & inr
            chk = nk < nd
            m, rank = _dup_ranks(vals, dl)
            om &= ~(m & (rank > nk[:, None]) & chk[:, None])
            e = np.exp(np.where(om, vals, -INF) - mx[g, None])
            sum_exp[g] = _seq_sum(_tiles(e, BT, 0.0))
            probs_list[gi] = np.where(inr, np.exp(vals - mx[g, None]) / sum_exp[g, None], F32(0.0))
        else:  # whole-row retry: dedup always, survivors' exp gathered into the buffer
            vals = xr[s[g]]
            om = vals > lo_logit[:, None]
            m, rank = _dup_ranks(vals, dl)
            om &= ~(m & (rank > nk[:, None]))
            e = np.exp(np.where(om, vals, -INF) - mx[g, None])
            sum_exp[g] = _seq_sum(_tiles(e, BS, 0.0))
            probs_list[gi] = _compact(e, om, 0.0)[0] / sum_exp[g, None]
    for gi, g in enumerate(groups):
        if not g.size:
            continue
        gr, se = rows[g], sum_exp[g]
        hi = np.exp(mx[g] - mx[g]) / se
        lo = np.exp(min_logit[gr] - mx[g]) / se
        pp, ml, nml, ps = _search_p(_Layout(probs_list[gi], BT, 0.0, F32(1.0)), p_r[s[g]], lo, hi)
        _set_p_result(gr, pp, ml, nml, ps, p_r[s[g]], se, mx[g], final, dup_logit, num_dup, num_keep)


def _topp_alone(r, xr, p, BS, BT, cdf_table, final, dup_logit, num_dup, num_keep, max_logit, min_logit, fin_r, valid):
    """Standalone top-p (rows without a top-k pivot)."""
    avg, std = _block0_stats(xr, BS)
    ms = avg + std * F32(10.0)
    e = np.exp(xr - ms[:, None])
    sum_exp = _seq_sum(_tiles(e, BS, 0.0))
    max_logit[r] = np.maximum(max_logit[r], xr.max(axis=1))
    min_logit[r] = np.minimum(np.minimum(min_logit[r], fin_r), max_logit[r])
    idx = np.clip(_i32_of_f32(p * F32(200)), 0, 199)
    sigma = cdf_table.to(torch.float32).numpy()[idx]
    sigma = sigma + np.abs(sigma) * F32(-0.25)
    opiv = avg + std * sigma
    oprob = np.exp(opiv - ms) / sum_exp
    probs = e / sum_exp[:, None]
    omask = (probs > oprob[:, None]) & valid
    s_out = _seq_sum(_tiles(omask * probs, BS, 0.0))
    hi = np.exp(max_logit[r] - ms) / sum_exp
    lo = np.exp(min_logit[r] - ms) / sum_exp
    buf = s_out > p
    for g, on_buf in ((np.nonzero(buf)[0], True), (np.nonzero(~buf)[0], False)):
        if not g.size:
            continue
        if on_buf:  # bisection over the gathered outlier probabilities, from the outlier prob up
            data, ts, lo_g = _compact(probs[g], omask[g], 0.0)[0], BT, oprob[g]
        else:  # bisection over every probability
            data, ts, lo_g = probs[g], BS, lo[g]
        pp, ml, nml, ps = _search_p(_Layout(data, ts, 0.0, F32(1.0)), p[g], lo_g, hi[g])
        _set_p_result(r[g], pp, ml, nml, ps, p[g], sum_exp[g], ms[g], final, dup_logit, num_dup, num_keep)


def _set_p_result(rows, pp, ml, nml, ps, p, sum_exp, shift, final, dup_logit, num_dup, num_keep):
    # Back from probabilities to logits: pivot, the boundary "duplicate" value and how many of it to keep.
    dup_logit[rows] = np.log(ml * sum_exp) + shift
    num_dup[rows] = nml
    num_keep[rows] = (nml - _u32_of_f32((ps - p) / ml)) & U32
    final[rows] = np.log(pp * sum_exp) + shift
