"""The verify width chosen by measurement (Modular MAX's adaptive policy), not by a batch-size threshold.

Per power-of-two bucket of running sequences: the step times at each width w (w = 0: no drafts verified, no draft
work), the last `window` of each, and per draft position k the rate q_k at which the first k drafts are all accepted
(accepted over tried, among the sequences that drafted k or more, each trial weighted by how many calls of the
bucket ago it came: it fades by 1 / `acceptance_memory` a call. So the rate is of the last few dozen steps whatever
the batch: at one sequence each trial is a coin flip and a prompt that accepts little must not speak for the next
for long; at 16 the last step's sequences alone would move it 28% if each trial faded instead. And a position not
verified for a while, as while the bucket drafts nothing, keeps its rate with less and less weight, so the few
trials of a probe re-measure it: one that faded per trial kept a dip of q_1 from 0.6 to 0.31 over one prompt at one
sequence for 536 steps at width 0, the probes' trials moving it to 0.36). A step at width w yields 1 + q_1 + ... +
q_w tokens per sequence, so the width with the most tokens per second maximises

    (1 + q_1 + ... + q_w) / time(w)

time(w) is the median of width w's recent steps (each scaled to the bucket's size: time x bucket / sequences) where
it has `min_samples` of them: of the last `window` while w is the bucket's width, of those of the last STALE_CALLS
steps (at least `min_samples`) while it is only probed, so that a time from long ago does not speak for it (a
median: one step slowed by another process does not move it; the first steps after the engine stood idle, slow
while the caches fill again, are not timed), else read off the least-squares line through the medians of every
width from 1 up timed so far: a step's time grows about linearly with the width (w more verify rows per sequence, w
draft forwards; measured on the bundled target at 4, 16 and 32 sequences), so the widths probed inform the ones not
run lately. Width 0 is off that line (no draft work at all: with the compiled step at one sequence 3.1 ms against
8.5, 8.1 and 8.4 at widths 1 to 3), so it is always its own median, tried until it has `min_samples` steps.

Steps of every width slow down together as the contexts grow and as other work shares the machine (at 4 sequences
on the bundled models, width 0's median went from 7.3 to 9.0 ms within a minute, the same requests each round), and
a probed width's few steps are older than the current width's window: compared as taken, a width probed while steps
ran faster looked 20% ahead of width 0 and was taken, for one that lost 9% in whole runs. So each step's time is kept
divided by the bucket's `level` when it was taken: the median of the current width's latest LEVEL_STEPS steps over
that of its first LEVEL_STEPS steps since it was chosen (held while those run), so every width is compared at the
speed of now.

Widths not timed yet in a bucket are tried first (widest first, MAX_TRIES steps each at most: a step is timed only when
every sequence verified and proposed that width; a step with prompt rows spends no try, and it and a bucket whose tries
all went untimed run the nearest settled bucket's width, that of one done trying widths, else 0). What a new bucket
tries is set at its first step that could time a width, by the nearest bucket that has timed its own (of two as near,
the larger): above a smaller one, only the widths up to the smaller one's (the best width does not grow with the batch:
each sequence's verify rows cost more of a step), so a server whose load climbs does not run its largest batches at the
widest width to learn what the smaller ones already showed; beside one that drafts nothing (width 0), width 0 only, then
probes up from it: a try away from width 0 first runs the draft over every position of every sequence's pause (random
prompts at 16 sequences on the bundled models: 1144 positions of 6 sequences in 39 ms with the draft's layer eager, five
decode steps of 16 sequences), which a bucket the batch only passes through, as it drains, pays and seldom times. Such a
bucket also waits as long before its first probe as that one had come to wait (below). A new best replaces the current
width only when it beats it by `margin` (width 0 by `leave_zero_margin`, below); every `probe_every` steps (down to a
quarter of that below 8 sequences) a neighbour of the current width runs for three steps (the first proposes its drafts,
the second verifies them, the third is timed: a run of any width is timed from its third step, see SETTLE_STEPS), the
wider and the narrower in turn, so the line and the acceptance of the next position stay fresh at the cost of three
steps' difference, not of a run at the widest width; and above two sequences every other narrower probe from width 2 up
runs width 0, which is off the line, so that its time is not the few steps it ran long before (a server at 4 sequences,
fresh, tried width 0 for 4 steps at 11.7 ms among its first and then ran width 2 for 338 steps of 17.8, where in whole
runs width 2's steps took 2.33x width 0's for 2.08x the tokens); its outcome leaves the wait as it was (at one sequence,
where the narrower probes come every 32 steps, it cost 6% in whole runs: 0.911 against 0.974 of the best fixed width,
three rounds). A probe that finds its width more than BACKOFF_LOSS behind the current one doubles the wait before the
next (up to MAX_BACKOFF times). A probe away from width 0 costs more: it also runs the draft over every position every
sequence computed since the last (its context must have no hole), at one sequence on the bundled models 18 ms against 7
for two steps at width 0, which at one probe in 128 steps was 4% of the run; so unless it finds its width halfway to
taking the bucket (`leave_zero_margin` / 2 ahead of width 0) it makes the wait 4x longer, up to 4 MAX_BACKOFF periods
(1% there; with the wait back to probe_every on any probe not behind width 0, one sequence at a time on the bundled
models ran a probe every 48 steps, 1.8% of the run). One that finds its width close (or ahead) brings the wait back to
probe_every. And whatever the wait, a probe away from width 0 is put off a period at a time while that pass (the
positions the sequences computed since the draft last ran, at the draft's timed seconds a position) would cost more than
CATCH_UP_SHARE of the time since the last probe, at width 0's step time: at 32 sequences decoding 256 tokens each, where
a pause holds up to 512 positions a sequence, the policy ran 0.977x fixed width 0 without this, 1.003x with it (three
rounds in one process; at 4 sequences 0.978x and 1.013x of the best fixed width, five rounds). The width changes only
how many drafts are verified: outputs are the same at every width (greedy: token for token; sampling: in distribution).

Drafting also costs outside the decode steps: every position a drafting sequence computes must pass through the
draft (its context: an EAGLE-3 draft's step 0, a DFlash draft's context K/V), a prompt's positions included, while
width 0 leaves a prompt's positions to the draft only if the sequence drafts again before it ends. On a server,
where each finished request's place is taken by a new prompt, that work is paid in the steps that prefill the
prompts, which the step times above never see (8 sequences of 64 tokens on the bundled models, eval prompts: the
propose phase of a prompt step took 8.4 ms at width 1 against 0.2 at width 0, on a decode step of 14 ms). So a
width w >= 1 also pays, per step of the bucket, its share of that work: the prompt rows per committed token (decayed
sums over the last ~CONTEXT_MEMORY steps of every bucket: it is the traffic's, not the batch's), times the tokens
such a step commits, times the draft's seconds per context row (the slope of the context work's time against its
rows, between recent steps with prompt rows and recent steps without).

Nor is that work all drafting costs in the steps with prompt rows: requests that accept differently finish apart,
so the prompts that replace them come one or two at a time, each in a step of its own with the eager forward, whose
cost barely shrinks with its rows, where requests of one length decoded plainly finish together and are replaced in
one step (4 sequences on the bundled models, 64 tokens each: at width 1, 52 steps with prompt rows took 3.96 s of a
phase of 14.8, against 32 taking 2.89 s of plain decoding's 14.2; the decode steps 10.8 s against 11.1). So each
bucket also sums, while it holds width 0 and while it holds a drafting width (over ~CONTEXT_MEMORY of its own steps
each), the seconds its steps with prompt rows took beyond a decode step of their width, and the tokens it committed;
once it has run PROMPT_KNOWN steps under each, a drafting width is charged the larger of the draft's work above and
how much more those seconds per token came to while it drafted. The bucket then holds width 0 on that evidence for
as long as the traffic stays: a sum changes only while its width is held.

What drafting costs beyond the decode steps is still not all in those charges, and a width that drafts must beat
width 0 by `leave_zero_margin` (10%), not `margin`, to be taken: before a bucket has drafted for PROMPT_KNOWN
steps its prompt steps' cost is unknown, and every move away from width 0 runs the draft over each sequence's
pause. At 16 sequences of held-out prompts on the bundled models, 48 requests of 96 tokens in process, fixed width
1 ran 22 steps with prompt rows against 11 at width 0 (1.78 s against 1.07 of runs of 5-6 s), its decode steps
within 7% of width 0's per token and, by the step times and rates above, within 4% or ahead: with the 2% margin
the policy left width 0 on a noisy rate or probe, drafted stretches of 50-150 steps and ran 0.87x fixed width 0
(`python benchmarks/width_policy.py --concurrency 16`); with 10% it stayed at width 0 (see docs/figures.md for the
widths at each concurrency). And from width 0 the acceptance rates rest on the probes' few trials (at one
sequence, two a probe, faded as the calls pass), so there each q_k is taken at the lower end of its Wilson score
interval of DOUBT standard errors (the trials counted by the weight they still carry): at one sequence, after
1,400 calls at width 0 had faded every older trial, a probe's first accepted draft read q_1 = 1.0 and took the
width to 1 (a Wilson bound reads it 0.5); at 4 sequences a probe that accepted 0.82 of its drafts, against 0.6
over the run, took the width to 2.

Worked example, max width 3, one bucket: times 10 ms (w=0), 14 (1), 17 (2), 21 (3); q = 0.8, 0.6, 0.4. Tokens
per second per sequence: 1/10 = 0.100, 1.8/14 = 0.129, 2.4/17 = 0.141, 2.8/21 = 0.133; the width is 2, probed
against 3 and 1 in turn.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MAX_TRIES = 4  # steps a width is tried while untimed; then the line through the timed widths speaks for it
BACKOFF_LOSS = 0.1  # a probed width this far behind the current one (tokens per second) makes probes rarer
MAX_BACKOFF = 8  # probes at most this many times rarer than probe_every
CONTEXT_MEMORY = 256  # steps over which prompt rows per committed token are counted (decayed sums)
CONTEXT_SAMPLES = 32  # recent timings of the draft's context work kept, with and without prompt rows each
# the steps (their decayed weight) a bucket must have run holding width 0, and holding a drafting width, before what
# the steps with prompt rows cost under each is compared (module docstring)
PROMPT_KNOWN = 64
# the first steps of a run of a width, whose times are not taken: the one that verifies the drafts proposed before
# it, and the first that verifies its own, whose caches still hold what the width before read (the draft's weights,
# the experts of more or fewer verify rows). At one sequence on the bundled models the first step at width 0 after
# drafting took 4.0-4.6 ms and the next ones 3.5-3.9; at 16 sequences the second step of a run at width 1 took 15.0
# ms after width 0 and 14.4 after width 2, the third 14.1 after either, the later ones 13.7-14.1. A probe timed on
# its second step read width 1 up to 9% slow, where widths 0, 1 and 2 were within a few % of each other
SETTLE_STEPS = 2
PROBE_STEPS = SETTLE_STEPS + 1  # a probe's steps, the last of them timed
# after the engine stood idle (IDLE_SECONDS or more from one step's end to the next one's start: other work ran, or no
# request came), the caches hold what ran meanwhile and its first steps are slow: at one sequence on the bundled
# models, after five other engines had each decoded three prompts, the first timed steps at width 3 took 5.2, 4.7, 4.7
# and 4.5 ms against a median of 4.3 after them (the next round at width 2: 4.1, 4.3, 3.8 against 3.6). Their times
# would go into the current width's median alone (a window of 16 steps) and make it lose to its neighbours
IDLE_SECONDS = 0.05
COLD_STEPS = 3  # the timed steps after an idle spell whose times are not taken (their acceptance is)
# a width only probed is read from its steps of the last STALE_CALLS choices of its bucket (at least min_samples of
# them): at one or two sequences, a probe every probe_every / 4 steps (each neighbour in turn), that is its whole
# window; at four, half of it; from 8 on, a probe every probe_every, 4 of them. A window of probes there spans
# thousands of steps, and times taken while the machine or the batch was slower stay in it: at 16 sequences under
# load, width 1 kept a median of 18.1 ms from before where its steps took 15.0, and lost to width 2 (19.2 ms) for good
STALE_CALLS = 512
# a step is timed only when its batch is about the largest of its bucket's last PEAK_CALLS steps (within an eighth):
# a step's time is scaled to the bucket's size (time x bucket / sequences), and a step has a part that does not grow
# with its sequences (the weights it reads), so a step of fewer sequences scales to a slower one. As a run of
# requests drains, its last steps run a few sequences each: at 16 sequences on the bundled models (held-out prompts,
# 48-144 new tokens each) 62 steps of 9-15 sequences after 75-121 of 16, where widths 1 and 2, probed there among
# others, read 15-20% slower than their steps of 16 (15.1-15.6 ms against 12.8-13.1), and the policy ran widths 2
# and 3 where fixed width 1 ran fastest. With this rule, against the policy without it in the same process (the
# bundled models, 3c held-out prompts of 48-144 new tokens, five interleaved rounds): 0.989x against 0.978x of fixed
# width 1 at c=16, 1.006x against 0.964x at c=32
PEAK_CALLS = 128
DOUBT = 1.0  # standard errors off each acceptance rate when a width is judged from width 0 (module docstring)
# the current width's steps weigh in a choice every DECIDE_EVERY calls (another width's, at once): one step moves
# its median little, and the choice (the scores of every width) took 25-60 us a step, 1-2% of a step at one sequence
DECIDE_EVERY = 4
LEVEL_STEPS = 8  # the latest steps of the bucket's width that set its level (a median: a slow step does not move it)
# a probe away from width 0 waits (a probe period at a time) while the draft's pass over the pauses it would run first
# costs more than this share of the time since the last probe (module docstring)
CATCH_UP_SHARE = 0.02


def bucket_of(batch_size: int) -> int:
    """The power of two at or above `batch_size` (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    samples: list[deque[float]]  # the last `window` step times (seconds) at each width 0..max
    taken_at: list[deque[int]]  # the call (see `calls`) at which each of those steps was chosen
    medians: list[float | None]  # the median of each width's samples (None: none yet), kept as they arrive
    accepted_rate: list[float | None]  # q_k for k = 1..max (index k - 1): accepted_weight / tried_weight
    trials: list[int]  # sequences that drafted k or more so far, per k
    accepted_weight: list[float]  # per k: the trials accepted, and all the trials, each faded by its age in calls
    tried_weight: list[float]
    tries: list[int]  # steps each width was chosen while it had no timed step (a try is timed only when the
    # SETTLE_STEPS before chose the same width and no sequence was cut short, so tries are bounded, not repeated
    # until one counts)
    width: int
    widest: int | None  # the widest width tried while untimed (None: not set yet, see AdaptiveWidth._set_widest)
    calls: int = 0  # widths chosen so far
    next_probe: int = 0  # the call that starts the next probe (0: not scheduled yet)
    probes: int = 0  # probes so far (even: the wider neighbour, odd: the narrower)
    probed: int | None = None  # the width of the probe that ran last, until its outcome sets the backoff
    probe_started: int = 0  # the call that started the last probe
    backoff: int = 1  # the wait between probes, in probe periods
    last: int = -1  # the width chosen by the last call
    streak: int = 0  # calls in a row, the last included, that chose it
    faded_at: int = 0  # the call at which the acceptance weights were last faded
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=PEAK_CALLS))  # sequences of its last calls
    # how fast steps run now against the bucket's first steps (module docstring): every time is kept divided by the
    # level it was taken at; the level is the median of the latest LEVEL_STEPS steps of the bucket's width over that
    # of its first LEVEL_STEPS steps since it was chosen (`anchor`, divided by the level then; None until they ran)
    level: float = 1.0
    anchor: float | None = None
    latest: deque[float] = field(default_factory=lambda: deque(maxlen=LEVEL_STEPS))  # the width's latest times
    # while it held width 0 ([0]) and a drafting width ([1]), decayed sums over its own steps of each: the seconds
    # its steps with prompt rows took beyond a decode step of their width, the tokens its steps committed, its steps
    prompt_excess: list[float] = field(default_factory=lambda: [0.0, 0.0])
    held_tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    held_steps: list[float] = field(default_factory=lambda: [0.0, 0.0])


def _tokens_per_step(bucket: _Bucket, doubt: float = 0.0) -> list[float]:
    """Tokens a sequence commits in a step at each width 0..max: 1 + q_1 + ... + q_width (a position not yet tried
    counts 0); with `doubt`, each q_k at the lower end of its Wilson score interval of `doubt` standard errors (its
    trials: the weight they still carry), which a single accepted trial puts at 0.5 for doubt 1, not at 1."""
    tokens = [1.0]
    for q, n in zip(bucket.accepted_rate, bucket.tried_weight):
        if q is not None and doubt and n > 0:
            z2 = doubt * doubt
            q = (q + z2 / (2 * n) - doubt * (q * (1 - q) / n + z2 / (4 * n * n)) ** 0.5) / (1 + z2 / n)
        tokens.append(tokens[-1] + q if q is not None else tokens[-1])
    return tokens


@dataclass
class AdaptiveWidth:
    max_width: int
    acceptance_memory: int = 64
    margin: float = 0.02
    leave_zero_margin: float = 0.10  # the margin a drafting width must beat width 0 by (module docstring)
    probe_every: int = 64
    window: int = 16
    min_samples: int = 4
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    # (rows, seconds) of the draft's context work in recent steps: steps with more rows than their decode rows
    # (prompt rows, or the positions of a pause), and steps of decode rows only
    context_long: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=CONTEXT_SAMPLES))
    context_short: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=CONTEXT_SAMPLES))
    prompt_rows: float = 0.0  # decayed sums: prompt rows scheduled, and tokens committed by decoding sequences
    committed: float = 0.0
    per_row: float | None = None  # context_seconds_per_row, until the next context timing (read on every step)
    cold_steps: int = 0  # timed steps still to come whose times are not taken (after_idle)

    def __post_init__(self) -> None:
        if self.max_width < 1 or self.acceptance_memory < 1 or min(self.margin, self.leave_zero_margin) < 0 \
                or self.probe_every < 2 or self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError("AdaptiveWidth needs max_width >= 1, acceptance_memory >= 1, margins >= 0, "
                             "probe_every >= 2, window >= 1 and min_samples in 1..window")

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self.buckets:
            n = self.max_width + 1
            self.buckets[key] = _Bucket([deque(maxlen=self.window) for _ in range(n)],
                                        [deque(maxlen=self.window) for _ in range(n)], [None] * n,
                                        [None] * self.max_width, [0] * self.max_width, [0.0] * self.max_width,
                                        [0.0] * self.max_width, [0] * n, self.max_width, None)
        return self.buckets[key]

    def _set_widest(self, key: int, bucket: _Bucket) -> None:
        """The widths a bucket tries, set at its first step that could time one (module docstring): from the nearest
        bucket that timed its width (of two as near, the larger), if it drafts nothing or is smaller: only up to its
        width, first probed as late as it had come to probe; else (or with none) every width."""
        settled = [k for k, b in self.buckets.items() if k != key and self._settled(b)]
        bucket.widest = self.max_width
        if settled:
            near = min(settled, key=lambda k: (abs(k.bit_length() - key.bit_length()), -k))
            source = self.buckets[near]
            if source.width == 0 or near < key:
                bucket.widest = bucket.width = source.width
                bucket.backoff = source.backoff

    def _settled(self, bucket: _Bucket) -> bool:
        """Done trying widths, and its width timed: a bucket whose width others may take."""
        return self._untimed(bucket) is None and bucket.medians[bucket.width] is not None

    def _untimed(self, bucket: _Bucket) -> int | None:
        """The width to try next while some width up to `bucket.widest` has no timed step (None: all were)."""
        for w in range(self.max_width if bucket.widest is None else bucket.widest, -1, -1):
            wanted = self.min_samples if w == 0 else 1  # width 0 is never read off the line
            if len(bucket.samples[w]) < wanted and bucket.tries[w] < MAX_TRIES + wanted - 1:
                return w
        return None

    def width(self, batch_size: int, catching_up: bool = False, pause_rows: int = 0) -> int:
        """The width the next step of a batch of `batch_size` sequences should verify; `catching_up`: some sequence
        computes prompt positions in it (or a preempted sequence's), so it is not timed; `pause_rows`: the positions
        the draft has not run over yet, which a step that drafts runs first."""
        bucket = self._bucket(batch_size)
        width = self._choose(batch_size, bucket, catching_up, pause_rows)
        bucket.streak = bucket.streak + 1 if width == bucket.last else 1
        bucket.last = width
        return width

    def _choose(self, batch_size: int, bucket: _Bucket, catching_up: bool, pause_rows: int) -> int:
        bucket.calls += 1
        bucket.sizes.append(batch_size)
        if bucket.widest is None and not catching_up:
            self._set_widest(bucket_of(batch_size), bucket)
        untimed = self._untimed(bucket)
        if untimed is not None and not catching_up:
            bucket.tries[untimed] += 1
            return untimed
        # no time for its width, nor two widths to choose by: the width it was created with, never run timed
        if untimed is not None or (bucket.medians[bucket.width] is None
                                   and sum(m is not None for m in bucket.medians) < 2):
            return self._borrowed(batch_size)
        # a probe is three steps: the first proposes the probe's drafts, the last is timed (SETTLE_STEPS). Small
        # batches probe up to 4x as often: a probe of one sequence is one trial of the next position's acceptance
        # (a coin flip), and one step at a neighbouring width costs them little
        every = min(self.probe_every, max(self.probe_every // 4, self.probe_every * bucket_of(batch_size) // 8))
        if bucket.probed is not None and bucket.calls >= bucket.next_probe + PROBE_STEPS:
            self._back_off(batch_size, bucket)  # the last probe's outcome is in
            bucket.next_probe += every * bucket.backoff
        if bucket.next_probe == 0:
            bucket.next_probe = (bucket.calls // every + bucket.backoff) * every - 2 \
                if bucket.calls % every < every - 2 else bucket.calls
        wider = bucket.probes % 2 == 0
        width = bucket.width + 1 if bucket.width == 0 or (wider and bucket.width < self.max_width) \
            else bucket.width - 1
        if width == bucket.width - 1 and bucket.probes % 4 == 3 and batch_size > 2:
            width = 0  # off the line through the drafting widths: only its own steps time it (module docstring)
        if bucket.calls == bucket.next_probe and bucket.width == 0 \
                and self._catch_up_seconds(pause_rows) > CATCH_UP_SHARE * self._seconds_since_probe(bucket):
            bucket.next_probe += every  # its pass over the pauses would cost too much of the time since the last
        if bucket.calls == bucket.next_probe:
            bucket.probe_started = bucket.calls
        if bucket.next_probe <= bucket.calls < bucket.next_probe + PROBE_STEPS:
            if bucket.calls == bucket.next_probe + PROBE_STEPS - 1:
                bucket.probes += 1
                bucket.probed = width
            return width
        return bucket.width

    def _catch_up_seconds(self, pause_rows: int) -> float:
        """What a step that drafts would spend first on the draft's pass over `pause_rows` positions."""
        return pause_rows * self.context_seconds_per_row()

    @staticmethod
    def _seconds_since_probe(bucket: _Bucket) -> float:
        """About how long the bucket's steps have run since its last probe started, at width 0's step time."""
        if bucket.medians[0] is None:
            return float("inf")
        return (bucket.calls - bucket.probe_started) * bucket.medians[0] * bucket.level

    def _borrowed(self, batch_size: int) -> int:
        """The width of the nearest settled bucket (of two as near, the larger: the narrower width), else 0. A step
        that cannot time a width (prompt rows) learns nothing by trying one, and a bucket whose tries all went
        untimed (one the batch only passes through, as a burst of requests starts and drains) has no time for its
        width: trying the widest width there cost a burst of 32 requests on the bundled models 27% of its
        throughput (each try also runs the draft over every position since the last). A bucket still trying
        widths lends none: one timed try at width 3 of two sequences, while their tries at width 0 went untimed,
        had its prompt steps, and bucket 1's, run the draft over every prompt position (48 ms for two prompts of
        128 tokens on the bundled models, ten decode steps of four sequences) on a server holding width 0."""
        key = bucket_of(batch_size).bit_length()
        settled = [k for k, b in self.buckets.items() if self._settled(b)]
        if not settled:
            return 0
        return self.buckets[min(settled, key=lambda k: (abs(k.bit_length() - key), -k))].width

    def _back_off(self, batch_size: int, bucket: _Bucket) -> None:
        """The probe that just ran found its width far behind the current one, by its estimate and by the probe's
        own step: wait longer for the next (module docstring); close by either: wait probe_every (a change of speed
        shows in the probe's step before it moves the median)."""
        width = bucket.probed
        if width == 0 and bucket.width >= 2:  # width 0 beside the neighbours (_choose): the wait is theirs
            bucket.probed = None
            return
        doubt = DOUBT if bucket.width == 0 else 0.0  # the rates as the choice reads them (observe)
        scores, tokens = self._scores(batch_size, bucket, doubt), _tokens_per_step(bucket, doubt)
        samples = bucket.samples[width]
        context = self._outside_seconds_per_token(batch_size) * tokens[width] if width else 0.0
        latest = tokens[width] / max(samples[-1] * bucket.level + context, 1e-9) if samples else None
        current = scores[bucket.width]
        # a probe away from width 0 first runs the draft over every position of the pause, of every sequence: it is
        # far unless its width came halfway to taking the bucket (leave_zero_margin / 2 ahead)
        loss, factor, most = (BACKOFF_LOSS, 2, MAX_BACKOFF) if bucket.width > 0 \
            else (-self.leave_zero_margin / 2, 4, 4 * MAX_BACKOFF)
        far = current is not None and all(score is not None and score < current * (1 - loss)
                                          for score in (scores[width], latest))
        bucket.backoff = min(factor * bucket.backoff, most) if far else 1
        bucket.probed = None

    def after_idle(self) -> None:
        """The engine stood idle for IDLE_SECONDS or more before this step: the times of the next COLD_STEPS steps
        that would be timed are not taken."""
        self.cold_steps = COLD_STEPS

    def observe_context(self, batch_size: int, rows: int, seconds: float) -> None:
        """The draft's context work in a step of `batch_size` sequences ran over `rows` positions in `seconds`."""
        decode_rows = batch_size * (1 + self.max_width)  # the most a step without prompt rows gives the draft
        (self.context_long if rows > decode_rows else self.context_short).append((rows, seconds))
        self.per_row = None

    def count_step(self, batch_size: int, width: int, prompt_rows: int, committed: int, seconds: float) -> None:
        """A step of `batch_size` sequences at `width` scheduled `prompt_rows` prompt positions, committed
        `committed` tokens of decoding sequences and took `seconds`."""
        keep = 1 - 1 / CONTEXT_MEMORY
        self.prompt_rows = self.prompt_rows * keep + prompt_rows
        self.committed = self.committed * keep + committed
        bucket = self.buckets.get(bucket_of(batch_size))
        if bucket is None or not self._settled(bucket):
            return
        excess = 0.0
        if prompt_rows:  # beyond what its rows would have cost as a decode step of the bucket at that width
            decode = self._relative_times(bucket)[width]
            if decode is None:
                return
            excess = max(0.0, seconds - decode * bucket.level * batch_size / bucket_of(batch_size))
        held = int(bucket.width > 0)
        bucket.prompt_excess[held] = bucket.prompt_excess[held] * keep + excess
        bucket.held_tokens[held] = bucket.held_tokens[held] * keep + committed
        bucket.held_steps[held] = bucket.held_steps[held] * keep + 1

    def prompt_seconds_per_token(self, batch_size: int) -> tuple[float, float] | None:
        """Seconds the steps with prompt rows took beyond decode steps, per token committed, while the bucket held
        width 0 and while it drafted; None until it ran PROMPT_KNOWN steps under each."""
        bucket = self.buckets.get(bucket_of(batch_size))
        if bucket is None or min(bucket.held_steps) < PROMPT_KNOWN or min(bucket.held_tokens) <= 0:
            return None
        return bucket.prompt_excess[0] / bucket.held_tokens[0], bucket.prompt_excess[1] / bucket.held_tokens[1]

    def context_seconds_per_row(self) -> float:
        """The draft's seconds per context row: the slope between the medians of recent steps with prompt rows and
        of steps without (the first has a fixed part the second shows); 0 before any step with prompt rows."""
        if self.per_row is None:
            self.per_row = self._context_seconds_per_row()
        return self.per_row

    def _context_seconds_per_row(self) -> float:
        if not self.context_long:
            return 0.0
        rows_long = statistics.median(r for r, _ in self.context_long)
        seconds_long = statistics.median(t for _, t in self.context_long)
        if not self.context_short:
            return seconds_long / rows_long
        rows_short = statistics.median(r for r, _ in self.context_short)
        seconds_short = statistics.median(t for _, t in self.context_short)
        return max(0.0, min(seconds_long / rows_long, (seconds_long - seconds_short) / (rows_long - rows_short)))

    def _outside_seconds_per_token(self, batch_size: int) -> float:
        """What drafting costs outside the decode steps, per token a step of the bucket commits, scaled as its time:
        the draft's work on prompt positions, or, where the bucket ran long enough at width 0 and drafting, the
        more its steps with prompt rows took per token while it drafted, if that is more (module docstring)."""
        context = 0.0
        if self.committed > 0:
            context = self.prompt_rows / self.committed * self.context_seconds_per_row()
        measured = self.prompt_seconds_per_token(batch_size)
        if measured is not None:
            context = max(context, measured[1] - measured[0])
        return bucket_of(batch_size) * context

    def step_times(self, batch_size: int) -> list[float | None]:
        """The seconds per step the choice is made on, at each width (None before any width is timed), the draft's
        work on prompt positions included."""
        bucket = self._bucket(batch_size)
        return self._step_times(batch_size, bucket, _tokens_per_step(bucket))

    def _step_times(self, batch_size: int, bucket: _Bucket, tokens: list[float]) -> list[float | None]:
        per_token = self._outside_seconds_per_token(batch_size)
        return [m if m is None else m * bucket.level + (per_token * tokens[w] if w else 0.0)
                for w, m in enumerate(self._relative_times(bucket))]

    def _relative_times(self, bucket: _Bucket) -> list[float | None]:
        """Each width's step time divided by the bucket's level: its median, or off the line (module docstring)."""
        samples, medians = bucket.samples, list(bucket.medians)
        timed = [w for w, m in enumerate(medians) if m is not None and w > 0]
        if len(timed) < 2:  # no line through the drafting widths yet: width 0 may anchor it
            timed = [w for w, m in enumerate(medians) if m is not None]
        if len(timed) >= 2:
            mean_w, mean_t = sum(timed) / len(timed), sum(medians[w] for w in timed) / len(timed)
            spread = sum((w - mean_w) ** 2 for w in timed)
            slope = sum((w - mean_w) * (medians[w] - mean_t) for w in timed) / spread
            if slope <= 0 < mean_w and medians[0] is not None and mean_t > medians[0]:
                # noise (a slow spell in the narrower width's steps) tilted the line: a wider step is never cheaper,
                # and extrapolating down would pick the widest width on no evidence. The line from width 0 to the
                # drafting widths' mean instead (steeper than the true one: it errs to the narrower widths)
                slope = (mean_t - medians[0]) / mean_w
            slope = max(slope, 0.0)
            medians = [medians[w] if len(samples[w]) >= self.min_samples or (w == 0 and samples[w])
                       else max(mean_t + slope * (w - mean_w), 1e-9) for w in range(self.max_width + 1)]
        return medians

    def tokens_per_second(self, batch_size: int, width: int) -> float | None:
        """The estimate the choice is made on, for one sequence at `width` (None until a width is timed)."""
        return self._scores(batch_size, self._bucket(batch_size))[width]

    def _scores(self, batch_size: int, bucket: _Bucket, doubt: float = 0.0) -> list[float | None]:
        """tokens_per_second at every width, from one pass over the step times (`doubt`: see _tokens_per_step)."""
        tokens = _tokens_per_step(bucket, doubt)
        return [t / max(seconds, 1e-9) if seconds is not None else None
                for t, seconds in zip(tokens, self._step_times(batch_size, bucket, tokens))]

    def observe(self, batch_size: int, width: int, seconds: float, drafted_and_accepted: list[tuple[int, int]]
                ) -> None:
        """One decode step of a batch of `batch_size` sequences at `width` took `seconds`; per sequence, how many
        drafts it verified and how many of them were accepted."""
        bucket = self._bucket(batch_size)
        if bucket.last == width and bucket.streak <= SETTLE_STEPS:  # a run's first steps: not timed
            if width == 0:
                return  # and no acceptance to count
        elif self.cold_steps:
            self.cold_steps -= 1
        elif self._near_peak(batch_size, bucket):
            self._take_time(batch_size, bucket, width, seconds)
        if width:
            self._count_acceptance(bucket, width, drafted_and_accepted)
        if sum(m is not None for m in bucket.medians) < 2 or (width == bucket.width and bucket.calls % DECIDE_EVERY):
            return
        # from width 0 the rates are the probes' few trials: judged a standard error lower
        scores = self._scores(batch_size, bucket, DOUBT if bucket.width == 0 else 0.0)
        best = max(range(self.max_width + 1), key=lambda w: scores[w])
        margin = self.leave_zero_margin if bucket.width == 0 else self.margin
        if scores[best] > scores[bucket.width] * (1 + margin):
            before, bucket.width = bucket.width, best
            bucket.anchor = None  # the level holds until the new width's first LEVEL_STEPS steps anchor it
            bucket.latest.clear()
            # the new width's window starts from the steps its median was read from (the older ones said nothing
            # since), so its median stays what won it the choice, and fills with its own steps from here
            kept = self._recent(bucket, best)
            for steps in (bucket.samples[best], bucket.taken_at[best]):
                while len(steps) > kept:
                    steps.popleft()
            self._update_median(bucket, before)
            self._update_median(bucket, best)

    @staticmethod
    def _near_peak(batch_size: int, bucket: _Bucket) -> bool:
        """Whether a step of `batch_size` sequences is timed: about the most the bucket ran lately (PEAK_CALLS)."""
        peak = max(bucket.sizes, default=batch_size)
        return batch_size >= peak - peak // 8

    def _take_time(self, batch_size: int, bucket: _Bucket, width: int, seconds: float) -> None:
        # scaled to the bucket's size: steps of 17 and of 32 sequences both time bucket 32, and a width probed while
        # fewer ran must not look cheaper for it
        seconds *= bucket_of(batch_size) / batch_size
        if width == bucket.width:
            bucket.latest.append(seconds)
            if len(bucket.latest) == LEVEL_STEPS:
                now = statistics.median(bucket.latest)
                if bucket.anchor is None:  # the width's first LEVEL_STEPS steps: the level holds, from here it moves
                    bucket.anchor = now / bucket.level
                bucket.level = now / bucket.anchor
        bucket.samples[width].append(seconds / bucket.level)
        bucket.taken_at[width].append(bucket.calls)
        self._update_median(bucket, width)

    def _count_acceptance(self, bucket: _Bucket, width: int, drafted_and_accepted: list[tuple[int, int]]) -> None:
        """Per position k: the trials of this step counted, every older one faded by the calls since."""
        fade = (1 - 1 / self.acceptance_memory) ** (bucket.calls - bucket.faded_at)
        bucket.faded_at = bucket.calls
        for k in range(1, self.max_width + 1):
            # no sequence verified more drafts than the step's width: positions past it only fade
            tried = [accepted >= k for drafted, accepted in drafted_and_accepted if drafted >= k] if k <= width else []
            bucket.accepted_weight[k - 1] = bucket.accepted_weight[k - 1] * fade + sum(tried)
            bucket.tried_weight[k - 1] = bucket.tried_weight[k - 1] * fade + len(tried)
            bucket.trials[k - 1] += len(tried)
            if tried:
                bucket.accepted_rate[k - 1] = bucket.accepted_weight[k - 1] / bucket.tried_weight[k - 1]

    def _update_median(self, bucket: _Bucket, width: int) -> None:
        """The median a width's time is read from: of its whole window while it is the bucket's width (its steps
        come one after another), else of its recent steps only (STALE_CALLS)."""
        samples = bucket.samples[width]
        if samples:
            recent = len(samples) if width == bucket.width else self._recent(bucket, width)
            bucket.medians[width] = statistics.median(list(samples)[-recent:])

    def _recent(self, bucket: _Bucket, width: int) -> int:
        """How many of a width's latest steps its time is read from while it is only probed: those chosen in the
        last STALE_CALLS calls, and at least `min_samples`."""
        fresh = sum(bucket.calls - call <= STALE_CALLS for call in bucket.taken_at[width])
        return min(len(bucket.samples[width]), max(fresh, self.min_samples))
