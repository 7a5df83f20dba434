"""RoPE's frequencies as a GGUF file asks for them, each scaling as llama.cpp computes it.

Every variant the native runner reads is the same rotation with two knobs: each pair's frequency divided by a
factor, and cos / sin multiplied by one number (an "attention factor": q and k are both rotated, so the scores
scale by its square). Pair j of R rotated dimensions turns at position p by

    angle_j(p) = p * base^(-2j / R) / divisor_j,        (cos, sin) * mscale

- none:      divisor 1.
- linear:    divisor = s, the scaling factor (positions divided by s).
- Llama 3:   divisor = the file's per-pair factor (`rope_freqs.weight`), then any of the others on top.
- LongRoPE:  divisor = the file's long or short factors (Phi-3.5, Phi-4-mini: `rope_factors_long/short.weight`,
             the long ones when the context the model runs at exceeds its original one), times s where a factor
             is given; mscale = `rope.scaling.attn_factor`.
- YaRN:      pair j's angle mixes the interpolated angle (divided by s) and the original one by a ramp r_j, 1 for
             the pairs that turn many times within the original context and 0 for those that turn less than
             once, linear between (beta_fast = 32 and beta_slow = 1 turns): angle * (r_j + (1 - r_j) / s), so
             divisor_j = 1 / (r_j + (1 - r_j) / s); mscale = 1 + 0.1 ln s (s > 1). llama.cpp takes beta_fast, beta_slow
             and the extrapolation factor (1) at their defaults for every architecture the runner reads, whatever
             the file says, and so does this.
`rope.scaling.attn_factor` multiplies mscale for every kind, as llama.cpp applies it.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("none", "linear", "yarn", "longrope")
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults: turns within the original context


def rope_frequencies(kind: str, rotated: int, base: float, scale: float, original_context: int,
                     attn_factor: float = 1.0, factors: np.ndarray | None = None) -> tuple[np.ndarray | None, float]:
    """The global layers' RoPE: ((R/2,) float32 divisor of each pair's frequency, or None where all are 1; the float
    cos / sin are multiplied by). kind: one of KINDS; rotated: R; scale: s, the scaling factor (1: none);
    original_context: the context the model was trained at before scaling (YaRN's ramp); factors: (R/2,) float32
    per-pair divisors from the file (Llama 3's, or LongRoPE's long or short ones), or None."""
    divisors = None if factors is None else factors.astype(np.float64)  # (R/2,)
    ones = np.ones(rotated // 2, np.float64)  # (R/2,)
    mscale = attn_factor
    if kind in ("linear", "longrope") and scale != 1.0:
        divisors = (ones if divisors is None else divisors) * scale
    elif kind == "yarn" and scale != 1.0:
        r = yarn_ramp(rotated, base, original_context)  # (R/2,)
        divisors = (ones if divisors is None else divisors) / (r + (1.0 - r) / scale)
        if scale > 1.0:
            mscale *= float(np.float32(1.0) + np.float32(0.1) * np.log(np.float32(scale)))
    return (None if divisors is None else divisors.astype(np.float32)), mscale


def yarn_ramp(rotated: int, base: float, original_context: int) -> np.ndarray:
    """(R/2,) float64 YaRN's mix r_j of pair j's original angle: 1 below the pair that turns beta_fast times in the
    original context, 0 past the one that turns beta_slow times, linear between (ggml's corr dims and ramp, in float32
    as ggml computes them, so that both place the same pairs at the ends)."""
    f32 = np.float32

    def pair_turning(turns: float) -> np.float32:  # the (fractional) dimension whose pair turns `turns` times
        return f32(rotated) * np.log(f32(original_context) / (f32(turns) * f32(2) * f32(math.pi))) / (f32(2) *
                                                                                                       np.log(f32(base)))

    low = max(0.0, math.floor(pair_turning(YARN_BETA_FAST)))
    high = min(rotated - 1.0, math.ceil(pair_turning(YARN_BETA_SLOW)))
    j = np.arange(rotated // 2, dtype=np.float32)
    y = (j - f32(low)) / f32(max(0.001, high - low))
    return (1.0 - np.clip(y, 0.0, 1.0)).astype(np.float64)
