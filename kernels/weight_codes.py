"""Codes for the C++ matmul kernel's int8 and int4 panels (kernels/cpu_matmul.py packs them):
numpy, on the host, at load. Groups are [.., 32, 16]: 32 consecutive inputs of one panel's
16 output columns.

    int8_groups   symmetric: a float16 scale per group, max |w| / 127, round to nearest
    grid4         a 4-bit grid per group: w = scale * q + min, q in 0..15, the scale
                  (max - min) / j for the j in 15..1 with the least squared error, so a group
                  already on a grid of j + 1 levels (a GGUF Q4 block, dequantized) is found;
                  a group on no such grid then has its scale and min refit to its codes by
                  least squares (as GGUF's K-quant search does)
    two_level     group scales and mins as 8-bit codes times a float16 unit per column and
                  S groups (GGUF's K-quants keep 6-bit codes per 32 and float16 units per 256)
    on_grid       whether every group lies on its 4-bit grid (a 4-bit source): int8 weights
                  then keep that grid rather than move each weight to a symmetric 8-bit one
"""

from __future__ import annotations

import numpy as np

GROUP = 32
SUPER = 8  # groups per unit at most (256 inputs, as GGUF's K-quants)
# Units tried per super, the one with the least error kept: the finest grid, and the one that
# codes a K-quant's 6-bit scales and mins exactly.
SCALE_LEVELS, MIN_LEVELS = (255, 63), (127, 63)


def int8_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [.., G, 16], scales float16 [.., 16]) of groups x [.., G, 16]."""
    scales = (np.abs(x).max(axis=-2) / 127.0).astype(np.float16)
    s32 = scales.astype(np.float32)[..., None, :]
    q = np.clip(np.rint(x / np.where(s32 > 0, s32, 1.0)), -127, 127).astype(np.int8)
    return q, scales


def grid4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, min) float32 [.., 16] of the 4-bit grid that best fits each group x [.., 32, 16].
    A group whose weights are its min plus multiples of (max - min) / 15 (a GGUF Q4_1 block,
    whose min and max are codes 0 and 15) is on that grid: only the others are searched (`_search`),
    which made packing a 1.5B's 4-bit tensors a pass over the weights instead of 18."""
    lo, hi = x.min(axis=-2), x.max(axis=-2)
    scale = (hi - lo) / 15
    err = ((codes4(x, scale, lo) * scale[..., None, :] + lo[..., None, :] - x) ** 2).sum(axis=-2)
    off = err > GROUP * (1e-6 * np.maximum(np.abs(lo), np.abs(hi))) ** 2  # float32 rounding
    if off.any():
        rows = np.moveaxis(x, -2, -1)[off][:, :, None]  # the groups searched, [M, 32, 1]
        s, m = _search(rows, lo[off][:, None], hi[off][:, None])
        scale, lo = scale.copy(), lo.copy()
        scale[off], lo[off] = s[:, 0], m[:, 0]
    return scale, lo


def _search(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """grid4 of groups x [.., 32, 16] by search: the scale (max - min) / j for the j in 15..1
    with the least squared error (a group on a grid of j + 1 levels, a K-quant block's, is
    found), a coarser grid replacing a finer one only where it is clearly better; then
    `_least_squares`."""
    best_err, scale = None, None
    for j in range(15, 0, -1):
        d = (hi - lo) / j
        err = ((codes4(x, d, lo, j) * d[..., None, :] + lo[..., None, :] - x) ** 2).sum(axis=-2)
        if best_err is None:
            best_err, scale = err, d
        else:
            scale = np.where(err < 0.999 * best_err, d, scale)
            best_err = np.minimum(best_err, err)
    return _least_squares(x, scale, lo, best_err)


def _least_squares(x: np.ndarray, scale: np.ndarray, lo: np.ndarray, err: np.ndarray,
                   rounds: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Groups off any 4-bit grid: (scale, min) refit to their codes by least squares and
    recoded, a few rounds, kept where the error falls (a group on its grid keeps it)."""
    for _ in range(rounds):
        q = codes4(x, scale, lo).astype(np.float32)
        qm, xm = q.mean(axis=-2, keepdims=True), x.mean(axis=-2, keepdims=True)
        var = ((q - qm) ** 2).sum(axis=-2)
        s = np.where(var > 0, ((q - qm) * (x - xm)).sum(axis=-2) / np.where(var > 0, var, 1),
                     scale)
        m = xm[..., 0, :] - s * qm[..., 0, :]
        m = np.minimum(m, x.min(axis=-2))  # codes stay >= 0 at the group's min
        e = ((codes4(x, s, m) * s[..., None, :] + m[..., None, :] - x) ** 2).sum(axis=-2)
        better = (e < 0.999 * err) & (s > 0)
        scale, lo, err = np.where(better, s, scale), np.where(better, m, lo), np.minimum(e, err)
    return scale, lo


def codes4(x: np.ndarray, scale: np.ndarray, lo: np.ndarray, top: int = 15) -> np.ndarray:
    """Codes in 0..top of groups x [.., 32, 16] on the grid scale * q + lo ([.., 16] each)."""
    s = np.where(scale > 0, scale, 1)[..., None, :]
    return np.clip(np.rint((x - lo[..., None, :]) / s), 0, top).astype(np.uint8)


def on_grid(x: np.ndarray, scale: np.ndarray, lo: np.ndarray) -> bool:
    """Every group of x [.., 32, 16] within float32 rounding of its grid (scale, lo)."""
    back = codes4(x, scale, lo) * scale[..., None, :] + lo[..., None, :]
    return bool(np.abs(back - x).max() <= 1e-5 * max(float(np.abs(x).max()), 1e-30))


def per_super(groups: int) -> int:
    """S for a row of `groups` groups: the most groups, at most SUPER, that divide
    groups / 2^i (2^i the largest power of two up to 8 dividing it), so that a tensor-parallel
    shard of 1/2, 1/4 or 1/8 of the inputs holds whole supers, the units a one-device pack has."""
    odd = groups
    for _ in range(3):
        odd = odd // 2 if odd % 2 == 0 else odd
    return max(s for s in range(1, SUPER + 1) if odd % s == 0)


def two_level(v: np.ndarray, levels: tuple[int, ...], signed: bool, s: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Group values v [.., NG, 16] as (codes [.., NG, 16] uint8, or int8 when `signed`, units
    float16 [.., NG / S, 16]): v ~ unit * code, per column and `s` (S) consecutive groups,
    each super's unit max |v| / L for the L in `levels` with the least squared error."""
    sup = v.reshape(*v.shape[:-2], v.shape[-2] // s, s, v.shape[-1])
    top = np.abs(sup).max(axis=-2)
    bounds = (-127, 127) if signed else (0, 255)
    err = unit = codes = None
    for n in levels:
        u16 = (top / n).astype(np.float16)
        u = u16.astype(np.float32)[..., None, :]
        c = np.clip(np.rint(sup / np.where(u > 0, u, 1)), *bounds)
        e = ((c * u - sup) ** 2).sum(axis=-2)
        if err is None:
            err, unit, codes = e, u16, c
            continue
        pick = e < err
        err, unit = np.where(pick, e, err), np.where(pick, u16, unit)
        codes = np.where(pick[..., None, :], c, codes)
    return codes.astype(np.int8 if signed else np.uint8).reshape(v.shape), unit


def nearest_pair(x: np.ndarray, scale: np.ndarray, lo: np.ndarray, s_unit: np.ndarray,
                 m_unit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(4-bit codes, scale codes uint8, min codes int8) of groups x [.., 32, 16] whose grid
    (scale, lo) [.., 16] is coded against units [.., 16] (one per group, repeated from its
    super): of the codes just below and above scale / s_unit and lo / m_unit, the pair whose
    grid reconstructs the group with the least squared error."""
    best = None
    s_lo, m_lo = np.floor(scale / _nonzero(s_unit)), np.floor(lo / _nonzero(m_unit))
    for ds in (0, 1):
        for dm in (0, 1):
            sc, mc = np.clip(s_lo + ds, 0, 255), np.clip(m_lo + dm, -127, 127)
            s, m = sc * s_unit, mc * m_unit
            q = codes4(x, s, m)
            err = ((q * s[..., None, :] + m[..., None, :] - x) ** 2).sum(axis=-2)
            if best is None:
                best = [err, q, sc, mc]
                continue
            pick = err < best[0]
            best = [np.where(pick, err, best[0]), np.where(pick[..., None, :], q, best[1]),
                    np.where(pick, sc, best[2]), np.where(pick, mc, best[3])]
    return best[1], best[2].astype(np.uint8), best[3].astype(np.int8)


def _nonzero(u: np.ndarray) -> np.ndarray:
    return np.where(u > 0, u, 1)
