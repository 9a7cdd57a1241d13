"""The verify width chosen by measurement (Modular MAX's adaptive policy), not by a batch-size threshold.

Per power-of-two bucket of running sequences, two kinds of exponential moving averages: the step time at each width
w (w = 0: no drafts verified), weight `alpha` on each new step, and per draft position k the rate q_k at which the
first k drafts are all accepted, weight `alpha_per_trial` on each sequence that drafted k or more (so a step of 16
sequences moves q_k as much as 16 steps of one: at batch 1 each trial is a coin flip), the plain mean of the trials
so far until there are 1 / alpha_per_trial of them (a first unlucky trial must not park a position at 0: positions
past the chosen width are measured only on probes). A step at width w yields
1 + q_1 + ... + q_w tokens per sequence, so the width with the most tokens per second maximises

    (1 + q_1 + ... + q_w) / time(w)

Widths not timed yet in a bucket are tried first (widest first); a new best replaces the current width only when
it beats it by `margin`; every `probe_every` steps the widest width runs once, so the acceptance of the far
positions (only measured when drafted) stays fresh. The width changes only how many drafts are verified: outputs
are the same at every width (greedy: token for token; sampling: in distribution).

Worked example, max width 3, one bucket: times 10 ms (w=0), 14 (1), 17 (2), 21 (3); q = 0.8, 0.6, 0.4. Tokens
per second per sequence: 1/10 = 0.100, 1.8/14 = 0.129, 2.4/17 = 0.141, 2.8/21 = 0.133; the width is 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket_of(batch_size: int) -> int:
    """The power of two at or above `batch_size` (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    step_time: list[float | None]  # EMA of seconds per step at each width 0..max
    accepted_rate: list[float | None]  # EMA of q_k for k = 1..max (index k - 1)
    trials: list[int]  # sequences that drafted k or more so far, per k
    width: int
    steps: int = 0


@dataclass
class AdaptiveWidth:
    max_width: int
    alpha: float = 0.2
    alpha_per_trial: float = 0.02
    margin: float = 0.02
    probe_every: int = 50
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_width < 1 or not 0 < self.alpha <= 1 or not 0 < self.alpha_per_trial <= 1 or self.margin < 0 \
                or self.probe_every < 1:
            raise ValueError("AdaptiveWidth needs max_width >= 1, alpha and alpha_per_trial in (0, 1], margin >= 0, "
                             "probe_every >= 1")

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self.buckets:
            self.buckets[key] = _Bucket([None] * (self.max_width + 1), [None] * self.max_width, [0] * self.max_width,
                                        self.max_width)
        return self.buckets[key]

    def width(self, batch_size: int) -> int:
        """The width the next step of a batch of `batch_size` sequences should verify."""
        bucket = self._bucket(batch_size)
        untimed = [w for w in range(self.max_width, -1, -1) if bucket.step_time[w] is None]
        if untimed:
            return untimed[0]
        if bucket.steps % self.probe_every == self.probe_every - 1:
            return self.max_width
        return bucket.width

    def tokens_per_second(self, batch_size: int, width: int) -> float | None:
        """The estimate the choice is made on, for one sequence at `width` (None until that width is timed)."""
        bucket = self._bucket(batch_size)
        seconds = bucket.step_time[width]
        if seconds is None:
            return None
        rates = [q if q is not None else 0.0 for q in bucket.accepted_rate[:width]]
        return (1.0 + sum(rates)) / max(seconds, 1e-9)

    def observe(self, batch_size: int, width: int, seconds: float, drafted_and_accepted: list[tuple[int, int]]
                ) -> None:
        """One decode step of a batch of `batch_size` sequences at `width` took `seconds`; per sequence, how many
        drafts it verified and how many of them were accepted."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        old = bucket.step_time[width]
        bucket.step_time[width] = seconds if old is None else old + self.alpha * (seconds - old)
        for k in range(1, self.max_width + 1):
            tried = [accepted >= k for drafted, accepted in drafted_and_accepted if drafted >= k]
            if tried:
                rate = sum(tried) / len(tried)
                old = bucket.accepted_rate[k - 1]
                bucket.trials[k - 1] += len(tried)
                weight = max(1 - (1 - self.alpha_per_trial) ** len(tried), len(tried) / bucket.trials[k - 1])
                bucket.accepted_rate[k - 1] = rate if old is None else old + weight * (rate - old)
        if any(t is None for t in bucket.step_time):
            return
        scores = [self.tokens_per_second(batch_size, w) for w in range(self.max_width + 1)]
        best = max(range(self.max_width + 1), key=lambda w: scores[w])
        if scores[best] > scores[bucket.width] * (1 + self.margin):
            bucket.width = best
