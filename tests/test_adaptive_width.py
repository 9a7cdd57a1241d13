"""The adaptive verify width: untimed widths tried widest first, then the width with the most tokens per second
kept (with a margin against flapping), a neighbour probed for three steps every probe_every, step times as medians
and a line through them, buckets by powers of two."""

import pytest

from eyas.engine.adaptive_width import COLD_STEPS, DOUBT, IDLE_SECONDS, AdaptiveWidth, bucket_of

TIMES = {0: 0.010, 1: 0.014, 2: 0.017, 3: 0.021}  # the worked example in the module
ACCEPTED = [3, 2, 2, 1, 0]  # five sequences' accepted drafts at width 3: q = 0.8, 0.6, 0.2
# width 3 faster than in the example: both neighbours of width 2 within BACKOFF_LOSS of it (w1 9%, w3 6% behind)
CLOSE = {**TIMES, 3: 0.0195}


def run(policy: AdaptiveWidth, steps: int, batch: int = 5, times=TIMES, accepted=ACCEPTED) -> list[int]:
    widths = []
    for _ in range(steps):
        w = policy.width(batch)
        widths.append(w)
        policy.observe(batch, w, times[w], [(w, min(a, w)) for a in accepted])
    return widths


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_every_width_is_timed_widest_first_then_the_best_is_kept():
    policy = AdaptiveWidth(max_width=3)
    widths = run(policy, 21)
    # the first SETTLE_STEPS of a run of any width are not timed; width 0 runs until it has min_samples timed steps
    # of its own (it is never read off the line through the others)
    assert widths[:15] == [3] * 3 + [2] * 3 + [1] * 3 + [0] * 6
    # tokens/s per sequence: w0 1/10, w1 1.8/14 = 0.129, w2 2.4/17 = 0.141, w3 2.6/21 = 0.124
    assert widths[15:] == [2] * 6
    # per sequence, with the step time scaled to the bucket's size (5 sequences time bucket 8)
    assert policy.tokens_per_second(5, 2) == pytest.approx(2.4 / (0.017 * 8 / 5))


def test_neighbours_are_probed_in_turn_and_a_better_one_taken_only_past_the_margin():
    policy = AdaptiveWidth(max_width=3, probe_every=10)
    widths = run(policy, 50, times=CLOSE)
    # three steps in every ten (the first proposes the probe's drafts, the second settles, the third is timed): the
    # wider neighbour, then the narrower, and every other narrower probe width 0 (off the line: its own steps only)
    assert [(i, w) for i, w in enumerate(widths) if w != 2 and i >= 15] == [
        (17, 3), (18, 3), (19, 3), (27, 1), (28, 1), (29, 1), (37, 3), (38, 3), (39, 3), (47, 0), (48, 0), (49, 0)]
    # width 3 becomes 2% better than width 2 (measured on the probes): not enough past a 5% margin, enough past 1%
    for margin, expected in ((0.05, 2), (0.01, 3)):
        policy = AdaptiveWidth(max_width=3, margin=margin, probe_every=5)
        run(policy, 8)
        faster = {**TIMES, 3: 2.6 / (2.4 / 0.017) / 1.02}
        run(policy, 200, times=faster)
        assert policy.buckets[bucket_of(5)].width == expected, margin


def test_a_slow_spell_does_not_move_the_width():
    """Step times are medians of each width's recent steps: a few steps slowed 3x by another process (one in five
    of width 2's, as on a shared machine) leave the choice where it was; a moving average would flap to width 1."""
    policy = AdaptiveWidth(max_width=3, probe_every=1000)
    run(policy, 20)
    for i in range(40):
        w = policy.width(5)
        policy.observe(5, w, TIMES[w] * (3 if i % 5 == 0 else 1), [(w, min(a, w)) for a in ACCEPTED])
        assert w == 2, i


def test_widths_not_run_lately_are_read_off_a_line_through_the_others():
    """Widths from 1 up with fewer than min_samples recent steps take their time from the least-squares line through
    the medians of the timed widths from 1 up; a width with enough steps keeps its own median, and width 0 (no draft
    work: off that line) its own median from its first step."""
    policy = AdaptiveWidth(max_width=3, min_samples=3, probe_every=1000)
    for w, t in ((0, 0.004), (1, 0.013), (2, 0.016), (3, 0.025)):
        policy.observe(4, w, t, [(w, 0)] * 4)
    for _ in range(3):
        policy.observe(4, 2, 0.016, [(2, 0)] * 4)
    # line through (1, 13), (2, 16), (3, 25) ms: slope 6 ms, 18 - 6 = 12 at w = 1, 18 at w = 2 (not used: w2 has its
    # own four), 24 at w = 3; w0 its one step
    assert policy.step_times(4) == pytest.approx([0.004, 0.012, 0.016, 0.024])
    fresh = AdaptiveWidth(max_width=3, probe_every=1000)  # width 0 and one drafting width: the line runs through both
    for w, t in ((0, 0.010), (2, 0.016)):
        fresh.observe(4, w, t, [(w, 0)] * 4)
    assert fresh.step_times(4) == pytest.approx([0.010, 0.013, 0.016, 0.019])


def test_buckets_choose_separately():
    policy = AdaptiveWidth(max_width=3)
    run(policy, 16, batch=1)
    slow = {0: 0.010, 1: 0.030, 2: 0.050, 3: 0.070}  # a compute-bound batch: drafting never pays
    assert run(policy, 16, batch=16, times=slow)[-1] == 0
    assert policy.width(1) == 2 and policy.width(12) == 0  # 12 falls in bucket 16


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_width >= 1"):
        AdaptiveWidth(max_width=0)


def test_the_engine_with_an_adaptive_width_is_lossless_and_learns():
    """Greedy speculative output with the adaptive width equals plain greedy output, token for token, while the
    policy times every width of the batch sizes it ran."""
    from eyas import LLM, SamplingParams
    from eyas.config import SpeculativeConfig
    from eyas.paths import DEFAULT_MODEL

    prompts = ["def add(a, b):\n", "import os\n\nclass Cache:\n", "for i in range(", "# Sort the list\n",
               "with open(name) as f:\n", "x = ["]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(DEFAULT_MODEL, max_num_seqs=6, speculative_config=SpeculativeConfig(
        method="mtp", num_speculative_tokens=3, adaptive_width=True))
    speculative = [o.token_ids for o in llm.generate(prompts, params)]
    with llm.plain_decoding():
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert speculative == plain
    policy = llm.speculative.adaptive
    assert policy.buckets and all(policy.step_times(8)), policy.buckets
    # the draft's work on the prompts was timed, and the prompt positions counted against the tokens committed
    assert policy.context_long and policy.context_short and policy.context_seconds_per_row() > 0
    prompt_tokens = sum(len(llm.encode(p)) for p in prompts)  # decayed over the steps since: a little less
    assert 0.8 * prompt_tokens < policy.prompt_rows <= prompt_tokens and policy.committed > 0


def test_fixed_width_verifies_k_every_step_and_leaves_the_policy_as_it_was():
    """What the speed check of `eyas generate` times: the draft at K, not the width policy's trials."""
    from eyas import LLM, SamplingParams
    from eyas.config import SpeculativeConfig
    from eyas.paths import DEFAULT_MODEL

    llm = LLM(DEFAULT_MODEL, max_num_seqs=2, speculative_config=SpeculativeConfig(
        method="mtp", num_speculative_tokens=3, adaptive_width=True))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    policy = llm.speculative.adaptive
    policy.width = lambda *args: 0  # a policy that would draft nothing
    with llm.fixed_width():
        fixed = llm.generate(["def add(a, b):\n", "x = ["], params)
        assert llm.speculative.adaptive is None
    assert llm.speculative.adaptive is policy and not policy.buckets  # it learnt nothing meanwhile
    # every step verified 3 drafts but the last ones, whose drafts max_tokens caps
    assert all(o.verified_counts[2] >= o.verified_counts[0] - 2 > 0 for o in fixed), [o.verified_counts for o in fixed]
    adaptive = llm.generate(["def add(a, b):\n"], params)[0]
    assert adaptive.num_drafted == 0 and adaptive.token_ids == fixed[0].token_ids


def test_acceptance_is_the_rate_of_the_last_calls_whatever_the_batch():
    """q_k is accepted over tried, each trial faded by 1 / acceptance_memory a call of the bucket since it came: at
    batch 1 a first unlucky trial reads as the mean with the next ones, not as an EMA stuck near 0; at 16 sequences
    one step of rejections moves q_1 2.4%, not 28%; and a position not verified for a while (the bucket at width
    0) keeps its rate with little weight, so a probe's two trials re-measure it."""
    policy = AdaptiveWidth(max_width=3, acceptance_memory=64)

    def step(batch, accepted):
        policy.width(batch)  # a call of the bucket: the trials before it fade
        policy.observe(batch, 3, 0.02, [(3, accepted)] * batch)

    step(1, 2)  # position 3 rejected on its first trial
    for _ in range(9):
        step(1, 3)
    fade = 1 - 1 / 64
    later = sum(fade ** i for i in range(9))
    assert policy.buckets[1].accepted_rate == pytest.approx([1.0, 1.0, later / (later + fade ** 9)])
    for _ in range(200):
        step(1, 0)  # the old trials fade
    assert policy.buckets[1].accepted_rate[0] < 0.05

    for _ in range(64):
        step(16, 3)
    step(16, 0)
    assert 0.97 < policy.buckets[16].accepted_rate[0] < 0.98  # 16 trials against 64 calls' 650 (faded)

    parked = policy.buckets[1]
    for _ in range(4 * 64):
        policy.width(1)  # no position verified
    policy.observe(1, 1, 0.02, [(1, 1)])  # a probe's two trials, both accepted
    policy.width(1)
    policy.observe(1, 1, 0.02, [(1, 1)])
    # from under 0.05 to 0.65 (an EMA of weight 0.02 a trial: 0.09); position 2, not verified, keeps its rate
    assert parked.accepted_rate[0] > 0.6 and parked.accepted_rate[1] < 0.05


def test_each_position_is_judged_over_the_steps_that_verified_it():
    """Widths 3, 1, 0 and 2: position k's acceptance counts only the steps that verified draft k, so a narrower
    width leaves it out instead of counting it as rejected; the width-0 step is no verify step at all."""
    from eyas.engine.sequence import AcceptanceCounts

    counts = AcceptanceCounts()
    for width, accepted in ((3, 2), (1, 1), (0, 0), (2, 0)):
        counts.add(width, accepted)
    assert counts.num_verify_steps == 3 and counts.num_drafted == 6 and counts.num_accepted == 3
    assert counts.accepted_per_position == [2, 1, 0] and counts.verified_per_position == [3, 2, 1]
    assert counts.rates == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert counts.acceptance_length == pytest.approx(1 + 2 / 3 + 1 / 2)
    assert counts.tokens_per_verify_step == pytest.approx(2.0)
    assert AcceptanceCounts.total([]).acceptance_length == 1.0


def test_a_narrower_width_does_not_lower_the_reported_acceptance():
    """Every draft accepted (synthetic acceptance 1), the width cycling through 3, 1, 0 and 2 as an adaptive policy
    might: each request, the engine's totals and `eyas eval`'s summary report acceptance 1 at every position and AL
    4, the draft's at K=3, while the tokens per verify step say what the narrower widths delivered (1 + 2 on
    average)."""
    import itertools

    from eyas import LLM, SamplingParams
    from eyas.config import SpeculativeConfig
    from eyas.eval.acceptance import _add, _summary, _totals
    from eyas.paths import DEFAULT_MODEL

    llm = LLM(DEFAULT_MODEL, max_num_seqs=1, speculative_config=SpeculativeConfig(
        method="mtp", num_speculative_tokens=3, adaptive_width=True, synthetic_acceptance_rate=1.0))
    widths = itertools.cycle([3, 1, 0, 2])
    llm.speculative.adaptive.width = lambda batch_size, catching_up=False, pause_rows=0: next(widths)
    outs = llm.generate(["def add(a, b):\n", "import os\n"], SamplingParams(temperature=0, max_tokens=60,
                                                                              ignore_eos=True))
    totals = _totals()
    for out in outs:
        assert out.accepted_per_position == [1.0, 1.0, 1.0] and out.acceptance_length == 4.0
        assert 2.5 < out.tokens_per_verify_step < 3.5
        _add(totals, out)
    assert llm.scheduler.metrics.acceptance_length == 4.0 and llm.scheduler.metrics.tokens_per_verify_step < 3.5
    assert _summary(totals)["acceptance_length"] == 4.0
    assert _summary(totals)["accepted_per_position"] == [1.0, 1.0, 1.0]


def test_a_width_whose_steps_are_never_timed_is_tried_a_few_times_only():
    """A bucket whose steps cannot be timed (each sequence near its end is cut short of the width) tries an untimed
    width MAX_TRIES times, then moves on, instead of running the widest width for as long as the bucket lasts; with
    every try spent it runs the width of the nearest bucket that timed its own (none here: 0, then bucket 32's)."""
    from eyas.engine.adaptive_width import MAX_TRIES

    policy = AdaptiveWidth(max_width=3)
    zero = MAX_TRIES + policy.min_samples - 1  # width 0 is tried for min_samples timed steps
    widths = [policy.width(8) for _ in range(3 * MAX_TRIES + zero + 5)]
    assert widths == [3] * MAX_TRIES + [2] * MAX_TRIES + [1] * MAX_TRIES + [0] * zero + [0] * 5
    run(policy, 30, batch=32)
    assert policy.buckets[32].width == 2 and policy.width(8) == 2


def test_a_step_with_prompt_rows_does_not_try_a_width():
    """Prompt rows make a step untimed: an untimed bucket runs the nearest timed bucket's width (none: 0) without
    spending a try."""
    policy = AdaptiveWidth(max_width=3, probe_every=8)
    assert [policy.width(8, catching_up=True) for _ in range(5)] == [0] * 5
    assert policy.buckets[8].tries == [0, 0, 0, 0]
    widths = run(policy, 20, batch=8)
    assert widths[:15] == [3] * 3 + [2] * 3 + [1] * 3 + [0] * 6 and policy.buckets[8].width == 2
    assert policy.width(4, catching_up=True) == 2  # bucket 4, untimed, borrows bucket 8's width


def test_steps_of_fewer_sequences_in_a_bucket_are_scaled_to_its_size():
    """Bucket 32 holds steps of 17 to 32 sequences. Width 1 timed while 17 ran (49 ms) against width 0 while 32 ran
    (55 ms): scaled to 32 sequences width 1's step is 92 ms, and 1.64 tokens per 92 ms lose to 1 per 55 ms, so the
    width stays 0; unscaled, 1.64 per 49 ms would win."""
    policy = AdaptiveWidth(max_width=1, min_samples=1, probe_every=1000)
    policy.observe(32, 0, 0.055, [(0, 0)] * 32)
    policy.observe(17, 1, 0.049, [(1, 1)] * 11 + [(1, 0)] * 6)  # q_1 = 11/17 = 0.65
    policy.buckets[32].width = 0
    policy.observe(32, 0, 0.055, [(0, 0)] * 32)
    assert policy.step_times(32) == pytest.approx([0.055, 0.049 * 32 / 17])
    assert policy.width(32) == 0


def test_the_steps_of_a_draining_batch_are_not_timed():
    """Bucket 16 ran 16 sequences; as they finish, steps of 13 or fewer are not timed (scaled to 16 sequences, a step's
    part that does not grow with them would read slow), their acceptance still counted; 14 and 15 are. Once the
    bucket has run fewer for PEAK_CALLS steps, those are timed again."""
    from eyas.engine.adaptive_width import PEAK_CALLS

    policy = AdaptiveWidth(max_width=1, min_samples=1, probe_every=1000)
    run(policy, 40, batch=16, accepted=[1] * 16)
    bucket = policy.buckets[16]
    trials, width = bucket.trials[0], bucket.width
    calls = {}
    for batch in (15, 14, 13, 9):
        assert policy.width(batch) == width
        calls[batch] = bucket.calls
        policy.observe(batch, width, TIMES[width] * batch / 16, [(width, min(width, 1))] * batch)
    assert [calls[b] in bucket.taken_at[width] for b in (15, 14, 13, 9)] == [True, True, False, False]
    assert bucket.trials[0] == trials + (15 + 14 + 13 + 9 if width else 0)
    run(policy, PEAK_CALLS, batch=9, accepted=[1] * 9)
    assert bucket.calls in bucket.taken_at[bucket.width]


def test_small_batches_probe_more_often():
    """A probe of one sequence is one coin flip of the next position's acceptance: bucket 1 probes every
    probe_every / 4 steps, bucket 4 every probe_every / 2, bucket 8 and up every probe_every."""
    for batch, every in ((1, 16), (4, 32), (8, 64), (32, 64)):
        policy = AdaptiveWidth(max_width=3)
        widths = run(policy, 16 + 4 * every, batch=batch, times=CLOSE)
        width = policy.buckets[bucket_of(batch)].width
        probes = [i for i in range(16, len(widths)) if widths[i] != width]
        assert len(probes) == 12 and probes[3] - probes[0] == every, (batch, probes)


def test_probes_back_off_while_the_neighbour_is_far_behind():
    """Width 2 best, widths 1 and 3 more than BACKOFF_LOSS behind: each probe doubles the wait before the next, up to
    MAX_BACKOFF probe periods."""
    from eyas.engine.adaptive_width import MAX_BACKOFF

    far = {0: 0.010, 1: 0.015, 2: 0.018, 3: 0.021}  # q = 0.6, 0.6, 0: w1 1.6 / 15 ms, w2 2.2 / 18, w3 2.2 / 21
    policy = AdaptiveWidth(max_width=3)
    widths = run(policy, 8 + 64 * (1 + 2 + 4 + 8 + 8 + 8), times=far, accepted=[2, 2, 2, 0, 0])  # 5 sequences:
    # bucket 8, a period of 64
    starts = [i for i in range(8, len(widths)) if widths[i] != 2 and widths[i - 1] == 2]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:3] == [128, 256, 512] and all(g == 64 * MAX_BACKOFF for g in gaps[2:]), starts


def test_probes_away_from_width_0_back_off_4x_and_come_back_once_close():
    """Width 0 best and width 1 30% behind (a probe of width 1 also runs the draft over every sequence's positions
    since the last): each probe makes the wait 4x longer, up to 4 MAX_BACKOFF probe periods; once width 1 comes close,
    probes are every period again."""
    from eyas.engine.adaptive_width import MAX_BACKOFF

    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}  # w1: 1.8 tokens in 25.7 ms, 0.7x width 0's rate
    policy = AdaptiveWidth(max_width=3, probe_every=64)
    most = 4 * MAX_BACKOFF
    widths = run(policy, 16 + 16 * (1 + 4 + 16 + most + most), batch=1, times=slow)
    starts = [i for i in range(16, len(widths)) if widths[i] != 0 and widths[i - 1] == 0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:2] == [64, 256] and all(g == 16 * most for g in gaps[2:]) and len(gaps) >= 3, starts
    close = {**slow, 1: 0.0155}  # 1.8 / 15.5 ms: now ahead of width 0 by 16%, past leave_zero_margin
    widths = run(policy, 16 * most + 16 * 4, batch=1, times=close)
    starts = [i for i in range(1, len(widths)) if widths[i] != 0 and widths[i - 1] == 0]
    assert starts[1] - starts[0] == 16, starts  # the first probe saw it close
    # ... and at the third, 3 of its last min_samples steps new (each probe's last step timed), it is taken, though
    # 13 of its window's 16 steps are still the slow ones: only the latest steps of a probed width count
    assert starts[2] - starts[1] == 16 and widths[starts[2]:starts[2] + 16] == [1] * 16, widths[starts[1]:]
    assert policy.buckets[1].width == 1


def test_a_drafting_width_must_beat_width_0_by_the_larger_margin(monkeypatch):
    """Width 1 6% ahead of width 0 on its decode steps: past `margin`, not past `leave_zero_margin` (what drafting
    costs beyond its decode steps), so width 0 is kept; 15% ahead, width 1 is taken. 12% ahead it is taken only if
    its rate, which at width 0 only the probes measure (16 trials each here), is not judged a standard error lower
    (DOUBT). Between drafting widths the small margin holds: width 2 6% ahead of width 1 is taken."""
    from eyas.engine import adaptive_width

    accepted = [1] * 6 + [0] * 4  # q_1 = 0.6: 1.6 tokens a step at width 1
    for lead, doubt, expected in ((1.06, 1.0, 0), (1.15, 1.0, 1), (1.12, 1.0, 0), (1.12, 0.0, 1)):
        monkeypatch.setattr(adaptive_width, "DOUBT", doubt)
        times = {0: 0.010, 1: 0.016 / lead}
        policy = AdaptiveWidth(max_width=1, probe_every=8)
        run(policy, 200, batch=8, times={0: 0.010, 1: 0.030}, accepted=accepted)  # settles at width 0
        assert policy.buckets[8].width == 0
        run(policy, 400, batch=8, times=times, accepted=accepted)
        assert policy.buckets[8].width == expected, (lead, doubt)
    accepted = [2] * 5 + [1] * 3 + [0] * 2  # q = 0.8, 0.5: 1.8 tokens at width 1, 2.3 at width 2
    policy = AdaptiveWidth(max_width=2, probe_every=8)
    run(policy, 200, batch=8, times={0: 0.030, 1: 0.010, 2: 0.030}, accepted=accepted)
    assert policy.buckets[8].width == 1
    run(policy, 400, batch=8, times={0: 0.030, 1: 0.010, 2: 0.010 * 2.3 / 1.8 / 1.06}, accepted=accepted)
    assert policy.buckets[8].width == 2


def test_a_rate_from_few_trials_is_judged_at_the_low_end_of_its_interval():
    """From width 0 a rate rests on the probes' trials: one accepted draft (all older trials faded) is read as 0.5,
    not 1.0, and 60 trials at 0.6 about a standard error (0.06) lower."""
    from eyas.engine.adaptive_width import _tokens_per_step

    bucket = AdaptiveWidth(max_width=2)._bucket(1)
    bucket.accepted_rate, bucket.tried_weight = [1.0, 0.6], [1.0, 60.0]
    assert _tokens_per_step(bucket) == pytest.approx([1, 2.0, 2.6])
    one, many = (b - a for a, b in zip(_tokens_per_step(bucket, 1.0), _tokens_per_step(bucket, 1.0)[1:]))
    assert one == pytest.approx(0.5) and many == pytest.approx(0.6 - (0.6 * 0.4 / 60) ** 0.5, abs=0.005)


def test_steps_that_slow_down_together_do_not_make_a_width_probed_earlier_look_faster():
    """Every width's steps slow down alike over the run (contexts grow, the machine gets busier): 2x over 1,280
    calls. Width 2 stays best throughout, width 3 6% behind it; width 3's probes (one in 128 calls) are older than
    width 2's window, so compared as they were taken it would look faster. Kept divided by the level of their time
    (width 2's latest steps against its first), they are compared at one speed and width 2 is kept."""
    policy, calls, widths = AdaptiveWidth(max_width=3), 20 * 64, []
    for i in range(calls):
        w = policy.width(16)
        widths.append(w)
        policy.observe(16, w, CLOSE[w] * (1 + i / calls), [(w, min(a, w)) for a in ACCEPTED])
    bucket = policy.buckets[16]
    assert bucket.width == 2 and bucket.level == pytest.approx(2, rel=0.02)
    assert widths[32:].count(3) <= 3 * 10 and widths[32:].count(1) <= 3 * 10, widths  # probes only
    assert policy.step_times(16)[3] == pytest.approx(CLOSE[3] * 2, rel=0.05)


def test_the_drafts_work_on_prompt_positions_is_charged_to_the_drafting_widths():
    """Width 1 is 12% ahead of width 0 on its decode steps, but every committed token brings 3 prompt positions
    the draft must also run over while drafting (a server whose finished requests are replaced by new prompts): at
    the draft's measured 63 us a position, width 1 falls behind and width 0 is chosen. Without prompt traffic the
    same timings keep width 1."""
    times, accepted = {0: 0.010, 1: 0.0145}, [1] * 5 + [0] * 3  # q_1 = 5/8: 1.625 / 14.5 ms against 1 / 10 ms
    for prompt_rows, expected in ((0, 1), (300, 0)):
        policy = AdaptiveWidth(max_width=1, probe_every=1000)
        run(policy, 10, batch=8, times=times, accepted=accepted)
        assert policy.buckets[8].width == 1
        for _ in range(10):
            policy.observe_context(8, 108, 0.008)  # a prompt step: more rows than 8 sequences decode at width 1
            policy.observe_context(8, 13, 0.002)
            policy.count_step(8, 1, prompt_rows, 100, 0.0)
        assert list(policy.context_long) == [(108, 0.008)] * 10 and len(policy.context_short) == 10
        per_row = 0.006 / 95  # the slope between the two kinds of step, not 8 ms / 108 rows
        assert policy.context_seconds_per_row() == pytest.approx(per_row)
        assert policy.step_times(8)[1] == pytest.approx(0.0145 + 8 * 1.625 * prompt_rows / 100 * per_row)
        assert policy.step_times(8)[0] == pytest.approx(0.010)  # width 0 leaves prompts to the draft: no charge
        run(policy, 5, batch=8, times=times, accepted=accepted)
        assert policy.buckets[8].width == expected, prompt_rows


def test_what_prompt_steps_cost_more_while_drafting_is_charged_to_the_drafting_widths():
    """A server of 4 requests whose finished requests are replaced: while it decodes plainly they finish together and
    a step with prompt rows comes every 16 steps; while it drafts they finish apart and one comes every 4 (each 30
    ms beyond a decode step). Width 1 is 21% ahead of width 0 on its decode steps and is taken; once the bucket ran
    PROMPT_KNOWN steps drafting, its prompt steps' 1.2 ms a token against 0.5 at width 0 is charged to it, it falls
    behind and width 0 is kept (probes only). Where prompts come as often either way, width 1 is kept."""
    accepted = [1, 1, 1, 0]  # q_1 = 0.75: 1.75 tokens in 14.5 ms against 1 in 10

    def serve(policy, steps, drafting_every, times):
        widths, since = [], 0
        for _ in range(steps):
            bucket = policy.buckets.get(4)
            since += 1
            prompt = since >= (drafting_every if bucket is not None and bucket.width > 0 else 16)
            since = 0 if prompt else since
            w = policy.width(4, catching_up=prompt)
            widths.append(w)
            committed = sum(1 + min(a, w) for a in accepted[:3 if prompt else 4])
            policy.count_step(4, w, 100 if prompt else 0, committed, times[w] + (0.030 if prompt else 0.0))
            if not prompt:
                policy.observe(4, w, times[w], [(w, min(a, w)) for a in accepted])
        return widths

    for drafting_every, expected in ((4, 0), (16, 1)):
        policy = AdaptiveWidth(max_width=1, probe_every=16)
        serve(policy, 300, drafting_every, {0: 0.010, 1: 0.030})  # width 1 slow: held width 0
        assert policy.buckets[4].width == 0 and policy.prompt_seconds_per_token(4) is None  # never drafted
        widths = serve(policy, 600, drafting_every, {0: 0.010, 1: 0.0145})
        assert 1 in widths[:200]
        at_zero, drafting = policy.prompt_seconds_per_token(4)
        # a prompt step in 16: 63 tokens (some more, from the probes at width 1)
        assert 0.030 / (15 * 4 + 3) * 0.9 < at_zero <= 0.030 / (15 * 4 + 3)
        assert drafting == pytest.approx(0.030 / ((4 * 3 + 3) * 1.75) * 4 / drafting_every, rel=0.1)
        assert policy.buckets[4].width == expected
        if expected == 0:
            assert widths[-200:].count(1) <= 3 * 2  # probes only
            assert policy.step_times(4)[1] == pytest.approx(0.0145 + 4 * 1.75 * (drafting - at_zero))


def test_probes_away_from_width_0_back_off_unless_halfway_to_taking_the_bucket():
    """A probe away from width 0 lengthens the wait unless it finds its width halfway to leave_zero_margin ahead (the
    rates judged a standard error lower, as the choice reads them): with width 1 11% behind so (5% by its rates as
    measured), and with it just ahead (by 0.5%: a probe that would not move the width), the waits grow 4x; 6% ahead,
    the probes come every period and width 0 is kept (short of the 10% that takes it). A neighbour 5% behind a
    drafting width is probed every period (test_neighbours_are_probed_in_turn... with CLOSE)."""
    from eyas.engine.adaptive_width import MAX_BACKOFF

    def probe_gaps(width_1_seconds: float) -> tuple[list[int], float]:
        times = {0: 0.010, 1: width_1_seconds, 2: 0.04, 3: 0.05}  # w1: 1.8 tokens (1.8 / 18.9 ms: 0.95x width 0)
        policy = AdaptiveWidth(max_width=3, probe_every=64)
        widths = run(policy, 16 + 16 * (1 + 4 + 16 + 4 * MAX_BACKOFF), batch=1, times=times)
        starts = [i for i in range(16, len(widths)) if widths[i] != 0 and widths[i - 1] == 0]
        assert policy.buckets[1].width == 0
        doubted = policy._scores(1, policy.buckets[1], DOUBT)
        return [b - a for a, b in zip(starts, starts[1:])], doubted[1] / doubted[0]

    for seconds, low, high in ((0.0189, 0.85, 0.95), (0.0167, 1.0, 1.01)):
        gaps, ahead = probe_gaps(seconds)
        assert gaps[:3] == [64, 256, 512] and low < ahead < high, (seconds, gaps, ahead)
    gaps, ahead = probe_gaps(0.0165)
    assert set(gaps) == {16} and len(gaps) > 40 and 1.05 < ahead < 1.1, (gaps, ahead)


def test_a_new_bucket_above_a_settled_one_tries_only_the_widths_up_to_its_width():
    """Bucket 4 timed every width and chose width 0: bucket 8, new, tries width 0 only (a neighbour is probed
    later), not the widest first. While bucket 4 is still trying widths, a new bucket 8 tries all of them."""
    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}
    policy = AdaptiveWidth(max_width=3, probe_every=1000)
    run(policy, 18, batch=4, times=slow)
    assert policy.buckets[4].width == 0
    assert run(policy, 8, batch=8, times=slow) == [0] * 8
    fresh = AdaptiveWidth(max_width=3, probe_every=1000)
    run(fresh, 6, batch=4, times=slow)  # widths 3 and 2 tried so far
    assert run(fresh, 9, batch=8, times=slow) == [3] * 3 + [2] * 3 + [1] * 3


def test_a_bucket_beside_one_that_drafts_nothing_tries_width_0_only_then_probes_up():
    """Bucket 16 settled on width 0. Bucket 4, created while prompts were prefilled (no try spent), later drains
    below it: it runs width 0, not a try at width 3 (whose first step would run the draft over every sequence's
    pause). Where drafting pays at its size it still gets there, by probes."""
    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}
    policy = AdaptiveWidth(max_width=3, probe_every=64)
    assert policy.width(4, catching_up=True) == 0  # bucket 4 exists, its widths not set yet
    run(policy, 18, batch=16, times=slow)
    assert policy.buckets[16].width == 0
    assert run(policy, 8, batch=4, times=slow) == [0] * 8
    # at one sequence drafting is worth it: a bucket 1 that starts at width 0 probes its way up to width 2
    widths = run(policy, 400, batch=1)
    assert widths[:4] == [0] * 4 and policy.buckets[1].width == 2
    # with no bucket timed a new bucket tries every width, widest first
    assert run(AdaptiveWidth(max_width=3), 9, batch=4, times=slow) == [3] * 3 + [2] * 3 + [1] * 3


def test_a_bucket_still_trying_widths_lends_none():
    """Bucket 2 timed one try at width 3 and is still trying width 0 (its steps went untimed) when bucket 4
    settles on width 0: prompt steps of bucket 2 and of bucket 1 (new) run bucket 4's width 0, not bucket 2's one
    timed width 3, which would run the draft over every prompt position."""
    from eyas.engine.adaptive_width import MAX_TRIES

    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}
    policy = AdaptiveWidth(max_width=3, probe_every=64)
    assert [policy.width(2) for _ in range(3)] == [3] * 3
    policy.observe(2, 3, 0.008, [(3, 1), (3, 0)])  # the third step of its run: timed
    assert [policy.width(2) for _ in range(2 * MAX_TRIES + 2)] == [2] * MAX_TRIES + [1] * MAX_TRIES + [0, 0]
    run(policy, 12, batch=4, times=slow)
    assert policy.buckets[4].width == 0 and policy.buckets[2].medians[3] is not None
    assert policy.width(2, catching_up=True) == 0
    assert policy.width(1, catching_up=True) == 0


def test_a_new_bucket_waits_for_its_first_probe_as_long_as_the_settled_one_below():
    """Bucket 1 settled on width 0 and its probes of width 1 backed off to 4 MAX_BACKOFF periods: bucket 2's first
    probe (a probe away from width 0 runs the draft over every sequence's pause) comes that late too, not after one
    period."""
    from eyas.engine.adaptive_width import MAX_BACKOFF

    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}
    policy = AdaptiveWidth(max_width=3, probe_every=64)
    run(policy, 8 + 16 * (1 + 4 + 16 + 32 + 32), batch=1, times=slow)
    assert policy.buckets[1].backoff == 4 * MAX_BACKOFF
    widths = run(policy, 16 * 4 * MAX_BACKOFF + 8, batch=2, times=slow)  # bucket 2 probes every 16 steps at most
    first_probe = 16 * 4 * MAX_BACKOFF - 2  # the bucket's call number (from 1) the probe starts at
    assert widths[:first_probe - 1] == [0] * (first_probe - 1) and widths[first_probe - 1] == 1, widths


def test_a_tilted_line_does_not_extrapolate_a_wider_width_as_cheaper():
    """Width 1's steps slower than width 2's (a slow spell): the least-squares line falls, which would make the
    untimed width 3 the cheapest and the widest choice on no evidence; the line from width 0 to the drafting widths'
    mean is used instead."""
    policy = AdaptiveWidth(max_width=3, probe_every=1000)
    for w, t in ((0, 0.010), (1, 0.030), (2, 0.020)):
        policy.observe(4, w, t, [(w, w)] * 4)
    # mean of widths 1 and 2: 25 ms at 1.5; from 10 ms at width 0: 10 ms per width (widths 1 and 2, one step each,
    # read off it too), 40 ms at width 3
    assert policy.step_times(4) == pytest.approx([0.010, 0.020, 0.030, 0.040])
    assert policy.buckets[4].width != 3



def test_the_first_steps_of_a_run_at_width_0_are_not_timed():
    """After drafting the caches hold the draft's weights, not the target's: the first step with no draft at all is
    slower than a run of them (4.6 against 3.5 ms here). Width 1 yields 1.5 tokens in 6 ms (0.25 a ms); a run of
    width 0 0.29, but a probe of width 0 timed on its first such step 0.22, and the width would stay at 1. Here
    width 0 is slow at first (width 1 is chosen), then a run of it becomes the best: its probes find that."""
    policy = AdaptiveWidth(max_width=1, probe_every=8)
    widths = []
    for step in range(400):
        w = policy.width(2)
        run_of_zero = next((k for k, x in enumerate(reversed(widths)) if x != 0), len(widths)) + 1 if w == 0 else 0
        if not widths or w == widths[-1]:  # the engine times a step that verified the width it proposes
            seconds = 0.006 if w else 0.0075 if step < 60 else 0.0046 if run_of_zero == 2 else 0.0035
            policy.observe(2, w, seconds, [(w, w), (w, 0)])  # two sequences: q_1 = 0.5
        widths.append(w)
    assert widths[20:60].count(1) > 30  # width 1 while width 0 was slow
    assert policy.buckets[2].width == 0 and widths[-8:] == [0] * 8


def test_a_probe_is_timed_on_its_third_step():
    """A probe's second step (the first that verifies its own width) runs while the caches still hold what the
    width before it read: at 16 sequences on the bundled models 15.0 ms at width 1 after width 0 and 14.4 after
    width 2, against 13.7-14.1 for the steps after. Here width 2 holds the bucket while width 1 is slow; then a run of
    width 1 becomes 3.7% ahead of width 2 (1.625 tokens in 13.9 ms against 2.06 in 18.3), its second step 8% behind
    (15.0 ms): probes timed on that step would never take it, probes timed on their third do."""
    accepted = [2] * 7 + [1] * 3 + [0] * 6  # q_1 = 10/16, q_2 = 7/16
    policy = AdaptiveWidth(max_width=2)
    widths = []
    for step in range(1200):
        w = policy.width(16)
        run_length = next((k for k, x in enumerate(reversed(widths)) if x != w), len(widths)) + 1
        if widths and w == widths[-1]:  # the engine times a step that verified the width it proposes
            seconds = {0: 0.0125, 2: 0.0183}.get(w, 0.017 if step < 200 else 0.015 if run_length == 2 else 0.0139)
            policy.observe(16, w, seconds, [(w, min(a, w)) for a in accepted])
        widths.append(w)
    assert widths[100:200].count(2) > 90  # width 2 while width 1 was slow
    assert policy.buckets[16].width == 1 and widths[-40:] == [1] * 40


def test_the_steps_after_the_engine_stood_idle_are_not_timed():
    """After an idle spell the caches hold what ran meanwhile and the first steps run slow (5.2, 4.7, 4.7 ms against
    4.3 after them on the bundled models, once other engines had run): their times would go into the current width's
    median alone. The COLD_STEPS steps after it count for the acceptance, not for the times."""
    policy = AdaptiveWidth(max_width=3, probe_every=1000)
    run(policy, 20)
    bucket = policy.buckets[bucket_of(5)]
    assert bucket.width == 2
    samples, trials = list(bucket.samples[2]), list(bucket.trials)
    policy.after_idle()
    for _ in range(COLD_STEPS):
        w = policy.width(5)
        policy.observe(5, w, 10 * TIMES[w], [(w, min(a, w)) for a in ACCEPTED])
    assert list(bucket.samples[2]) == samples  # no time taken
    assert bucket.trials[:2] == [t + 5 * COLD_STEPS for t in trials[:2]]  # every sequence's acceptance counted
    run(policy, 1)
    assert bucket.samples[2][-1] == pytest.approx(TIMES[2] * 8 / 5)
    assert len(bucket.samples[2]) == min(len(samples) + 1, policy.window)


def test_the_engine_tells_the_policy_when_it_stood_idle():
    """A second generate call after a sleep longer than IDLE_SECONDS: the policy hears of the idle spell at that
    call's first step."""
    import time

    from eyas import LLM, SamplingParams
    from eyas.config import SpeculativeConfig
    from eyas.paths import DEFAULT_MODEL

    llm = LLM(DEFAULT_MODEL, max_num_seqs=1, speculative_config=SpeculativeConfig(
        method="mtp", num_speculative_tokens=2, adaptive_width=True))
    proposer, policy = llm.runner.proposer, llm.speculative.adaptive
    steps, idle = [], []
    observe, after_idle = proposer.observe, policy.after_idle

    def counted(*args):
        steps.append(1)
        observe(*args)

    proposer.observe = counted
    policy.after_idle = lambda: (idle.append(len(steps)), after_idle())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["def add(a, b):\n"], params)
    first_call, idle[:] = len(steps), []
    time.sleep(2 * IDLE_SECONDS)
    llm.generate(["for i in range("], params)
    assert first_call > 1 and idle and idle[0] == first_call + 1 and policy.cold_steps < COLD_STEPS


def test_a_probed_width_is_read_from_its_recent_steps_only():
    """One sequence probes each neighbour every 2 x probe_every / 4 steps (while neither is far behind): a whole
    window of its probes is recent and counts. Sixteen probe each every 2 x probe_every: only the steps of the last
    STALE_CALLS calls count (at least min_samples), so once the probed width runs faster, its few recent probes say
    so while most of its window is the slow steps from before."""
    from eyas.engine.adaptive_width import STALE_CALLS

    policy = AdaptiveWidth(max_width=3)
    run(policy, 40 * policy.probe_every, batch=1, times=CLOSE)  # both neighbours close: no backoff
    bucket = policy.buckets[1]
    assert bucket.width == 2 and len(bucket.samples[3]) == policy.window
    assert all(bucket.calls - c <= STALE_CALLS for c in bucket.taken_at[3])

    slow = {**TIMES, 3: TIMES[3] * 1.5}  # width 3 behind width 2 (the current width) before and after
    policy = AdaptiveWidth(max_width=3)
    run(policy, 40 * policy.probe_every, batch=16, times=slow)
    bucket = policy.buckets[16]
    assert bucket.width == 2 and bucket.medians[3] == pytest.approx(slow[3])
    # width 3 faster from here on, still behind width 2 (probed about every 290 calls, between width 1 and width 0)
    run(policy, 3 * STALE_CALLS, batch=16, times=TIMES)
    new = list(bucket.samples[3]).count(TIMES[3])
    assert 2 < new < policy.window // 2 and bucket.medians[3] == pytest.approx(TIMES[3]), list(bucket.samples[3])


def test_a_probe_away_from_width_0_waits_while_its_pass_over_the_pauses_would_cost_too_much():
    """A probe away from width 0 first runs the draft over every position the sequences computed while it was off:
    with the draft at 30 us a position (its timed context work) and 32 sequences pausing 100 positions each, 96 ms
    against 10 ms steps at width 0, the first probe waits (a probe period at a time) until that is at most
    CATCH_UP_SHARE of the steps since the bucket began, 480 steps; without pauses it comes after one period."""
    from eyas.engine.adaptive_width import CATCH_UP_SHARE

    slow = {0: 0.010, 1: 0.0257, 2: 0.04, 3: 0.05}  # width 0 the best
    first = {}
    for pause_rows in (0, 3200):
        policy = AdaptiveWidth(max_width=3, probe_every=64)
        for _ in range(4):
            policy.observe_context(32, 1000, 0.030)
        widths = []
        for _ in range(700):
            w = policy.width(32, pause_rows=pause_rows)
            widths.append(w)
            policy.observe(32, w, slow[w], [(w, min(a, w)) for a in [2] * 32])
        first[pause_rows] = next(i for i in range(16, len(widths)) if widths[i] != 0)
    assert first[0] < 64 + 16
    wait = 3200 * 30e-6 / (CATCH_UP_SHARE * 0.010)
    assert wait <= first[3200] < wait + 64, first
