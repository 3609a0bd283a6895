"""Native ``vllm/v1/worker/gpu/sample/gumbel.py``: temperature and Gumbel-max sampling, with the kernel's murmur3
random stream (``murmur3_hash32`` / ``murmur3_uniform32`` / ``murmur3_uniform64``) reproduced bit-exactly.

The noise and the per-block reduction run in numpy, on zero-copy views: Triton's interpreter (the reference, and
``MMCPU_KERNELS=interpreter``) computes ``tl.log`` with numpy's ``log`` and reduces with ``np.max`` /
``np.argmax``, so the same numpy calls make a seeded row's per-block values identical to the interpreter's, not
only its sampled token (torch's ``log`` differs from numpy's fp32 ``log`` in the last bit for a third of all draws).
Every uint32 operation wraps in numpy as in Triton.
"""

from __future__ import annotations

import numpy as np
import torch

from mmcpu.kernels.dispatch import native

# --------------------------------------------------------------------------------------------------------
# murmur3 (gumbel.py's _murmur3_mix / _murmur3_fmix32 / murmur3_hash32): 32-bit words, key order seed lo,
# seed hi, position lo, token offset; the seed/position prefix is per row, the offset per vocab column.

_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
DOMAIN_HI = 0x9E3779B9  # murmur3_uniform64's second hash (the high 32 bits)
DRAFT_NOISE_SALT = 1 << 30  # gumbel.py's _DRAFT_NOISE_SALT: added to a draft's position
_U32 = np.uint32


def _rotl(v: np.ndarray, shift: int) -> np.ndarray:
    return (v << _U32(shift)) | (v >> _U32(32 - shift))


def _mix_key(key: np.ndarray) -> np.ndarray:
    # _murmur3_mix's key scrambling: key * c1, rotl 15, * c2.
    return _rotl(key * _C1, 15) * _C2


def _mix(h: np.ndarray, scrambled_key: np.ndarray) -> np.ndarray:
    h = _rotl(h ^ scrambled_key, 13)
    return h * _U32(5) + _U32(0xE6546B64)


_KEYS: dict[int, np.ndarray] = {}  # scrambled offset keys 0..n-1 (they do not depend on the row): cached


def _offset_keys(n: int) -> np.ndarray:
    keys = _KEYS.get(n)
    if keys is None:
        keys = _mix_key(np.arange(n, dtype=np.uint32))
        keys.setflags(write=False)
        if len(_KEYS) < 16:
            _KEYS[n] = keys
    return keys


def hash_prefix(seed: np.ndarray, pos: np.ndarray, domain: int = 0) -> np.ndarray:
    """murmur3_hash32's state after the seed's two words and the position's low word, per row (uint32 [rows, 1])."""
    seed = np.asarray(seed, dtype=np.int64).reshape(-1, 1)
    pos = np.asarray(pos, dtype=np.int64).reshape(-1, 1)
    h = np.full(seed.shape, domain, dtype=np.uint32)
    for word in (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, pos & 0xFFFFFFFF):
        h = _mix(h, _mix_key(word.astype(np.uint32)))
    return h


# The [rows, vocab] passes below work in place (``out=``): a fresh multi-megabyte temporary per operation costs
# more in page faults than the operation itself.


def _rotl_(h: np.ndarray, tmp: np.ndarray, shift: int) -> None:
    np.left_shift(h, _U32(shift), out=tmp)
    np.right_shift(h, _U32(32 - shift), out=h)
    np.bitwise_or(h, tmp, out=h)


def _xorshift_(h: np.ndarray, tmp: np.ndarray, shift: int) -> None:
    np.right_shift(h, _U32(shift), out=tmp)
    np.bitwise_xor(h, tmp, out=h)


def murmur3_hash32(seed: np.ndarray, pos: np.ndarray, n: int, domain: int = 0) -> np.ndarray:
    """``murmur3_hash32(seed[r], pos[r], offset)`` for offsets ``0..n-1``: uint32 [rows, n]."""
    h = np.bitwise_xor(hash_prefix(seed, pos, domain), _offset_keys(n))  # the offset word's mix
    tmp = np.empty_like(h)
    _rotl_(h, tmp, 13)
    h *= _U32(5)
    h += _U32(0xE6546B64)
    h ^= _U32(16)  # the length, then _murmur3_fmix32
    _xorshift_(h, tmp, 16)
    h *= _U32(0x85EBCA6B)
    _xorshift_(h, tmp, 13)
    h *= _U32(0xC2B2AE35)
    _xorshift_(h, tmp, 16)
    return h


_F32 = np.float32


def murmur3_uniform32(seed: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """``murmur3_uniform32``: fp32 in (0, 1), from both 16-bit halves (each converts exactly; one rounding)."""
    r = murmur3_hash32(seed, pos, n)
    lo = np.empty(r.shape, np.float32)
    np.copyto(lo, r & _U32(0xFFFF), casting="unsafe")  # < 2**16: exact, as the kernel's int32 -> fp32
    np.right_shift(r, _U32(16), out=r)
    hi = np.empty(r.shape, np.float32)
    np.copyto(hi, r, casting="unsafe")
    hi *= _F32(1.52587890625e-05)
    lo += _F32(0.5)
    lo *= _F32(2.3283064365386963e-10)
    hi += lo
    return hi


def murmur3_uniform64(seed: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """``murmur3_uniform64``: fp64 in (0, 1) from the top 53 of (hi << 32 | lo)."""
    bits = murmur3_hash32(seed, pos, n, DOMAIN_HI).astype(np.uint64)
    bits <<= np.uint64(32)
    bits |= murmur3_hash32(seed, pos, n)
    bits >>= np.uint64(11)
    u = bits.astype(np.float64)
    u += 0.5
    u *= 1.1102230246251565e-16
    np.subtract(u, 1.1102230246251565e-16, out=u, where=u == 1.0)  # the largest midpoint rounds to 1.0
    return u


# _log1p_neg_stable's series coefficients, each a Python float the kernel turns into an fp32 constant.
_SERIES = [_F32(1.0 / k) for k in (8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0)] + [_F32(1.0)]


def log1p_neg_stable(value: np.ndarray) -> np.ndarray:
    """``_log1p_neg_stable``: log(1 - value) in fp32, a degree-8 series below 0.25, the direct log above."""
    poly = value * _SERIES[0]
    poly += _SERIES[1]
    for c in _SERIES[2:]:  # Horner: c + value * poly
        poly *= value
        poly += c
    poly *= value
    np.negative(poly, out=poly)  # -value * poly
    out = np.subtract(_F32(1.0), value)
    np.maximum(out, _F32(5.960464477539063e-08), out=out)
    np.log(out, out=out)
    np.copyto(out, poly, where=value < _F32(0.25))
    return out


def gumbel_noise(seed: np.ndarray, pos: np.ndarray, n: int, use_fp64: bool) -> np.ndarray:
    """``gumbel_noised_argmax``'s noise for vocab offsets ``0..n-1`` of each row: [rows, n], fp32 or fp64,
    ``-log(-log(u))`` (fp32: the inner log from ``_log1p_neg_stable`` of the uniform)."""
    x = np.log(murmur3_uniform64(seed, pos, n)) if use_fp64 else log1p_neg_stable(murmur3_uniform32(seed, pos, n))
    np.negative(x, out=x)
    np.log(x, out=x)
    np.negative(x, out=x)
    return x


# --------------------------------------------------------------------------------------------------------
# Kernels


@native(
    "vllm.v1.worker.gpu.sample.gumbel",
    "_temperature_kernel",
    sha256="47f8e146ba43476ad8d896a011a89f3e45bb82d9d14bdcf8497ce2190cf8ee22",
)
def _temperature_kernel(
    grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr, vocab_size, BLOCK_SIZE
):
    # Rows whose temperature is neither 0 nor 1: logits / temperature in fp32, stored back in the logits' dtype.
    num_tokens = grid[0]
    cols = min(vocab_size, grid[1] * BLOCK_SIZE)
    if num_tokens == 0 or cols <= 0:
        return
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    # A negative index would read before the temperature buffer in Triton (undefined); leave such rows alone.
    temp = temperature_ptr[req.clamp_min(0)].float()
    rows = ((temp != 0.0) & (temp != 1.0) & (req >= 0)).nonzero().flatten()
    if rows.numel() == 0:
        return
    logits = logits_ptr.as_strided((num_tokens, cols), (logits_stride, 1))
    logits[rows] = (logits[rows].float() / temp[rows].unsqueeze(1)).to(logits.dtype)


def _store_cache(
    cache: torch.Tensor,
    stride0: int,
    stride1: int,
    col_ptr,
    per_token_col: bool,
    req: torch.Tensor,
    valid: torch.Tensor,
    source: torch.Tensor,
    source_stride: int,
    cols: int,
) -> None:
    # Token t's raw logits row (source[t, :cols], before temperature) goes to the cache's flat memory at
    # req[t] * stride0 + col * stride1 (the kernel's address arithmetic), for valid tokens only.
    rows = valid.nonzero().flatten()
    if rows.numel() == 0 or cols <= 0:
        return
    num_tokens = req.shape[0]
    if per_token_col:
        col = col_ptr.reshape(-1)[:num_tokens][rows].long()
    else:
        col = col_ptr.reshape(-1)[0].long()
    base = req[rows] * stride0 + col * stride1
    # Programs run in token order in the interpreter, so for a destination written twice the later token wins.
    uniq, inv = torch.unique(base, return_inverse=True)
    if uniq.numel() < base.numel():
        keep = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce_(
            0, inv, torch.arange(base.numel()), "amax"
        )
        rows, base = rows[keep], base[keep]
    values = source.as_strided((num_tokens, cols), (source_stride, 1))[rows]
    flat = cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset(),), (1,))
    flat[base.unsqueeze(1) + torch.arange(cols)] = values.to(cache.dtype)


@native(
    "vllm.v1.worker.gpu.sample.gumbel",
    "_gumbel_sample_kernel",
    sha256="b94b2d5d245c6cc3280970233c7f6b0b88fba3fd16a9e01608fad0d13ac7fe68",
)
def _gumbel_sample_kernel(
    grid,
    local_argmax_ptr,
    local_argmax_stride,
    local_max_ptr,
    local_max_stride,
    logits_cache_ptr,
    logits_cache_stride_0,
    logits_cache_stride_1,
    logits_cache_col_ptr,
    logits_cache_source_ptr,
    logits_cache_source_stride,
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    seeds_ptr,
    pos_ptr,
    temp_ptr,
    vocab_size,
    BLOCK_SIZE,
    IS_DRAFTING,
    APPLY_TEMPERATURE,
    USE_FP64,
    PER_TOKEN_COL,
):
    # Per (token, vocab block): max and first argmax of the fp32 logits (divided by the temperature when
    # APPLY_TEMPERATURE) plus murmur3 Gumbel noise for temperature != 0 rows; raw logits copied to the cache.
    num_tokens, num_blocks = grid[0], grid[1]
    if num_tokens == 0 or num_blocks == 0:
        return
    width = num_blocks * BLOCK_SIZE
    cols = max(0, min(vocab_size, width))
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    valid = req >= 0
    # Invalid rows read temperature 0 and seed 0 (masked loads): plain argmax, no cache store, no noise.
    temp = torch.where(valid, temp_ptr[req.clamp_min(0)].float(), 0.0)
    if logits_cache_ptr is not None:
        _store_cache(
            logits_cache_ptr,
            int(logits_cache_stride_0),
            int(logits_cache_stride_1),
            logits_cache_col_ptr,
            PER_TOKEN_COL,
            req,
            valid,
            logits_cache_source_ptr,
            int(logits_cache_source_stride),
            cols,
        )

    # A fresh fp32 buffer padded with -inf to whole blocks: the kernel's masked load, never the caller's logits.
    xt = torch.full((num_tokens, width), float("-inf"), dtype=torch.float32)
    xt[:, :cols].copy_(logits_ptr.as_strided((num_tokens, cols), (logits_stride, 1)))
    x = xt.numpy()
    noisy = (temp != 0.0).numpy()
    rows = np.flatnonzero(noisy)
    if rows.size:
        xr = x[rows, :cols]
        if APPLY_TEMPERATURE:
            xr = xr / temp.numpy()[rows, None]
        if USE_FP64:
            xr = xr.astype(np.float64)
        seed = torch.where(valid, seeds_ptr[req.clamp_min(0)].long(), 0).numpy()[rows]
        pos = pos_ptr.reshape(-1)[:num_tokens].long().numpy()[rows]
        if IS_DRAFTING:
            pos = pos + DRAFT_NOISE_SALT
        xr = xr + gumbel_noise(seed, pos, cols, USE_FP64)
    if USE_FP64:
        x = x.astype(np.float64)
    if rows.size:
        x[rows, :cols] = xr
    blocks = x.reshape(num_tokens, num_blocks, BLOCK_SIZE)
    value, idx = blocks.max(axis=-1), blocks.argmax(axis=-1)  # the interpreter's np.max / np.argmax
    local_max_ptr.as_strided((num_tokens, num_blocks), (local_max_stride, 1)).copy_(torch.from_numpy(value))
    idx += np.arange(0, width, BLOCK_SIZE)
    local_argmax_ptr.as_strided((num_tokens, num_blocks), (local_argmax_stride, 1)).copy_(torch.from_numpy(idx))
