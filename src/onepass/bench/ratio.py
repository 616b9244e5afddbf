"""A speed ratio of two timed runs, checked against the most the counted work allows.

Why this module exists: on a shared machine (a laptop, a CI runner, a loaded
server) a burst of load that lands on one side of a comparison turns a 1.2x
speedup into 4x. The work of both sides is known (:func:`onepass.flops.speed_bound`:
tokens, attention pairs, rows), so a ratio past that bound is not a speedup but
disturbed timing. Every place onepass prints a speed ratio (``make demo``,
``onepass bench`` headlines) goes through :func:`speed_ratio` and
:meth:`SpeedRatio.describe`, so they judge it the same way. No torch.

The check. From the baseline's and the candidate's times (seconds for the same
work, several repeats each):

- ``median``: the median of the per-pair ratios when the repeats were
  interleaved (``paired``), else the ratio of the medians;
- ``fastest``: fastest baseline repeat over fastest candidate repeat (load only
  ever slows a repeat down, so the fastest ones carry the least of it: timeit's
  reasoning); not "the best ratio": it may be below the median;
- ``deviation``: how much the ratio itself varies: the median absolute
  deviation of the per-pair ratios over their median (paired), else the two
  sides' relative deviations added (a burst in one repeat barely moves it, as
  it barely moves the median);
- a ratio is *past the bound* when it exceeds ``bound * (1 + deviation + SLACK)``
  (``SLACK``: the bound assumes a token or a pair costs the same in both runs,
  which holds to a few percent, not exactly);
- the timing is *disturbed* when the median is past the bound, or when the two
  estimates (median, fastest) disagree by more than twice the spread: load that
  came and went (issue 37: median 1.43x, fastest repeats 0.44x, ±25%).

The trustworthy figure is the median when the timing is not disturbed; else the
fastest repeats' ratio when only the median is past the bound (most baseline
repeats slowed) and that ratio is within it; else none (the timing only says "at
most the bound"). The sentence (:meth:`SpeedRatio.describe`) says "within the
bound" only of a median at or below it; a median above the bound but inside the
spread is "N% above the bound, inside the spread: at most the bound".

    >>> r = speed_ratio([10.0, 10.2, 30.0], [8.0, 8.1, 8.0], bound=1.3, paired=True)
    >>> round(r.median, 2), round(r.fastest, 2), r.disturbed, round(r.trustworthy, 2)
    (1.26, 1.25, False, 1.26)
    >>> r = speed_ratio([30.0, 31.0, 10.0], [8.0, 8.0, 8.0], bound=1.3, paired=True)
    >>> r.disturbed, round(r.trustworthy, 2)
    (True, 1.25)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

SLACK = 0.05  # per-token / per-pair costs differ a little between the two layouts (matmul shapes, padding)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedRatio:
    """How much faster the candidate ran than the baseline, and whether that is physically possible."""

    median: float
    fastest: float  # fastest baseline repeat / fastest candidate repeat (may be below the median)
    deviation: float  # relative median absolute deviation of the ratio (0 with one repeat per side)
    bound: float  # the most the counted work allows (onepass.flops.speed_bound)
    repeats: int  # timed repeats per side
    paired: bool  # the repeats were interleaved (the same load on both sides)

    @property
    def limit(self) -> float:
        """The largest ratio the bound and the measured deviation together explain."""
        return self.bound * (1.0 + self.deviation + SLACK)

    @property
    def past_bound(self) -> bool:
        """The median is past the bound by more than the ratio's measured deviation: not a speedup."""
        return self.median > self.limit

    @property
    def consistent(self) -> bool:
        """The fastest repeats' ratio agrees with the median within twice the spread (a minimum of a few
        repeats is noisier than their median); load that came and went breaks this."""
        band = 1.0 + 2.0 * (self.deviation + SLACK)
        return self.median / band <= self.fastest <= self.median * band

    @property
    def disturbed(self) -> bool:
        """The median is past the bound, or the two estimates disagree: not a measurement of the speed."""
        return self.past_bound or not self.consistent

    @property
    def trustworthy(self) -> float | None:
        """The median when the timing is not disturbed; the fastest repeats' ratio when only the median is
        past the bound and that ratio is within it; else None."""
        if not self.disturbed:
            return self.median
        if self.past_bound and self.fastest <= self.limit:
            return self.fastest
        return None

    def describe(self, candidate: str = "one-pass", baseline: str = "N-pass") -> str:
        """One line: the figure, its bound, and 'disturbed timing' where it is not a measurement."""
        how = "interleaved" if self.paired else "one after the other"
        spread = f"±{self.deviation:.0%} over {self.repeats} {how} repeats"
        if not self.disturbed:
            where = (f"within the FLOP/token bound of {self.bound:.2f}x" if self.median <= self.bound else
                     f"{self.median / self.bound - 1:.0%} above the FLOP/token bound of {self.bound:.2f}x, inside the "
                     f"measurement spread: at most {self.bound:.2f}x")
            return (f"{candidate}: {self.median:.2f}x the speed of {baseline} (median; fastest repeats "
                    f"{self.fastest:.2f}x; {spread}), {where}")
        if self.past_bound:
            head = (f"{candidate} vs {baseline}: timing disturbed (median {self.median:.2f}x, past the FLOP/token "
                    f"bound of {self.bound:.2f}x by more than its {spread}; something else was using the machine)")
        else:
            head = (f"{candidate} vs {baseline}: timing disturbed (median {self.median:.2f}x, fastest repeats "
                    f"{self.fastest:.2f}x: they disagree by more than twice the ratio's spread, {spread}; something "
                    "else was using the machine)")
        if self.trustworthy is not None:
            return head + f"; the trustworthy figure is the fastest repeats' {self.trustworthy:.2f}x"
        return head + f"; no trustworthy figure: at most {self.bound:.2f}x (rerun on an idle machine)"


def relative_deviation(values: Sequence[float]) -> float:
    """Median absolute deviation over the median; 0 for fewer than two values.

    >>> relative_deviation([10.0, 12.0]), relative_deviation([1.2, 1.2, 4.0, 1.2, 1.3])
    (0.09090909090909091, 0.0)
    """
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return statistics.median(abs(v - med) for v in values) / med if med else 0.0


def fastest_ratio(baseline_seconds: Sequence[float], seconds: Sequence[float]) -> float:
    """The baseline's fastest repeat over the candidate's fastest (:attr:`SpeedRatio.fastest`).

    >>> fastest_ratio([10.0, 8.0], [5.0, 4.0])
    2.0
    """
    return min(baseline_seconds) / min(seconds)


def speed_ratio(baseline_seconds: Sequence[float], seconds: Sequence[float], *, bound: float,
                paired: bool) -> SpeedRatio:
    """The candidate's speed over the baseline's from their repeat times (same work per repeat).

    ``paired``: repeat i of both sides ran interleaved (one after the other, alternating), so
    their ratio cancels slow load changes; then both lists have the same length.
    """
    if not baseline_seconds or not seconds or min(*baseline_seconds, *seconds) <= 0:
        raise ValueError("speed_ratio needs positive repeat times on both sides")
    if paired:
        if len(baseline_seconds) != len(seconds):
            raise ValueError(f"paired repeats differ in number: {len(baseline_seconds)} vs {len(seconds)}")
        ratios = [a / b for a, b in zip(baseline_seconds, seconds)]
        median, deviation = statistics.median(ratios), relative_deviation(ratios)
    else:
        median = statistics.median(baseline_seconds) / statistics.median(seconds)
        deviation = relative_deviation(baseline_seconds) + relative_deviation(seconds)
    return SpeedRatio(median=median, fastest=fastest_ratio(baseline_seconds, seconds), deviation=deviation, bound=bound,
                      repeats=min(len(baseline_seconds), len(seconds)), paired=paired)
