"""Native ``vllm/v1/worker/gpu/sample/gumbel.py``: temperature and Gumbel-max sampling, with Triton's Philox
random stream (``tl.randint`` / ``tl.randint4x`` / ``tl.rand``) reproduced bit-exactly in torch int64."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native

# --------------------------------------------------------------------------------------------------------
# Triton's Philox 4x32-10 (triton/language/random.py, triton 3.6.0). uint32 values live in int64 tensors:
# a product of two uint32 is < 2**64, so int64 multiplication (which wraps) still holds its exact low 64 bits,
# and ``>> 32`` / ``& M32`` pick out umulhi and the low word.

M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
N_ROUNDS = 10
_RAND_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)  # uint_to_uniform_float's 32-bit scale


def _xor(owned: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    # ``owned ^ other``, in place when ``owned`` (a temporary of ours) already has the broadcast shape.
    if owned.shape == torch.broadcast_shapes(owned.shape, other.shape):
        return owned.bitwise_xor_(other)
    return owned ^ other


def philox(k0: torch.Tensor, k1: torch.Tensor | int, c0: torch.Tensor, c1: torch.Tensor | None = None,
           c2: torch.Tensor | None = None, c3: torch.Tensor | None = None, n_out: int = 4) -> list[torch.Tensor]:
    """Triton's ``philox_impl`` for 32-bit counters (keys broadcast against counters; a None counter is 0).

    Returns the first ``n_out`` words. Nothing is expanded up front: with per-row keys and per-column counters
    the first rounds stay rank-1 (cheap), and the last round skips the words not asked for.
    """
    k0 = torch.as_tensor(k0, dtype=torch.int64)
    k1 = torch.as_tensor(k1, dtype=torch.int64)
    for r in range(N_ROUNDS):
        last = r == N_ROUNDS - 1
        # c0' = umulhi(B, c2) ^ c1 ^ k0, c1' = lo(B * c2); c2' = umulhi(A, c0) ^ c3 ^ k1, c3' = lo(A * c0).
        if c2 is None:  # a zero counter: umulhi and lo are 0
            n0 = k0 if c1 is None else c1 ^ k0
            n1 = None
        else:
            pb = c2 * _ROUND_B
            n0 = _xor((pb >> 32).bitwise_and_(M32), k0)
            if c1 is not None:
                n0 = _xor(n0, c1)
            n1 = pb.bitwise_and_(M32) if not last or n_out >= 2 else None
        if last and n_out <= 2:
            n2 = n3 = None
        else:
            pa = c0 * _ROUND_A
            n2 = _xor((pa >> 32).bitwise_and_(M32), k1)
            if c3 is not None:
                n2 = _xor(n2, c3)
            n3 = pa.bitwise_and_(M32)
        c0, c1, c2, c3 = n0, n1, n2, n3
        k0 = (k0 + _KEY_A) & M32
        k1 = (k1 + _KEY_B) & M32
    zero = torch.zeros((), dtype=torch.int64)
    return [zero if c is None else c for c in (c0, c1, c2, c3)[:n_out]]


def _split_seed(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # philox(): seed.to(uint64), then lo/hi 32-bit words as the key (uint32/int32 seeds zero-/sign-extend).
    seed = seed.to(torch.int64)
    return seed & M32, (seed >> 32) & M32


def randint4x(seed: torch.Tensor, offset: torch.Tensor, offset_bits: int, n_out: int = 4) -> list[torch.Tensor]:
    """``tl.randint4x(seed, offset)``: four uint32 words (in int64). ``offset_bits`` is the offset's dtype width
    in the kernel (64 splits the offset into lo/hi counters, 32 leaves the hi counter 0)."""
    k0, k1 = _split_seed(seed)
    offset = offset.to(torch.int64)
    lo = offset & M32
    hi = (offset >> 32) & M32 if offset_bits > 32 else None
    return philox(k0, k1, lo, hi, n_out=n_out)


def randint(seed: torch.Tensor, offset: torch.Tensor, offset_bits: int) -> torch.Tensor:
    """``tl.randint(seed, offset)``: the first word of ``randint4x``, a uint32 (in int64)."""
    return randint4x(seed, offset, offset_bits, n_out=1)[0]


def uint32_to_uniform_float(x: torch.Tensor) -> torch.Tensor:
    """``uint_to_uniform_float`` for 32-bit words: bitcast to int32, fold negatives (-x - 1), scale in fp32."""
    x = torch.where(x >= 2**31, x ^ M32, x)  # == -(x - 2**32) - 1 for the negative int32s
    return x.to(torch.float32) * _RAND_SCALE


def rand(seed: torch.Tensor, offset: torch.Tensor, offset_bits: int) -> torch.Tensor:
    """``tl.rand(seed, offset)``: fp32 in [0, 1)."""
    return uint32_to_uniform_float(randint(seed, offset, offset_bits))


_FP32_TINY_RAND = torch.tensor(4.6566127342e-10, dtype=torch.float32)  # gumbel.py's _TL_RAND_MIN
_FP64_TINY = 2.2250738585072014e-308


def _rows(mask: torch.Tensor) -> torch.Tensor | None:
    """Row indices where ``mask`` holds, or None when it holds everywhere (so callers can work in place)."""
    if bool(mask.all()):
        return None
    return mask.nonzero().flatten()


@native("vllm.v1.worker.gpu.sample.gumbel", "_temperature_kernel",
        sha256="47f8e146ba43476ad8d896a011a89f3e45bb82d9d14bdcf8497ce2190cf8ee22")
def _temperature_kernel(grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr, vocab_size,
                        BLOCK_SIZE):
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


def _store_processed(out: torch.Tensor, out_stride: int, col_ptr, per_token_col: bool, req: torch.Tensor,
                     valid: torch.Tensor, values: torch.Tensor, vocab_size: int) -> None:
    # Row r goes to out's flat memory at req[r] * stride + col * vocab_size (the kernel's address arithmetic,
    # which ignores out's shape), for valid rows only.
    num_tokens, cols = values.shape
    rows = valid.nonzero().flatten()
    if rows.numel() == 0:
        return
    if col_ptr is None:
        col = torch.zeros((), dtype=torch.int64)
    elif per_token_col:
        col = col_ptr.reshape(-1)[:num_tokens][rows].long()
    else:
        col = col_ptr.reshape(-1)[0].long()
    base = req[rows] * out_stride + col * vocab_size
    # Programs run in token order in the interpreter, so for a destination written twice the later token wins.
    uniq, inv = torch.unique(base, return_inverse=True)
    if uniq.numel() < base.numel():
        keep = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce_(
            0, inv, torch.arange(base.numel()), "amax")
        rows, base = rows[keep], base[keep]
    flat = out.as_strided((out.untyped_storage().nbytes() // out.element_size() - out.storage_offset(),), (1,))
    flat[base.unsqueeze(1) + torch.arange(cols)] = values[rows].to(out.dtype)


def gumbel_noise(gumbel_seed: torch.Tensor, cols: int, use_fp64: bool) -> torch.Tensor:
    """Noise of ``gumbel_block_argmax`` for vocab positions ``0..cols-1`` of each row (``gumbel_seed``: [R])."""
    offsets = torch.arange(cols, dtype=torch.int64).unsqueeze(0)  # the kernel's int32 ``block``: hi counter 0
    seed = gumbel_seed.unsqueeze(1)
    if use_fp64:
        # tl_rand64: (hi << 32 | lo) -> fp64. hi * 2**32 is exact, so the one rounding of the sum is the
        # correctly rounded uint64 -> fp64 conversion; * 2**-64 is exact.
        lo, hi = randint4x(seed, offsets, 32, n_out=2)
        u = (hi.double().mul_(4294967296.0).add_(lo.double())).mul_(5.421010862427522170037e-20)
        u.clamp_min_(_FP64_TINY)
        return u.log_().neg_().log_().neg_()
    u = rand(seed, offsets, 32)
    u = torch.maximum(u, _FP32_TINY_RAND)
    # -log(-log1p(-u)): the large-noise tail from u -> 0, as the kernel does.
    return u.neg_().log1p_().neg_().log_().neg_()


@native("vllm.v1.worker.gpu.sample.gumbel", "_gumbel_sample_kernel",
        sha256="493e6ab301a3ec693e284e1ec2f7f0a2ad682d73686c6416ec2a5fbc628ef050")
def _gumbel_sample_kernel(grid, local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride,
                          processed_logits_ptr, processed_logits_stride, processed_logits_col_ptr, logits_ptr,
                          logits_stride, expanded_idx_mapping_ptr, seeds_ptr, pos_ptr, temp_ptr, vocab_size,
                          BLOCK_SIZE, APPLY_TEMPERATURE, USE_FP64, PER_TOKEN_COL):
    # Per (token, vocab block): max and first argmax of logits (+ Gumbel noise for temperature != 0 rows).
    num_tokens, num_blocks = grid[0], grid[1]
    if num_tokens == 0 or num_blocks == 0:
        return
    width = num_blocks * BLOCK_SIZE
    cols = min(vocab_size, width)
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    valid = req >= 0
    # Invalid rows read temperature 0 (masked load): plain argmax, no store, no noise.
    temp = torch.where(valid, temp_ptr[req.clamp_min(0)].float(), 0.0)

    # A fresh fp32 buffer padded with -inf to whole blocks: the kernel's masked load, never the caller's logits.
    x = torch.full((num_tokens, width), float("-inf"), dtype=torch.float32)
    xv = x[:, :cols]
    xv.copy_(logits_ptr.as_strided((num_tokens, cols), (logits_stride, 1)))
    nonzero = temp != 0.0
    if APPLY_TEMPERATURE and bool(nonzero.any()):
        rows = _rows(nonzero)
        if rows is None:
            xv.div_(temp.unsqueeze(1))
        else:
            xv[rows] = xv[rows] / temp[rows].unsqueeze(1)
    if processed_logits_ptr is not None:
        _store_processed(processed_logits_ptr, processed_logits_stride, processed_logits_col_ptr, PER_TOKEN_COL,
                         req, valid, xv, vocab_size)
    if USE_FP64:
        x = x.double()
        xv = x[:, :cols]

    if bool(nonzero.any()):
        rows = _rows(nonzero)
        sel = slice(None) if rows is None else rows
        seed = seeds_ptr[req[sel]]
        pos = pos_ptr.reshape(-1)[:num_tokens][sel]
        gumbel_seed = randint(seed, pos, pos.element_size() * 8)
        noise = gumbel_noise(gumbel_seed, cols, USE_FP64)
        if rows is None:
            xv.add_(noise)
        else:
            xv[rows] = xv[rows] + noise

    value, idx = x.view(num_tokens, num_blocks, BLOCK_SIZE).max(dim=-1)  # CPU max: first index among ties
    local_max_ptr.as_strided((num_tokens, num_blocks), (local_max_stride, 1)).copy_(value)
    idx += torch.arange(0, width, BLOCK_SIZE)
    local_argmax_ptr.as_strided((num_tokens, num_blocks), (local_argmax_stride, 1)).copy_(idx)
