"""The step's pieces on hand-built states: VerifyLayout's row addressing, Scheduler.commit applying a StepOutput,
and the sequence invariants (sequence.py) that hold between steps."""

import pytest
import torch

from eyas import SamplingParams
from eyas.engine.batch import ScheduledBatch, StepOutput, VerifyLayout
from eyas.engine.kv_cache import BlockAllocator
from eyas.engine.scheduler import Scheduler
from eyas.engine.sequence import Sequence, Status, check_invariants
from eyas.engine.stop import StopChecker

EOS = 1


def running(allocator: BlockAllocator, prompt: list[int], generated: list[int], num_computed: int,
            drafts: list[int] = (), max_tokens: int = 100) -> Sequence:
    seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    seq.token_ids += generated
    seq.num_computed = seq.num_draft_computed = num_computed
    seq.draft_tokens = list(drafts)
    seq.status = Status.RUNNING
    allocator.grow(seq.block_table, len(seq) + len(seq.draft_tokens))
    return seq


def test_verify_layout_of_the_worked_example():
    """sequence.py's example: A decodes t9 with drafts d10 d11, B prefills its last 4 prompt tokens, C the first 5
    of 9."""
    allocator = BlockAllocator(64, 4)
    a = running(allocator, list(range(100, 109)), [109], 9, drafts=[110, 111])
    b = running(allocator, list(range(200, 207)), [], 3)
    c = running(allocator, list(range(300, 309)), [], 0)
    layout = VerifyLayout.of(ScheduledBatch([a, b, c], [3, 4, 5]))
    assert layout.starts == [0, 3, 7] and layout.num_rows == 12
    assert layout.sampling == [0, 1]  # C's prompt is not done
    assert layout.first_verify_row == [0, 6] and layout.logit_offsets == [0, 3]
    assert layout.verify_rows() == [0, 1, 2, 6]
    assert list(layout.kept_rows(0, 1)) == [0, 1]  # t9 and the accepted d10
    assert list(layout.kept_rows(0, 0)) == [0] and list(layout.kept_rows(0, 2)) == [0, 1, 2]
    assert list(layout.kept_rows(1, 0)) == [3, 4, 5, 6] and list(layout.kept_rows(2, 0)) == [7, 8, 9, 10, 11]


def output(n: int, **fields) -> StepOutput:
    empty = {"new_tokens": [[]] * n, "num_computed": [0] * n, "draft_tokens": [[]] * n,
             "num_draft_computed": [0] * n, "pending_draft_inputs": [None] * n, "logprobs": [None] * n,
             "num_verified": [0] * n, "num_accepted": [0] * n}
    return StepOutput(**{**empty, **fields})


def scheduler(allocator: BlockAllocator, *seqs: Sequence) -> Scheduler:
    s = Scheduler(allocator, max_num_seqs=8, max_num_batched_tokens=64, stop=StopChecker({EOS}, None, 1000))
    s.running.extend(seqs)
    return s


def test_commit_applies_a_verify_step():
    """A (t9 + d10 d11) accepts d10, commits [d10, x11], gets drafts [d12, d13]; B commits its first token after its
    prompt and keeps pending draft inputs (drafting was off for it). Blocks shrink to what the next step writes."""
    allocator = BlockAllocator(64, 4)
    a = running(allocator, list(range(100, 109)), [109], 9, drafts=[110, 111])
    b = running(allocator, list(range(200, 207)), [], 3)
    allocator.grow(a.block_table, 20)  # the scheduler's lookahead
    batch = ScheduledBatch([a, b], [3, 4])
    pending = torch.zeros(4, 8)
    out = output(2, new_tokens=[[110, 311], [7]], num_computed=[11, 7], draft_tokens=[[312, 313], []],
                 num_draft_computed=[11, 3], pending_draft_inputs=[None, pending], num_verified=[2, 0],
                 num_accepted=[1, 0])
    finished = scheduler(allocator, a, b).commit(batch, out)
    assert finished == []
    assert a.token_ids[-3:] == [109, 110, 311] and a.num_computed == 11 == len(a) - 1
    assert a.draft_tokens == [312, 313] and len(a.block_table) == 4  # 12 tokens + 2 drafts -> 4 blocks of 4
    counts = a.acceptance
    assert (counts.num_verify_steps, counts.num_drafted, counts.num_accepted, counts.accepted_per_position,
            counts.verified_per_position) == (1, 2, 1, [1, 0], [1, 1])
    assert b.generated_ids == [7] and b.pending_draft_inputs == [pending] and b.num_draft_computed == 3
    for seq in (a, b):
        check_invariants(seq, 4)


def test_commit_stops_inside_an_accepted_run():
    """The run [d10, EOS, x12]: EOS ends the sequence, x12 is dropped, its blocks and pending inputs are freed."""
    allocator = BlockAllocator(64, 4)
    a = running(allocator, [5, 6, 7], [8], 3, drafts=[10, EOS])
    a.pending_draft_inputs = [torch.zeros(1, 8)]
    s = scheduler(allocator, a)
    out = output(1, new_tokens=[[10, EOS, 12]], num_computed=[6], draft_tokens=[[13]], num_draft_computed=[6],
                 num_verified=[2], num_accepted=[2])
    assert s.commit(ScheduledBatch([a], [3]), out) == [a]
    assert a.generated_ids == [8, 10, EOS] and a.finish_reason == "stop" and a.first_token_time is not None
    assert allocator.num_used == 0 and not a.pending_draft_inputs and a not in s.running
    assert s.metrics.num_verify_steps == 1 and s.metrics.num_accepted == 2
    check_invariants(a, 4)


def test_commit_respects_max_tokens():
    allocator = BlockAllocator(64, 4)
    a = running(allocator, [5, 6, 7], [8], 3, drafts=[10, 11], max_tokens=3)
    out = output(1, new_tokens=[[10, 11, 12]], num_computed=[6], num_draft_computed=[6], num_verified=[2],
                 num_accepted=[2])
    scheduler(allocator, a).commit(ScheduledBatch([a], [3]), out)
    assert a.generated_ids == [8, 10, 11] and a.finish_reason == "length"


def test_invariants_catch_a_half_updated_sequence():
    allocator = BlockAllocator(64, 4)
    a = running(allocator, [5, 6, 7], [8], 3, drafts=[10])
    check_invariants(a, 4)
    a.token_ids.append(11)  # committed but num_computed not advanced: drafts after two uncached tokens
    with pytest.raises(AssertionError, match="drafts follow the one uncomputed token"):
        check_invariants(a, 4)
    a.token_ids.pop()
    a.num_computed += 1  # the last committed token counted as cached
    with pytest.raises(AssertionError, match="never cached"):
        check_invariants(a, 4)
    b = running(allocator, [5, 6, 7], [8], 3)
    b.num_draft_computed = 1  # two positions the draft never saw, and nothing kept for them
    with pytest.raises(AssertionError, match="pending"):
        check_invariants(b, 4)
    c = running(allocator, [5, 6, 7], [8], 3, drafts=[9, 10, 11, 12, 13])
    c.block_table.pop()
    with pytest.raises(AssertionError, match="blocks"):
        check_invariants(c, 4)


def test_invariants_hold_through_preemption_pauses_and_drafting(tmp_path):
    """A real engine, speculative (MTP, K = 3, drafting off at 3 running), with a cache too small for its requests:
    sequences are preempted and recomputed, drafting pauses and resumes; the invariants hold after every step and
    the output is plain greedy's."""
    from tiny import YARN, add_mtp_weights, make_hf_checkpoint

    from eyas import LLM
    from eyas.config import SpeculativeConfig

    make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    add_mtp_weights(tmp_path)
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, disable_batch_size=3)
    llm = LLM(tmp_path, max_num_seqs=3, block_size=4, num_blocks=16, max_num_batched_tokens=16,
              speculative_config=config)
    prompts = [[3 + i] * (6 + 3 * i) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True) for i in range(5)]
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while llm.scheduler.has_work():
        llm.step()
        steps += 1
        for seq in seqs:
            check_invariants(seq, 4)
    assert llm.scheduler.num_preemptions > 0 and sum(s.acceptance.num_drafted for s in seqs) > 0
    plain = LLM(tmp_path).generate(prompts, params)
    assert [s.generated_ids for s in seqs] == [o.token_ids for o in plain]
    assert llm.allocator.num_used == 0


def test_both_draft_kinds_are_draft_heads(tmp_path):
    from tiny import YARN, add_mtp_weights, make_hf_checkpoint, mla_config, mla_weights, write_draft

    from eyas import LLM
    from eyas.engine.proposer import DraftHead

    make_hf_checkpoint(tmp_path / "target", rope_parameters=YARN)
    add_mtp_weights(tmp_path / "target")
    mtp = LLM(tmp_path / "target", speculative_method="mtp").draft
    eagle = LLM(tmp_path / "target", speculative_method="eagle",
                draft_model=write_draft(tmp_path / "mla", mla_config(), mla_weights())).draft
    assert isinstance(mtp, DraftHead) and isinstance(eagle, DraftHead)
    assert not isinstance(torch.nn.Linear(2, 2), DraftHead)


def test_a_sequence_that_outgrows_the_whole_cache_finishes_instead_of_looping(tmp_path):
    """Alone in a 48-slot cache, a request for more tokens than fit ends with "length" once the cache is full,
    whatever the chunk size; before, with small chunks, it preempted itself and recomputed forever."""
    from tiny import make_hf_checkpoint

    from eyas import LLM

    make_hf_checkpoint(tmp_path)
    for chunk in (8, 64):
        llm = LLM(tmp_path, max_num_seqs=2, block_size=4, num_blocks=12, max_num_batched_tokens=chunk)
        seq = llm.add_request(list(range(10, 29)), SamplingParams(temperature=0, max_tokens=39, ignore_eos=True))
        finished = []
        for _ in range(100):
            if not llm.scheduler.has_work():
                break
            finished += llm.step()
        assert finished == [seq] and seq.finish_reason == "length" and len(seq) == 48 + 1
        assert llm.scheduler.num_preemptions == 0 and llm.allocator.num_used == 0


def test_a_long_pause_keeps_at_most_max_pending_rows(tmp_path, monkeypatch):
    """Drafting off for the whole run (3 running, disable_batch_size 3): each sequence keeps its draft inputs as
    copies of its own rows, and once one would hold more than MAX_PENDING_ROWS, step 0 runs them (no drafts), so a
    pause holds bounded memory; that sequence's alone: the others (prompts of other lengths) stay paused. Output is
    plain greedy's."""
    from tiny import YARN, add_mtp_weights, make_hf_checkpoint

    from eyas import LLM
    from eyas.config import SpeculativeConfig
    from eyas.engine import proposer

    monkeypatch.setattr(proposer, "MAX_PENDING_ROWS", 8)
    make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    add_mtp_weights(tmp_path)
    llm = LLM(tmp_path, speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=3,
                                                                disable_batch_size=3))
    prompts = [[5, 6], [7, 8, 9], [10]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts]
    caught_up = 0
    while llm.scheduler.has_work():
        before = [s.num_draft_computed for s in seqs]
        llm.step()
        for seq, start in zip(seqs, before):
            check_invariants(seq, llm.allocator.block_size)
            if not seq.is_finished:  # step 0 ran this sequence's positions only when they were past the bound
                assert (seq.num_draft_computed != start) == (seq.num_computed - start > 8), (seq.num_computed, start)
            rows = sum(t.shape[0] for t in seq.pending_draft_inputs)
            assert rows <= 8
            for t in seq.pending_draft_inputs:  # its own rows only, not a view of the step's
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            caught_up += seq.num_draft_computed > 0 and not seq.draft_tokens and not seq.is_finished
    assert caught_up > 0 and all(s.acceptance.num_drafted == 0 for s in seqs)
    plain = LLM(tmp_path).generate(prompts, params)
    assert [s.generated_ids for s in seqs] == [o.token_ids for o in plain]
