"""One worker's speed on one model (SPEC §21): decayed sums, and the fit made of them.

A :class:`Speed` is fed by :class:`relay.core.rates.Rates` with every request its worker
answers, and read by :mod:`relay.core.prediction`:

- **time to first byte** against the prompt tokens processed: sums of a weighted
  least-squares line (weight, x, y, x², xy). Its fit (:meth:`Speed.fit`) is a ridge
  regression whose small pull towards the fleet's line only settles what the samples
  cannot (prompts all of one size: the excess over the fleet's then goes to the
  per-token rate rather than the overhead), with the backend's own prefill times
  (llama-server's ``timings``), when there are some, weighing on the slope as the
  samples they are; the line is then blended with the fleet's by confidence, so a
  worker's own samples fade into the fleet's as they decay. A line outside what is
  physical (noise on a narrow range of sizes, or a box that changed speed with its old
  samples on other sizes not yet faded) keeps the fleet's overhead and puts the rest on
  the per-token rate, where a slowdown usually is;
- **decode**, **service time**, and the prefill each request was predicted to need:
  ratios of sums, each pulled towards the fleet's with the same weight;
- **predicted against measured** time to first byte: their decayed means (shown), and a
  ring of their log ratios whose median and median absolute deviation give the spread
  of the predictions (their p90 and p95): robust, so a few stalls do not hide the
  ordinary spread behind them.

Every sum decays with the half-life of :class:`SpeedConfig`; a worker's *own* line
(before the fleet's is blended in) is kept apart, as what the fleet's median is made of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

#: Residuals kept per speed for the spread of its predictions (see :meth:`Speed._spread`).
RING = 64
#: The quantiles' z-scores: a prediction times ``spread(z)`` is that quantile.
Z90 = 1.2816
Z95 = 1.6449
#: Bounds on what is believed: far outside anything real, so nothing divides by zero.
MIN_SECS_PER_TOKEN = 1e-7  # ten million tokens a second
MAX_SECS_PER_TOKEN = 10.0
MAX_OVERHEAD = 60.0


@dataclass(frozen=True, slots=True)
class SpeedConfig:
    """How speeds are learned (the RATES_* settings)."""

    #: Seconds after which a sample counts half as much (RATES_HALF_LIFE_SECS).
    half_life: float = 120.0
    #: How many requests' worth the fleet median weighs against a worker's own samples.
    prior_weight: float = 2.0
    #: What is assumed of a model no worker has served yet: prefill and decode tokens a
    #: second, the fixed overhead of a request, its time on a worker, bytes per token.
    prefill: float = 2000.0
    decode: float = 30.0
    overhead: float = 0.05
    service: float = 10.0
    bytes_per_token: float = 4.0


class Fit(NamedTuple):
    """A speed as predictions use it."""

    #: Seconds per prompt token processed, and the fixed seconds before the first byte.
    secs_per_token: float
    overhead: float
    #: Completion tokens a second, and seconds a request spends on the worker.
    decode: float
    service: float


def _clamp(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


class Speed:
    """One worker's speed on one model: decayed sums, and the fit made of them."""

    __slots__ = (
        "_residuals",
        "_turn",
        "at",
        "confidence",
        "decode",
        "dn",
        "ds",
        "fitted",
        "measured",
        "n",
        "outliers",
        "overhead",
        "own",
        "pf",
        "pn",
        "predicted",
        "samples",
        "secs_per_token",
        "service",
        "spread90",
        "spread95",
        "sx",
        "sxx",
        "sxy",
        "sy",
        "tn",
        "ts",
        "vn",
        "vs",
    )

    def __init__(self, now: float, prior: Fit) -> None:
        self.at = now
        # Time to first byte (y, seconds) against prompt tokens processed (x): weight,
        # sums of x, y, x², xy.
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        # The backend's own prefill times (requests with nothing ahead): tokens, seconds.
        self.tn = self.ts = 0.0
        # Decode: completion tokens and seconds; service: requests, seconds, and the
        # prefill seconds each was predicted to need.
        self.dn = self.ds = 0.0
        self.vn = self.vs = self.pf = 0.0
        # Predicted and measured time to first byte (decayed sums over ``pn``).
        self.pn = self.predicted = self.measured = 0.0
        #: Requests learned from, ever (not decayed); outliers in a row, lately.
        self.samples = 0
        self.outliers = 0
        self._residuals: list[float] = []
        self._turn = 0
        self.spread90 = 1.6
        self.spread95 = 2.0
        self.secs_per_token, self.overhead, self.decode, self.service = prior
        #: Its own line, before the fleet's is blended in (what the fleet's median is
        #: made of, so that no worker's view of the others feeds back into it).
        self.own = prior
        self.confidence = 0.0
        self.fitted = now

    # -- learning ---------------------------------------------------------------------

    def decay(self, now: float, half_life: float) -> None:
        """Age every sum to ``now``."""
        elapsed = now - self.at
        if elapsed <= 0.0:
            return
        self.at = now
        f = 0.5 ** (elapsed / half_life)
        self.n *= f
        self.sx *= f
        self.sy *= f
        self.sxx *= f
        self.sxy *= f
        self.tn *= f
        self.ts *= f
        self.dn *= f
        self.ds *= f
        self.vn *= f
        self.vs *= f
        self.pf *= f
        self.pn *= f
        self.predicted *= f
        self.measured *= f

    def first_byte(self, tokens: float, seconds: float, weight: float = 1.0) -> None:
        """A sample of time to first byte: ``seconds`` for ``tokens`` processed (what
        was ahead of them taken out), counting as ``weight`` of one."""
        self.n += weight
        self.sx += weight * tokens
        self.sy += weight * seconds
        self.sxx += weight * tokens * tokens
        self.sxy += weight * tokens * seconds

    def prefill_timing(self, tokens: float, seconds: float) -> None:
        """The backend's own time for ``tokens`` prompt tokens, nothing ahead of them."""
        self.tn += tokens
        self.ts += seconds

    def decoded(self, tokens: float, seconds: float) -> None:
        self.dn += tokens
        self.ds += seconds

    def served(self, seconds: float, prefill: float) -> None:
        self.vn += 1.0
        self.vs += seconds
        self.pf += prefill

    def checked(self, predicted: float, measured: float) -> None:
        """A prediction of time to first byte against what it measured."""
        self.pn += 1.0
        self.predicted += predicted
        self.measured += measured
        if predicted <= 0.0 or measured <= 0.0:
            return
        residual = math.log(measured / predicted)
        ring = self._residuals
        if len(ring) < RING:
            ring.append(residual)
        else:
            ring[self._turn] = residual
            self._turn = (self._turn + 1) % RING
        if len(ring) >= 8 and (len(ring) < RING or self._turn % 8 == 0):
            self._spread()

    def _spread(self) -> None:
        """The spread of measured over predicted, from the median and the median absolute
        deviation of their log ratio: robust, so a few stalls (the ones hedging is for)
        do not hide the ordinary spread behind them."""
        ordered = sorted(self._residuals)
        middle = len(ordered) // 2
        median = ordered[middle]
        deviations = sorted(abs(r - median) for r in ordered)
        sigma = 1.4826 * deviations[middle]
        self.spread90 = _clamp(math.exp(median + Z90 * sigma), 1.0, 20.0)
        self.spread95 = _clamp(math.exp(median + Z95 * sigma), 1.0, 20.0)

    # -- what it says -----------------------------------------------------------------

    def fit(self, now: float, prior: Fit, config: SpeedConfig) -> None:
        """Redo the fit from the sums (aged to ``now``), pulled towards ``prior``."""
        self.decay(now, config.half_life)
        self.fitted = now
        k = config.prior_weight
        n = self.n
        self.confidence = n / (n + k) if n + k > 0 else 0.0
        # The worker's own line: a ridge regression whose small pull towards the prior
        # (a0, b0) only settles what its samples cannot (prompts of one size: the excess
        # over the prior then goes to the per-token rate, the intercept's pull being the
        # stronger). The backend's own prefill times, when it reports some, weigh on
        # the slope as the samples they are. Then the line is blended with the fleet's
        # by confidence, so a worker's own samples fade into the fleet's as they decay.
        scale = max(self.sx / n if n > 0.0 else 1.0, 1.0)
        a0 = prior.overhead
        b0 = prior.secs_per_token
        pull = k * 1e-4
        timed = 0.0
        if self.tn > 0.0 and self.ts > 0.0:
            b0 = self.ts / self.tn
            timed = self.tn / scale
        ka = k * 0.1
        kb = (pull + timed) * scale * scale
        m00 = n + ka
        m01 = self.sx
        m11 = self.sxx + kb
        r0 = self.sy + ka * a0
        r1 = self.sxy + kb * b0
        det = m00 * m11 - m01 * m01
        if det > 0.0:
            a = (r0 * m11 - m01 * r1) / det
            b = (m00 * r1 - m01 * r0) / det
        else:
            a, b = a0, b0
        if (b < MIN_SECS_PER_TOKEN or a < 0.0) and n > 0.0 and self.sx > 0.0:
            # The line fell outside what is physical: noise on a narrow range of sizes,
            # or a box that changed speed, its old samples (other sizes, other times)
            # not yet faded. Keep the fleet's overhead and put the rest on the
            # per-token rate, where a slowdown usually is.
            mean_y = self.sy / n
            a = min(a0, mean_y)
            b = (mean_y - a) / (self.sx / n)
        c = self.confidence
        b = _clamp(b, MIN_SECS_PER_TOKEN, MAX_SECS_PER_TOKEN)
        a = _clamp(a, 0.0, MAX_OVERHEAD)
        self.secs_per_token = c * b + (1.0 - c) * prior.secs_per_token
        self.overhead = c * a + (1.0 - c) * prior.overhead
        # Decode and service: ratios of sums, each with the prior's weight.
        decode_secs_per_token = (self.ds + k / prior.decode) / (self.dn + k)
        self.decode = 1.0 / decode_secs_per_token if decode_secs_per_token > 0 else prior.decode
        self.service = (self.vs + k * prior.service) / (self.vn + k)
        self.own = Fit(
            b if n > 0.0 else prior.secs_per_token,
            a if n > 0.0 else prior.overhead,
            self.dn / self.ds if self.ds > 0.0 else prior.decode,
            self.vs / self.vn if self.vn > 0.0 else prior.service,
        )

    def current(self) -> Fit:
        return Fit(self.secs_per_token, self.overhead, self.decode, self.service)

    @property
    def prefill(self) -> float:
        """Prompt tokens a second."""
        return 1.0 / self.secs_per_token

    @property
    def per_load(self) -> float:
        """The wait one request in flight is predicted to add for a newcomer (seconds):
        its prefill, times the share of its time it spends prefilling (cluster mode
        predicts from loads, :mod:`relay.server.cluster.speeds`)."""
        if self.vn <= 0.0 or self.service <= 0.0:
            return 0.0
        prefill = self.pf / self.vn
        return min(prefill, prefill * prefill / self.service)

    @classmethod
    def shared(cls, now: float, fit: Fit, own: Fit, confidence: float, samples: int) -> Speed:
        """What another process learned of one of its workers, as it shared it: its fit,
        and its own line (what the fleet's median is made of)."""
        speed = cls(now, fit)
        speed.own = own
        speed.confidence = confidence
        speed.samples = samples
        # (Counts as recent history for the median while the worker's own samples
        # weigh at least as much as the fleet's there.)
        speed.n = 1.0 if confidence >= 0.5 else 0.0
        speed.fitted = math.inf  # never refitted here: it has no sums
        return speed

    def describe(self) -> dict[str, float | int | None]:
        """For ``/admin/workers``, the dashboard and ``/metrics``."""
        pn = self.pn
        return {
            "prefill_tokens_per_sec": round(self.prefill, 1),
            "decode_tokens_per_sec": round(self.decode, 2),
            "overhead_ms": round(self.overhead * 1000, 1),
            "service_secs": round(self.service, 3),
            "confidence": round(self.confidence, 3),
            "samples": self.samples,
            "predicted_ttft_ms": round(1000 * self.predicted / pn, 1) if pn > 0.01 else None,
            "measured_ttft_ms": round(1000 * self.measured / pn, 1) if pn > 0.01 else None,
            "p95_over_predicted": round(self.spread95, 3),
        }
