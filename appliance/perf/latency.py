"""How long the GPU takes: prefill, decode steps and KV copies, fitted to a GPU profile.

Model of the world, every coefficient fitted from the profile's points (`profile.py`):

- Prefill of `fresh` tokens on top of `reused` tokens already in the KV cache (batch 1):
  `F(fresh) + 2q * fresh * reused + r * reused`. F, a prefill from scratch, is
  `a + b*n + q*n^2` (fixed cost, weights, causal attention over n^2/2 token pairs),
  least-squares fitted in relative error to the full-prefill points. A fresh token attends
  to a reused one at the same per-pair cost `2q` as inside a causal prefill; `r`, a cost
  per reused token and prefill (bringing the cache into the computation), is fitted to the
  points with a reused context: H200 eager, 512 fresh tokens cost 22 ms alone, 35 ms on 8k
  and 78 ms on 32k. So a cache hit always helps, a prefix-cache hit and an earlier chunk of
  the same prompt cost the same (the function does not care where `reused` came from), and
  prefilling a prompt in chunks costs what one prefill does plus `a` and `r * reused` per
  extra chunk. The result is capped at `F(fresh + reused)`: never more than recomputing.
- Decode step of a batch: `G(batch) + m * context_tokens`, `context_tokens` summed over the
  batch. `m` is the time to read one token's KV: the fitted slope over context at a fixed
  batch size, but never below `kv_bytes_per_token / HBM bandwidth` (the profile's
  device-to-device figure). G interpolates the measured steps over batch size (linear,
  extended by the last segment).
- One copy of `n` bytes: interpolated through the measured copies; below the smallest it
  keeps that copy's fixed overhead, above the largest it grows at the asymptotic bandwidth
  (the slope between the two largest). Small copies are dominated by the overhead, so
  block-by-block transfers cost far more than one batched copy of the same bytes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from appliance.perf.profile import GpuProfile


class CopyDirection(StrEnum):
    H2D = "h2d"
    D2H = "d2h"
    D2D = "d2d"


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """`prefill_s(f, c) = min(F(f) + 2q*f*c + r*c, F(f + c))` with
    `F(n) = overhead_s + per_token_s*n + per_token_sq_s*n^2`, `q = per_token_sq_s` and
    `r = per_reused_token_s`."""

    overhead_s: float
    per_token_s: float
    per_token_sq_s: float
    per_reused_token_s: float

    def full_s(self, tokens: int) -> float:
        """A prefill of `tokens` from scratch."""
        if tokens <= 0:
            return 0.0
        return self.overhead_s + self.per_token_s * tokens + self.per_token_sq_s * tokens**2

    def context_s(self, fresh_tokens: int, reused_tokens: int) -> float:
        """What attending to `reused_tokens` adds to a prefill of `fresh_tokens`."""
        pairs = 2 * self.per_token_sq_s * fresh_tokens * reused_tokens
        return pairs + self.per_reused_token_s * reused_tokens

    def prefill_s(self, fresh_tokens: int, reused_tokens: int = 0) -> float:
        if fresh_tokens <= 0:
            return 0.0
        reused = max(reused_tokens, 0)
        on_cache = self.full_s(fresh_tokens) + self.context_s(fresh_tokens, reused)
        return min(on_cache, self.full_s(fresh_tokens + reused))


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """`step_s(batch, ctx) = G(batch) + per_context_token_s * ctx` (ctx summed over the
    batch); G linear between `batch_points` (batch size, seconds at no context)."""

    batch_points: tuple[tuple[int, float], ...]
    per_context_token_s: float

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        base = _interpolate(self.batch_points, batch_size)
        return max(base, 0.0) + self.per_context_token_s * max(context_tokens, 0)


@dataclass(frozen=True, slots=True)
class CopyCurve:
    """Seconds for one copy, by bytes: through `points`, at `bytes_per_s` beyond them."""

    points: tuple[tuple[int, float], ...]
    bytes_per_s: float

    def copy_s(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        first_n, first_s = self.points[0]
        last_n, last_s = self.points[-1]
        if nbytes <= first_n:
            # Same fixed overhead as the smallest measured copy, less the bytes not sent.
            return max(first_s - (first_n - nbytes) / self.bytes_per_s, nbytes / self.bytes_per_s)
        if nbytes >= last_n:
            return last_s + (nbytes - last_n) / self.bytes_per_s
        return _interpolate(self.points, nbytes)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """The GPU's timing as pure functions of explicit inputs; build with `from_profile`."""

    prefill: PrefillModel
    decode: DecodeModel
    h2d: CopyCurve
    d2h: CopyCurve
    d2d_bytes_per_s: float | None
    kv_bytes_per_token: int

    @classmethod
    def from_profile(cls, profile: GpuProfile) -> LatencyModel:
        hbm = profile.d2d_gbps * 1e9 if profile.d2d_gbps else None
        return cls(
            prefill=_fit_prefill(profile),
            decode=_fit_decode(profile, hbm),
            h2d=_fit_copy([(c.nbytes, c.h2d_s) for c in profile.copies]),
            d2h=_fit_copy([(c.nbytes, c.d2h_s) for c in profile.copies]),
            d2d_bytes_per_s=hbm,
            kv_bytes_per_token=profile.kv_bytes_per_token,
        )

    def prefill_s(self, fresh_tokens: int, reused_tokens: int = 0) -> float:
        """Compute `fresh_tokens` on top of `reused_tokens` already in the KV cache."""
        return self.prefill.prefill_s(fresh_tokens, reused_tokens)

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step for `batch_size` sequences holding `context_tokens` of KV in
        total (the sum over the batch)."""
        return self.decode.step_s(batch_size, context_tokens)

    def kv_bytes(self, tokens: int) -> int:
        return max(tokens, 0) * self.kv_bytes_per_token

    def copy_s(self, nbytes: int, direction: CopyDirection, *, copies: int = 1) -> float:
        """`copies` separate copies of `nbytes` each (a device-to-device copy reads and
        writes every byte)."""
        if copies <= 0 or nbytes <= 0:
            return 0.0
        if direction is CopyDirection.D2D:
            if self.d2d_bytes_per_s is None:
                raise ValueError("this GPU profile has no device-to-device bandwidth")
            return copies * 2 * nbytes / self.d2d_bytes_per_s
        curve = self.h2d if direction is CopyDirection.H2D else self.d2h
        return copies * curve.copy_s(nbytes)

    def kv_copy_s(
        self, tokens: int, direction: CopyDirection, *, tokens_per_copy: int | None = None
    ) -> float:
        """Move the KV of `tokens`: one batched copy, or one copy per `tokens_per_copy`
        (e.g. the block size, for block-by-block transfers)."""
        if tokens <= 0:
            return 0.0
        if tokens_per_copy is None or tokens_per_copy >= tokens:
            return self.copy_s(self.kv_bytes(tokens), direction)
        full, rest = divmod(tokens, tokens_per_copy)
        return self.copy_s(self.kv_bytes(tokens_per_copy), direction, copies=full) + self.copy_s(
            self.kv_bytes(rest), direction
        )


# --- fitting ---


def _fit_prefill(profile: GpuProfile) -> PrefillModel:
    full = [(p.fresh_tokens, p.seconds) for p in profile.prefill if p.reused_tokens == 0]
    bases: list[Callable[[float], float]] = [lambda n: 1.0, lambda n: n, lambda n: n * n]
    if len(full) < len(bases):  # too few points for a curve: fewer terms, from the linear
        bases = [bases[1]] if len(full) == 1 else bases[:2]
    coef = _fit_nonnegative(bases, full)
    if len(coef) == 1:
        coef = [0.0, coef[0], 0.0]
    coef += [0.0] * (3 - len(coef))
    a, b, q = coef
    f = PrefillModel(a, b, q, 0.0)
    # A cost per reused token, from what F and the causal pair cost leave unexplained.
    num = den = 0.0
    for p in profile.prefill:
        if p.reused_tokens == 0:
            continue
        x = p.reused_tokens
        residual = p.seconds - f.full_s(p.fresh_tokens) - f.context_s(p.fresh_tokens, x)
        num += x * residual / p.seconds**2
        den += x * x / p.seconds**2
    return PrefillModel(a, b, q, max(num / den, 0.0) if den else 0.0)


def _fit_decode(profile: GpuProfile, hbm_bytes_per_s: float | None) -> DecodeModel:
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for p in profile.decode:
        by_batch.setdefault(p.batch_size, []).append((p.batch_size * p.context_tokens, p.seconds))
    # Pooled within-batch slope of step time over total context.
    cov = var = 0.0
    for pts in by_batch.values():
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        cov += sum((x - mx) * (y - my) for x, y in pts)
        var += sum((x - mx) ** 2 for x, _ in pts)
    fitted = cov / var if var else 0.0
    floor = profile.kv_bytes_per_token / hbm_bytes_per_s if hbm_bytes_per_s else 0.0
    m = max(fitted, floor)
    points = tuple(
        (batch, sum(y - m * x for x, y in pts) / len(pts))
        for batch, pts in sorted(by_batch.items())
    )
    return DecodeModel(points, m)


def _fit_copy(points: Sequence[tuple[int, float]]) -> CopyCurve:
    pts = tuple(sorted(points))
    if len(pts) >= 2 and pts[-1][1] > pts[-2][1]:
        rate = (pts[-1][0] - pts[-2][0]) / (pts[-1][1] - pts[-2][1])
    else:
        rate = pts[-1][0] / pts[-1][1]
    return CopyCurve(pts, rate)


def _interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), extended by the end segments."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(points) - 2)
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _fit_nonnegative(
    bases: list[Callable[[float], float]], points: Sequence[tuple[int, float]]
) -> list[float]:
    """Least squares in relative error with every coefficient >= 0: refit without the most
    negative term until none is negative. Returns one coefficient per basis."""
    active = list(range(len(bases)))
    while True:
        coef = _least_squares([bases[i] for i in active], points)
        worst = min(range(len(active)), key=lambda j: coef[j])
        if coef[worst] >= 0 or len(active) == 1:
            out = [0.0] * len(bases)
            for j, i in enumerate(active):
                out[i] = max(coef[j], 0.0)
            return out
        del active[worst]


def _least_squares(
    bases: list[Callable[[float], float]], points: Sequence[tuple[int, float]]
) -> list[float]:
    """Minimise sum(((sum c_j f_j(x)) - y) / y)^2 by the normal equations, with columns
    scaled to unit size first."""
    rows = [[f(float(x)) / y for f in bases] for x, y in points]
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(len(bases))]
    a = [[r[j] / scale[j] for j in range(len(bases))] for r in rows]
    n = len(bases)
    ata = [[sum(r[i] * r[j] for r in a) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] for r in a) for i in range(n)]  # targets are y / y = 1
    sol = _solve(ata, atb)
    return [sol[j] / scale[j] for j in range(n)]


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting."""
    n = len(v)
    aug = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(aug[r][col]))
        if math.isclose(aug[pivot][col], 0.0, abs_tol=1e-300):
            raise ValueError("profile points do not determine the fit")
        aug[col], aug[pivot] = aug[pivot], aug[col]
        for r in range(n):
            if r != col:
                factor = aug[r][col] / aug[col][col]
                aug[r] = [x - factor * y for x, y in zip(aug[r], aug[col], strict=True)]
    return [aug[i][n] / aug[i][i] for i in range(n)]
