"""Small Triton functions the pack's kernels share, and their ``triton``/``tl`` (None without triton). The functions
are decorated with ``triton.jit`` when this module is imported, so the process's ``TRITON_INTERPRET`` must be set
before, as for every Triton import."""
try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton: the kernels that call these never run
    triton = tl = None
round_bf16 = merge_row_stats = rms_row = inv_rms = tile_rows = head_rows = row_moments = normalised = None

if tl is not None:
    @triton.jit
    def round_bf16(x):
        """float32 x to the bf16 grid, ties to even (the GPU's conversion; the interpreter's truncates), as
        float32."""
        u = x.to(tl.uint32, bitcast=True)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def tile_rows(n_rows, YBLOCK: tl.constexpr):
        """The YBLOCK rows of this program (axis 0 of the grid: one tile of rows each) as int64, and which of them
        exist (< n_rows)."""
        rows = tl.program_id(0) * YBLOCK + tl.arange(0, YBLOCK)
        return rows.to(tl.int64), rows < n_rows

    @triton.jit
    def head_rows(n_rows, H, YBLOCK: tl.constexpr):
        """This program's batch and head (axis 1 of the grid: one program per (batch, head)) as int64, and its
        YBLOCK rows of that head and which of them exist (``tile_rows``)."""
        bh = tl.program_id(1)
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        return (bh // H).to(tl.int64), (bh % H).to(tl.int64), rows64, row_ok

    @triton.jit
    def merge_row_stats(mean, m2, count, v, mask):
        """The running (mean, M2, count) of each row merged with the masked values ``v`` [rows, block] of one more
        step over the row (Chan et al.: stable in float32)."""
        n_b = tl.sum(mask.to(tl.float32), axis=1)
        c_mean = tl.sum(v, axis=1) / tl.maximum(n_b, 1.0)
        dev = tl.where(mask, v - c_mean[:, None], 0.0)
        c_m2 = tl.sum(dev * dev, axis=1)
        total = tl.maximum(count + n_b, 1.0)
        delta = c_mean - mean
        return (mean + delta * (n_b / total), m2 + c_m2 + delta * delta * (count * n_b / total), count + n_b)

    @triton.jit
    def row_moments(v, mask, D, eps):
        """(mean, 1 / sqrt(variance + eps)) of whole rows v [rows, RBLOCK >= D] (0 outside ``mask``) held in
        registers: the mean, then the squared deviations from it (float32)."""
        mean = tl.sum(v, axis=1) / D
        dev = tl.where(mask, v - mean[:, None], 0.0)
        return mean, 1.0 / tl.sqrt(tl.sum(dev * dev, axis=1) / D + eps)

    @triton.jit
    def normalised(v, mean, rstd, w_ptr, b_ptr, sh_ptr, sc_ptr, cols, col_ok, mod_offs, mask,
                   AFFINE: tl.constexpr, BIAS: tl.constexpr, MODULATE: tl.constexpr, ROUND_BF16: tl.constexpr):
        """LayerNorm's output of rows v [rows, block] with their (mean, 1 / std) [* weight + bias] [* (1 + scale)
        + shift] in float32 (the interpreter: on the bf16 grid, as the GPU rounds)."""
        h = (v - mean[:, None]) * rstd[:, None]
        if AFFINE:
            h = h * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if BIAS:
                h = h + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if MODULATE:
            sc = tl.load(sc_ptr + mod_offs, mask=mask, other=0.0).to(tl.float32)
            h = h * (1.0 + sc) + tl.load(sh_ptr + mod_offs, mask=mask, other=0.0).to(tl.float32)
        if ROUND_BF16:
            h = round_bf16(h)
        return h

    @triton.jit
    def rms_row(x_rows, w_ptr, row_ok, D, eps, RBLOCK: tl.constexpr):
        """One pass over whole rows (RBLOCK >= D): (x / rms(x) * weight in float32, the tile's mask)."""
        cols0 = tl.arange(0, RBLOCK)
        cmask = cols0 < D
        mask = row_ok[:, None] & cmask[None, :]
        v = tl.load(x_rows + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        w = tl.load(w_ptr + cols0, mask=cmask, other=0.0).to(tl.float32)
        return v * inv[:, None] * w[None, :], mask

    @triton.jit
    def inv_rms(x_rows, row_ok, D, eps, YBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
        """1 / rms of each row over the full width (float32), read in RBLOCK steps."""
        acc = tl.zeros([YBLOCK], dtype=tl.float32)
        for start in range(0, D, RBLOCK):
            cols = start + tl.arange(0, RBLOCK)
            mask = row_ok[:, None] & (cols < D)[None, :]
            v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(v * v, axis=1)
        return 1.0 / tl.sqrt(acc / D + eps)
