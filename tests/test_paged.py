"""The paged, absorbed attention path computes what the no-cache, expanded path computes."""

import os
import re

import pytest
import torch
from tiny import YARN, add_mtp_weights, make_hf_checkpoint

from eyas import load_model
from eyas.engine.kv_cache import BlockAllocator, LatentCache
from eyas.models.attention import AttentionMetadata


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(path, rope_parameters=YARN)
    return load_model(path)


@pytest.fixture
def kernel_on_float32(monkeypatch):
    """The latent kernel reading float32 latents, as it does where the CPU has AVX-512 or AVX2
    (`latent_kernel.reads`), so its paths are checked on every CPU."""
    from eyas.models import latent_kernel

    library = latent_kernel._library()
    if library is not None:
        monkeypatch.setattr(library, "fits_registers", True)


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_chunked_prefill_then_decode_in_one_ragged_batch(model):
    """Three sequences of different lengths: prefilled in uneven chunks, then decoded token by token together;
    every step's logits equal the no-cache forward of the same prefix."""
    torch.manual_seed(0)
    block_size = 4
    lengths = [23, 7, 14]
    seqs = [torch.randint(0, 96, (n,)).tolist() for n in lengths]
    alloc = BlockAllocator(num_blocks=32, block_size=block_size)
    cache = LatentCache(model.config.num_hidden_layers, 32, block_size, model.config.latent_dim, torch.float32)
    tables = [[] for _ in seqs]
    # interleave allocation so block tables are not contiguous
    for t in range(max(lengths)):
        for b, n in enumerate(lengths):
            if t < n:
                alloc.grow(tables[b], t + 1)
    computed = [0, 0, 0]
    worst = 0.0
    schedule = [[5, 7, 3], [11, 0, 6], [7, 0, 5], [0, 0, 0]]  # prompt chunks per step (0: not in this step)
    prompt_len = [n - 4 for n in lengths]  # the last 4 tokens of each sequence are decoded one at a time
    for chunk in schedule:
        rows = [b for b in range(3) if min(chunk[b], prompt_len[b] - computed[b]) > 0]
        if not rows:
            break
        q_lens = [min(chunk[b], prompt_len[b] - computed[b]) for b in rows]
        ids = [t for b, q in zip(rows, q_lens) for t in seqs[b][computed[b]:computed[b] + q]]
        attn = AttentionMetadata.build(q_lens, [computed[b] + q for b, q in zip(rows, q_lens)],
                                       [tables[b] for b in rows], block_size)
        with torch.no_grad():
            hidden, _ = model.model(torch.tensor(ids), attn, cache)
            logits = model.compute_logits(hidden)
        start = 0
        for b, q in zip(rows, q_lens):
            ref = full_logits(model, seqs[b][:computed[b] + q])[computed[b]:]
            worst = max(worst, (logits[start:start + q] - ref).abs().max().item())
            start += q
            computed[b] += q
    assert computed == prompt_len
    for _ in range(4):  # decode: one token per sequence, all three in one batch
        attn = AttentionMetadata.build([1, 1, 1], [c + 1 for c in computed], tables, block_size)
        ids = [seqs[b][computed[b]] for b in range(3)]
        with torch.no_grad():
            hidden, _ = model.model(torch.tensor(ids), attn, cache)
            logits = model.compute_logits(hidden)
        for b in range(3):
            computed[b] += 1
            ref = full_logits(model, seqs[b][:computed[b]])[-1]
            worst = max(worst, (logits[b] - ref).abs().max().item())
    assert computed == lengths
    assert worst < 1e-4, worst


def test_absorbed_and_expanded_attention_agree(model):
    """One layer's attention, same inputs: absorbed over the latent cache vs expanded per-head K/V."""
    attn_layer = model.model.layers[1].self_attn
    torch.manual_seed(3)
    x = torch.randn(1, 12, model.config.hidden_size)
    cos, sin = model.model.rotary(torch.arange(12))
    with torch.no_grad():
        expanded = attn_layer(x, cos, sin)[0]
        cache = torch.zeros(16, model.config.latent_dim)
        meta = AttentionMetadata.build([12], [12], [[0, 1, 2, 3]], 4)
        absorbed = attn_layer(x[0], cos, sin, meta, cache)
    assert (expanded - absorbed).abs().max().item() < 1e-5


def test_cache_stores_only_latent_and_rope_key():
    """DeepSeek-V3: 61 layers x (512 + 64) values per token; 1/71 of expanded K/V (128 heads x (192 + 128))."""
    cache = LatentCache(num_layers=61, num_blocks=1, block_size=16, latent_dim=512 + 64, dtype=torch.bfloat16,
                        device="meta")
    assert cache.bytes_per_token == 61 * 576 * 2
    expanded_values = 128 * ((128 + 64) + 128)
    assert expanded_values == 40960 and round(expanded_values / 576) == 71


def test_engine_cache_size_follows_config(model):
    from eyas.engine.model_runner import ModelRunner

    runner = ModelRunner(model, num_blocks=2, block_size=4)
    c = model.config
    assert runner.cache.tensors.shape == (c.num_hidden_layers, 8, c.kv_lora_rank + c.qk_rope_head_dim)
    assert runner.cache.bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_packed_projections_compute_the_same(tmp_path, q_lora_rank):
    """pack_for_inference fuses gate/up and the MLA input projections and re-lays weights out for small-batch
    matmuls: same outputs (no-cache and paged, absorbed), same state_dict, and the packed weights are frozen (a
    packed module must not be trained)."""
    from eyas.models.layers import pack_for_inference

    make_hf_checkpoint(tmp_path, rope_parameters=YARN, q_lora_rank=q_lora_rank)
    model = load_model(tmp_path, dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(ids)
    expected_paged = paged_logits(model, ids)
    pack_for_inference(model)
    attn = model.model.layers[0].self_attn
    assert attn.q_kv_a is not None and model.model.layers[1].mlp.experts[0].gate_up is not None
    # CPU: weights stored transposed ([in, out] contiguous), W_UK row-major
    assert model.lm_head.weight.t().is_contiguous() and attn.q_kv_a.t().is_contiguous()
    assert attn.w_uk.is_contiguous() and attn.w_uk.shape == (model.config.num_attention_heads,
                                                              model.config.qk_nope_head_dim, model.config.kv_lora_rank)
    torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_logits(model, ids), expected_paged, rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not attn.kv_a_proj_with_mqa.weight.requires_grad and not model.lm_head.weight.requires_grad
    pack_for_inference(model)  # idempotent
    torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_logits(model, ids), expected_paged, rtol=1e-5, atol=1e-5)


def test_packing_keeps_shared_weights_shared():
    """The shipped target's MTP layer shares the lm_head and the embedding: after pack_for_inference (which re-lays
    linear weights out) they are still one tensor each, with the same values."""
    from eyas.models.layers import pack_for_inference
    from eyas.paths import DEFAULT_MODEL

    model = load_model(DEFAULT_MODEL, dtype="float32")
    mtp = model.model.mtp_layer(0)
    assert mtp.shared_head.head.weight is model.lm_head.weight
    head = model.lm_head.weight.detach().clone()
    pack_for_inference(model)
    assert mtp.shared_head.head.weight is model.lm_head.weight and not model.lm_head.weight.is_contiguous()
    assert mtp.embed_tokens.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, head)


def paged_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of each row of ids [batch, seq]: a prefill of all but the last 2 tokens, then 2 one-token steps."""
    batch, seq = ids.shape
    block_size = 4
    cache = LatentCache(model.config.num_hidden_layers, 16, block_size, model.config.latent_dim, torch.float32)
    tables = [list(range(b * 8, b * 8 + 8)) for b in range(batch)]
    out = []
    for start, stop in [(0, seq - 2), (seq - 2, seq - 1), (seq - 1, seq)]:
        attn = AttentionMetadata.build([stop - start] * batch, [stop] * batch, tables, block_size)
        with torch.no_grad():
            hidden, _ = model.model(ids[:, start:stop].flatten(), attn, cache)
            out.append(model.compute_logits(hidden).view(batch, stop - start, -1))
    return torch.cat(out, dim=1)


def run_steps(model, steps: tuple[list[int], ...]) -> tuple[float, list[list[int]]]:
    """Each step's query lengths (one per sequence) through the paged forward, chunk after chunk of random
    sequences: the largest difference from the no-cache forward's logits, and each step's groups' query lengths."""
    block_size = 4
    lengths = [sum(step[b] for step in steps) for b in range(len(steps[0]))]
    seqs = [torch.randint(0, 96, (n,)).tolist() for n in lengths]
    alloc = BlockAllocator(num_blocks=64, block_size=block_size)
    cache = LatentCache(model.config.num_hidden_layers, 64, block_size, model.config.latent_dim, torch.float32)
    tables = [[] for _ in seqs]
    for b, n in enumerate(lengths):
        alloc.grow(tables[b], n)
    computed = [0] * len(seqs)
    worst, groups = 0.0, []
    for q_lens in steps:
        attn = AttentionMetadata.build(q_lens, [c + q for c, q in zip(computed, q_lens)], tables, block_size)
        groups.append(sorted(g.query_rows.shape[1] for g in attn.groups))
        ids = [t for b, q in enumerate(q_lens) for t in seqs[b][computed[b]:computed[b] + q]]
        with torch.no_grad():
            logits = model.compute_logits(model.model(torch.tensor(ids), attn, cache)[0])
        start = 0
        for b, q in enumerate(q_lens):
            ref = full_logits(model, seqs[b][:computed[b] + q])[computed[b]:]
            worst = max(worst, (logits[start:start + q] - ref).abs().max().item())
            start += q
            computed[b] += q
    return worst, groups


def test_long_chunks_and_short_rows_in_one_step(model):
    """A step mixing prompt chunks longer than SHORT_QUERY (each attended as its own group) with short rows (padded
    together), the long ones in the middle of the flat batch: logits equal the no-cache forward."""
    from eyas.models.attention import SHORT_QUERY

    torch.manual_seed(1)
    # (query lengths per sequence) per step: long-short-long, then short-long-short, then decode rows
    steps = ([2, SHORT_QUERY + 9, 3], [SHORT_QUERY + 1, 1, SHORT_QUERY + 2], [9, 20, 1], [1, 1, 1])
    worst, groups = run_steps(model, steps)
    assert [len(g) for g in groups] == [1 + sum(q > SHORT_QUERY for q in q_lens) for q_lens in steps]
    assert worst < 1e-4, worst


def test_a_long_tail_beside_short_rows_attends_alone(model):
    """A prompt's last chunk of up to SHORT_QUERY rows beside verify rows of 2-3 (four sequences): the tail gets a
    group of its own instead of padding every sequence to its length; logits equal the no-cache forward."""
    torch.manual_seed(2)
    worst, groups = run_steps(model, ([2, 2, 12, 2], [1, 1, 1, 1], [3, 14, 3, 3]))
    assert groups == [[2, 12], [1], [3, 14]]
    assert worst < 1e-4, worst


def test_a_long_context_beside_short_ones_attends_alone(model):
    """Decode rows of one 150-token context and four 9-token ones: the long one attends alone, so the others are
    not padded to 150 keys; logits equal the no-cache forward. Three short contexts beside it stay together."""
    torch.manual_seed(3)
    worst, groups = run_steps(model, ([140, 8, 8, 8, 8], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]))
    assert groups[1:] == [[1, 1], [1, 1]]  # the four short sequences, then the long one
    assert worst < 1e-4, worst
    from eyas.models.attention import _long_contexts
    assert _long_contexts([0, 1, 2, 3, 4], [151, 9, 9, 9, 9]) == {0}
    assert _long_contexts([0, 1, 2, 3, 4], [20, 9, 9, 9, 9]) == set()  # one more call costs more than the padding
    assert _long_contexts([0, 1, 2, 3], [300, 290, 10, 10]) == {0, 1}


def test_with_free_padding_a_long_context_in_its_lane_stays_in_the_batch():
    """Where the attention reads only the positions each row sees (the latent kernel: `free_padding`), a long
    context read in place from its lane is padded beside the short ones, not attended alone; one past its lane
    (gathered, so its padding would be copied) still is. The attention is the same either way."""
    from eyas.models import latent_kernel
    from eyas.models.attention import paged_latent_attention

    block_size = 4
    alloc = BlockAllocator(num_blocks=256, block_size=block_size, num_lanes=6)  # lanes of 42 blocks, 4 spare
    lanes = (alloc.num_lanes, alloc.lane_blocks)
    tables = [[] for _ in range(5)]
    seq_lens = [150, 9, 9, 9, 9]
    for table, n in zip(tables, seq_lens):
        alloc.grow(table, n)
    q_lens = [1] * 5

    def groups(attn: AttentionMetadata) -> list[int]:
        return sorted(len(g.rows) for g in attn.groups)

    split = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, lanes=lanes)
    padded = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, lanes=lanes, free_padding=True)
    assert groups(split) == [1, 4] and groups(padded) == [5]
    assert all(g.kv_view is not None for g in padded.groups)
    torch.manual_seed(4)
    latent = torch.randn(alloc.num_blocks * block_size, 24)
    q = torch.randn(5, 3, 24)
    out_split, out_padded = (paged_latent_attention(q, latent, attn, 16, 0.3) for attn in (split, padded))
    if latent_kernel.reads(latent):  # each row computed alike whatever rows share its call
        assert torch.equal(out_split, out_padded)
    torch.testing.assert_close(out_split, out_padded, rtol=1e-5, atol=1e-5)
    # grown past its lane (gathered): attended alone with free padding too
    alloc.grow(tables[0], 180)
    seq_lens[0] = 180
    past = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, lanes=lanes, free_padding=True)
    assert groups(past) == [1, 4]


def test_paged_mha_attention_with_groups():
    """The Llama-style paged attention against plain causal SDPA per sequence, with a long chunk between short rows
    and grouped kv heads."""
    import torch.nn.functional as F

    from eyas.models.attention import SHORT_QUERY, paged_attention

    torch.manual_seed(2)
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    lengths, q_lens = [9, SHORT_QUERY + 8, 5], [1, SHORT_QUERY + 3, 2]
    keys = [torch.randn(n, 2, kv_heads, dim) for n in lengths]
    tables, slot = [], 0
    cache = torch.zeros(64 * block_size, 2, kv_heads, dim)
    for kv in keys:
        blocks = list(range(slot, slot + -(-len(kv) // block_size)))
        slot += len(blocks)
        tables.append(blocks)
        for p in range(len(kv)):
            cache[blocks[p // block_size] * block_size + p % block_size] = kv[p]
    kv_starts = [3, 0, 2]  # sequences 0 and 2 attend only from these positions on
    attn = AttentionMetadata.build(q_lens, lengths, tables, block_size, kv_starts=kv_starts)
    assert len(attn.groups) == 2
    q = torch.randn(sum(q_lens), heads, dim)
    out = paged_attention(q, cache, attn, scale=dim ** -0.5)
    start = 0
    for kv, n, ql, first in zip(keys, lengths, q_lens, kv_starts):
        k = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, n, dim]
        v = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        keys_pos = torch.arange(n)[None, :]
        mask = (keys_pos <= torch.arange(n - ql, n)[:, None]) & (keys_pos >= first)
        ref = F.scaled_dot_product_attention(q[start:start + ql].transpose(0, 1), k, v, attn_mask=mask)
        torch.testing.assert_close(out[start:start + ql], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += ql
    # each sequence alone, with a spare block in its table: one-sequence groups build their fields on their own path
    for b in range(len(lengths)):
        alone = AttentionMetadata.build([q_lens[b]], [lengths[b]], [tables[b] + [63]], block_size,
                                        kv_starts=[kv_starts[b]])
        rows = slice(sum(q_lens[:b]), sum(q_lens[:b + 1]))
        torch.testing.assert_close(paged_attention(q[rows], cache, alone, scale=dim ** -0.5), out[rows],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="keys start"):
        AttentionMetadata.build([2], [5], [[0, 1]], block_size, kv_starts=[4])


def test_lanes_keep_each_context_one_contiguous_run():
    """With lanes, a new table starts a whole free lane and grows along it; past its lane, or with no whole lane
    free, it takes free blocks from the top of the cache down; every block stays usable by every table."""
    alloc = BlockAllocator(num_blocks=10, block_size=4, num_lanes=3)  # lanes of 3 blocks: 0-2, 3-5, 6-8; 9 spare
    assert (alloc.num_lanes, alloc.lane_blocks) == (3, 3)
    a, b = [], []
    alloc.grow(a, 5)
    alloc.grow(b, 1)
    assert a == [0, 1] and b == [3]
    alloc.grow(a, 16)  # its lane ends at block 2: then the highest free block
    assert a == [0, 1, 2, 9]
    c = []
    alloc.grow(c, 12)
    assert c == [6, 7, 8]  # lane 2 was still whole
    d = []
    alloc.grow(d, 4)  # no whole lane free
    assert d == [5] and alloc.num_free == 1
    alloc.grow(b, 8)  # block 4 is free and next along b's lane
    assert b == [3, 4] and alloc.num_free == 0
    alloc.free(a)
    alloc.free(c)
    e = []
    alloc.grow(e, 4)
    assert e == [0] and alloc.num_free == 6


@pytest.mark.parametrize("num_lanes", [0, 3, 8])
def test_the_allocator_never_hands_out_a_block_twice(num_lanes):
    import random

    rng = random.Random(num_lanes)
    alloc = BlockAllocator(num_blocks=40, block_size=4, num_lanes=num_lanes)
    tables = [[] for _ in range(8)]
    for _ in range(3000):
        t = rng.choice(tables)
        op = rng.random()
        if op < 0.5:
            want = len(t) * 4 + rng.randint(1, 12)
            if alloc.can_grow(t, want):
                alloc.grow(t, want)
        elif op < 0.8:
            alloc.shrink(t, rng.randint(0, len(t) * 4))
        else:
            alloc.free(t)
        held = [block for table in tables for block in table]
        assert len(held) == len(set(held)) and alloc.num_used == len(held)
        assert all(0 <= block < 40 for block in held)


def test_lane_views_compute_what_gathering_computes():
    """Attention over tables from a churned lane allocator: read in place (lanes, runs) it equals the gathered
    path, for the latent (MLA) and the per-head (MHA) cache, with both paths exercised, and with batches split into
    the sequences read in place and those gathered (past their lane, or given none)."""
    import random

    from eyas.models.attention import SHORT_QUERY, paged_attention, paged_latent_attention

    rng = random.Random(3)
    torch.manual_seed(3)
    in_place = gathered = split = 0
    for _ in range(300):
        block_size = rng.choice([4, 16])
        alloc = BlockAllocator(rng.randint(8, 80), block_size, num_lanes=rng.choice([2, 4, 8]))
        live = []
        for _ in range(rng.randint(1, 12)):
            if live and rng.random() < 0.3:
                alloc.free(live.pop(rng.randrange(len(live))))
            table, want = [], rng.randint(1, 60)
            if not alloc.can_grow(table, want):
                break
            alloc.grow(table, want)
            live.append(table)
        if not live:
            continue
        seq_lens = [rng.randint(1, len(t) * block_size) for t in live]
        q_lens = [min(s, rng.choice([1, 1, 2, 4, rng.randint(1, 30)])) for s in seq_lens]
        lanes = AttentionMetadata.build(q_lens, seq_lens, live, block_size, lanes=(alloc.num_lanes, alloc.lane_blocks))
        gather = AttentionMetadata.build(q_lens, seq_lens, live, block_size)
        in_place += sum(g.kv_view is not None for g in lanes.groups if g.query_rows.shape[0] > 1)
        gathered += sum(g.kv_view is None for g in lanes.groups)
        short = [g for g in lanes.groups if g.query_rows.shape[1] <= SHORT_QUERY]
        split += len(short) == 2 and short[0].kv_view is not None and short[1].kv_view is None
        assert torch.equal(lanes.slot_mapping, gather.slot_mapping)
        latent = torch.randn(alloc.num_blocks * block_size, 24)
        q = torch.randn(sum(q_lens), 3, 24)
        torch.testing.assert_close(paged_latent_attention(q, latent, lanes, 16, 0.3),
                                   paged_latent_attention(q, latent, gather, 16, 0.3), rtol=1e-5, atol=1e-5)
        kv = torch.randn(alloc.num_blocks * block_size, 2, 2, 8)
        q = torch.randn(sum(q_lens), 4, 8)
        torch.testing.assert_close(paged_attention(q, kv, lanes, 0.3), paged_attention(q, kv, gather, 0.3),
                                   rtol=1e-5, atol=1e-5)
    assert in_place > 30 and gathered > 30 and split > 10, (in_place, gathered, split)


def test_the_engine_decodes_the_same_with_and_without_lanes(tmp_path):
    """Greedy output through the engine (batched, chunked prefill, MTP drafts) is identical with the allocator's
    lanes and without, and with lanes the batched decode steps read the cache in place."""
    import eyas.engine.llm as engine_llm
    from eyas import LLM, SamplingParams

    make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    add_mtp_weights(tmp_path)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 30, 9, 17, 2, 25)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs, views = {}, []
    build = AttentionMetadata.build

    def spy(*args, **kwargs):
        attn = build(*args, **kwargs)
        views.extend(g.kv_view is not None for g in attn.groups if g.query_rows.shape[0] > 1)
        return attn

    for lanes in (True, False):
        for method in (None, "mtp"):
            allocator = engine_llm.BlockAllocator
            if not lanes:
                engine_llm.BlockAllocator = lambda n, size, num_lanes=0, plain=allocator: plain(n, size)
            try:
                llm = LLM(tmp_path, max_num_seqs=6, block_size=4, max_num_batched_tokens=24,
                          speculative_method=method)
            finally:
                engine_llm.BlockAllocator = allocator
            assert (llm.allocator.num_lanes > 0) == lanes
            views.clear()
            AttentionMetadata.build = spy
            try:
                outputs[lanes, method] = [o.token_ids for o in llm.generate(prompts, params)]
            finally:
                AttentionMetadata.build = build
            assert any(views) == lanes
    assert outputs[True, None] == outputs[False, None] == outputs[True, "mtp"] == outputs[False, "mtp"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_batched_attention_runs_on_parallel_threads_with_the_same_result(monkeypatch, dtype):
    """A decode step's attention over 8 contexts of 300 positions runs on parallel_threads() (here 2), one sequence
    at a time on 1, and the outputs are equal bit for bit; torch's thread count is back to 1 after. float32 runs
    the C kernel (on 2, two calls of 4 sequences, one on the calling thread), float64 torch's SDPA."""
    import threading

    import torch.nn.functional as F

    from eyas import threads
    from eyas.models import attention, latent_kernel

    torch.manual_seed(4)
    block_size, batch, context, heads, width = 4, 8, 300, 4, 40
    tables = [list(range(b * 75, (b + 1) * 75)) for b in range(batch)]
    attn = AttentionMetadata.build([1] * batch, [context] * batch, tables, block_size)
    cache = torch.randn(batch * 75 * block_size, width, dtype=dtype)
    q = torch.randn(batch, heads, width, dtype=dtype)
    sdpa_threads, kernel_threads = [], []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_threads.append(torch.get_num_threads()) or sdpa(*a, **k))
    library = latent_kernel._library()
    run = library.latent_attention_run

    class Counted:  # the library's function, noting each call's batch rows and thread
        def __call__(self, *args):
            kernel_threads.append((args[8], threading.get_ident()))
            return run(*args)

    fake = type("L", (), {"latent_attention_run": Counted(), "fits_registers": True})()  # float32 latents too
    monkeypatch.setattr(latent_kernel, "_library", lambda: fake)
    assert torch.get_num_threads() == 1
    outs = []
    for parallel in (1, 2):
        monkeypatch.setattr(threads, "_parallel_threads", parallel)
        for group in attn.groups:
            group.head_bias = None
        outs.append(attention.paged_latent_attention(q, cache, attn, 32, 0.1))
    if dtype == torch.float32:
        assert not sdpa_threads and [rows for rows, _ in kernel_threads] == [8, 4, 4]
        # the second call's first part on the calling thread, the other on the pool's
        here = threading.get_ident()
        assert kernel_threads[0][1] == here and len({kernel_threads[1][1], kernel_threads[2][1]} - {here}) == 1
        assert here in (kernel_threads[1][1], kernel_threads[2][1])
    else:
        assert sdpa_threads == [1, 2] and not kernel_threads
    assert torch.get_num_threads() == 1
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("width, value_dim, heads, positions", [(576, 512, 4, 1), (576, 512, 4, 4), (32, 24, 4, 3),
                                                                 (40, 20, 2, 5), (37, 21, 3, 2)])
def test_the_latent_kernel_computes_what_sdpa_computes(width, value_dim, heads, positions, kernel_on_float32):
    """The C kernel against torch's SDPA: latents read through batch strides (a lane view), causal masks, contexts
    of different lengths and widths that are not multiples of its vector width; each row's numbers are the same
    computed alone as beside other rows and other sequences (decode and verify agree bit for bit)."""
    import torch.nn.functional as F

    from eyas.models.latent_kernel import latent_attention, on_tiles, takes

    torch.manual_seed(0)
    batch, context = 3, 45
    kv = torch.randn(batch, context + 7, width)[:, :context]  # a strided batch, as lanes of the cache give
    q = torch.randn(batch, positions * heads, width)
    bias = torch.zeros(batch, positions, context)
    for b, length in enumerate((45, 30, 12)):  # causal: position j of sequence b sees length - positions + j + 1
        for j in range(positions):
            bias[b, j, length - positions + j + 1:] = float("-inf")
    assert takes(q, kv, value_dim)
    out = latent_attention(q, kv, bias, 0.2, value_dim)
    expected = F.scaled_dot_product_attention(q[:, None], kv[:, None], kv[:, None], scale=0.2,
                                              attn_mask=bias.repeat_interleave(heads, 1)[:, None])[:, 0, :, :value_dim]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
    last = latent_attention(q[2:, -heads:], kv[2:], bias[2:, -1:], 0.2, value_dim)  # one sequence's last position
    assert torch.equal(last, out[2:, -heads:])
    # latents kept in bfloat16 (and queries in bfloat16, as a bfloat16 model's are): what float32 arithmetic over
    # their values gives (on AMX tiles, with each softmax weight rounded to bfloat16: off by at most 2^-9 of the
    # largest value, as each weight is off by 2^-9 of itself), rows alike alone or not
    half, q = kv.bfloat16(), q.bfloat16().float()
    assert takes(q, half, value_dim) and takes(q.bfloat16(), half, value_dim) and not takes(q.half(), half, value_dim)
    out = latent_attention(q, half, bias, 0.2, value_dim)
    assert out.dtype == torch.float32
    exact = latent_attention(q, half.float(), bias, 0.2, value_dim)
    if on_tiles():
        assert 0 < (out - exact).abs().max() <= half[..., :value_dim].float().abs().max() * 2 ** -9
    else:
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=2e-6)
    assert torch.equal(latent_attention(q[2:, -heads:], half[2:], bias[2:, -1:], 0.2, value_dim), out[2:, -heads:])
    # bfloat16 queries in, bfloat16 out: the float32 result rounded, as torch rounds it; over float32 latents too
    for latents in (half, half.float()):
        wide = latent_attention(q, latents, bias, 0.2, value_dim)
        narrow = latent_attention(q.bfloat16(), latents, bias, 0.2, value_dim)
        assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_latent_kernel_gives_a_verify_row_what_decoding_its_position_gives_and_reads_only_its_context(dtype):
    """Verify rows across the kernel's blocks of positions (contexts of 61 to 200, four positions each) are bit for
    bit what decoding each position alone over its own context gives, and no cache slot outside a context is read:
    slots before a sequence's first key and past its context hold NaN, and the outputs do not."""
    from eyas.models.latent_kernel import latent_attention

    torch.manual_seed(2)
    heads, positions, width, value_dim = 4, 4, 576, 512
    lengths, starts = (61, 64, 130, 200), (0, 5, 0, 70)
    kv = torch.full((len(lengths), 210, width), float("nan"), dtype=dtype)
    bias = torch.full((len(lengths), positions, 210), float("-inf"))
    for b, (length, start) in enumerate(zip(lengths, starts)):
        kv[b, start:length] = torch.randn(length - start, width).to(dtype)
        for j in range(positions):
            bias[b, j, start:length - positions + j + 1] = 0.0
    q = torch.randn(len(lengths), positions * heads, width).to(dtype)
    verify = latent_attention(q, kv, bias, 0.1, value_dim)
    assert not verify.isnan().any()
    for b, length in enumerate(lengths):
        for j in range(positions):
            seen = length - positions + j + 1
            rows = slice(j * heads, (j + 1) * heads)
            decode = latent_attention(q[b:b + 1, rows], kv[b:b + 1, :seen], bias[b:b + 1, j:j + 1, :seen], 0.1,
                                      value_dim)
            assert torch.equal(decode[0], verify[b, rows])


def test_the_latent_kernel_reads_float32_latents_only_where_its_accumulators_fit_the_registers(monkeypatch):
    """Built for AVX-512 or AVX2 with FMA the kernel reads float32 and bfloat16 latents; built for other CPUs, where
    its float32 path is slower than SDPA, bfloat16 ones only (SDPA in bfloat16 rounds a row by the rows beside it)."""
    from eyas.models import latent_kernel

    library = latent_kernel._library()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert library is not None
    assert library.fits_registers == (" avx512f" in flags or (" avx2" in flags and " fma" in flags))
    f32, bf16 = torch.zeros(8, 576), torch.zeros(8, 576, dtype=torch.bfloat16)
    for fits in (False, True):
        monkeypatch.setattr(library, "fits_registers", fits)
        assert latent_kernel.reads(f32) == fits and latent_kernel.reads(bf16)


def test_the_latent_kernel_runs_on_amx_tiles_where_the_cpu_has_them():
    """Where the CPU has AMX (and Linux grants its use), attention over bfloat16 latents runs on tiles: its softmax
    weights are rounded to bfloat16, which moves the output off float32 arithmetic over the same values; elsewhere
    it is that arithmetic."""
    from eyas.models.latent_kernel import latent_attention, on_tiles

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])  # Linux lends tiles from 5.16
    assert on_tiles() == (" amx_bf16" in flags and " amx_tile" in flags and release >= (5, 16))
    torch.manual_seed(3)
    kv, q, bias = torch.randn(1, 100, 64).bfloat16(), torch.randn(1, 4, 64), torch.zeros(1, 1, 100)
    # with bfloat16 dot products (AVX512-BF16) the kernel scores bfloat16 latents against queries rounded to bfloat16
    same_q = q.bfloat16().float() if " avx512_bf16" in flags else q
    moved = latent_attention(q, kv, bias, 0.2, 64) - latent_attention(same_q, kv.float(), bias, 0.2, 64)
    assert (moved.abs().max() > 0) == on_tiles()


def test_a_prompt_chunk_in_the_latent_kernel_splits_its_rows_among_threads_with_the_same_numbers():
    """One sequence's 50-position chunk (causal over 60 positions) on 1, 2 and 3 threads: split by whole positions,
    written into a given output, equal bit for bit."""
    from eyas.models.latent_kernel import _parts, latent_attention

    torch.manual_seed(1)
    heads, positions, context, width = 4, 50, 60, 48
    q = torch.randn(1, positions * heads, width).bfloat16()
    kv = torch.randn(1, context, width).bfloat16()
    bias = torch.zeros(1, positions, context)
    for j in range(positions):
        bias[0, j, context - positions + j + 1:] = float("-inf")
    # the later positions see more: fewer of them a part
    assert _parts(1, positions * heads, heads, context, 3) == [(0, 1, 0, 100), (0, 1, 100, 56), (0, 1, 156, 44)]
    outs = []
    for threads in (1, 2, 3):
        into = torch.empty(1, positions * heads, 40, dtype=torch.bfloat16)
        assert latent_attention(q, kv, bias, 0.3, 40, threads, into) is into
        outs.append(into)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="is not a contiguous"):
        latent_attention(q, kv, bias, 0.3, 40, 1, torch.empty(1, positions * heads, 40))


@pytest.mark.parametrize("rows", [1, 4])
def test_a_sequence_alone_calls_the_latent_kernel_straight_with_the_same_numbers(rows, kernel_on_float32):
    """Batch-1 decode and verify rows (and each draft step) over one run of the cache: every layer calls the kernel
    with what the first worked out, and gets bit for bit what the general path computes; a context gathered from
    scattered blocks takes the general path."""
    from eyas.models.attention import paged_latent_attention

    torch.manual_seed(0)
    in_run = AttentionMetadata.build([rows], [37], [[2, 3, 4]], 16)
    scattered = AttentionMetadata.build([rows], [37], [[4, 0, 2]], 16)
    assert in_run.slot_mapping.tolist() == list(range(2 * 16 + 37 - rows, 2 * 16 + 37))  # blocks 2, 3, 4
    assert scattered.slot_mapping.tolist() == [2 * 16 + p - 32 for p in range(37 - rows, 37)]  # block 2 holds 32..
    for _ in range(3):  # layers share the step's metadata, each with its own cache
        latent = torch.randn(6 * 16, 576)
        q = torch.randn(rows, 4, 576)
        direct = paged_latent_attention(q, latent, in_run, 512, 0.1)
        general = paged_latent_attention(q, latent, in_run, 512, 0.1, groups=in_run.groups)
        assert torch.equal(direct, general)
        assert isinstance(in_run.groups[0].alone_bias, torch.Tensor)
        gathered = paged_latent_attention(q, latent, scattered, 512, 0.1)
        torch.testing.assert_close(gathered, paged_latent_attention(
            q, latent.view(6, 16, 576)[[4, 0, 2]].reshape(48, 576), AttentionMetadata.build([rows], [37], [[0, 1, 2]],
                                                                                             16), 512, 0.1))
        assert scattered.groups[0].alone_bias is False


def test_the_latent_kernel_refuses_what_it_cannot_compute():
    from eyas.models.latent_kernel import latent_attention

    kv, q = torch.randn(1, 8, 32), torch.randn(1, 4, 32)
    hidden = torch.full((1, 1, 8), float("-inf"))
    with pytest.raises(RuntimeError, match="sees no position"):
        latent_attention(q, kv, hidden, 0.1, 32)
    with pytest.raises(ValueError, match="do not fit together"):
        latent_attention(q, kv[:, :4], torch.zeros(1, 1, 8), 0.1, 32)


def test_attention_runs_sdpa_where_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    """No C compiler: a warning that says so and what to set, then the same attention through SDPA."""
    from eyas.models import c_kernels, latent_kernel

    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(c_kernels, "COMPILER", str(tmp_path / "no-such-cc"))
    latent_kernel._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="runs torch's SDPA.*set CC"):
            assert not latent_kernel.takes(torch.randn(1, 4, 32), torch.randn(1, 8, 32), 32)
    finally:
        latent_kernel._library.cache_clear()
    assert not list(tmp_path.rglob("*.so"))


def test_a_damaged_kernel_library_falls_back_with_a_warning(tmp_path, monkeypatch):
    """The cached library does not load (damaged, or built elsewhere): a warning naming it, and SDPA."""
    from eyas.models import latent_kernel

    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path))
    path = latent_kernel.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    latent_kernel._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="does not load.*remove it"):
            assert latent_kernel._library() is None
    finally:
        latent_kernel._library.cache_clear()


def test_padded_short_rows_beside_a_prompt_chunk_read_no_unset_memory(model, monkeypatch):
    """A prompt chunk first in the flat batch, then short rows of unequal lengths, padded together: the padding's
    queries must not come from memory the step never set (a NaN there made the latent kernel refuse the step, 'a
    query row sees no position', now and then under a server's load). Fresh buffers hold NaN here to make it sure."""
    from eyas.models.attention import SHORT_QUERY

    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(float("nan")))
    torch.manual_seed(2)
    worst, groups = run_steps(model, ([SHORT_QUERY + 9, 1, 3], [1, 1, 1]))
    assert groups[0] == [3, SHORT_QUERY + 9]  # the short rows padded to 3 in one group, the chunk alone
    assert worst < 1e-4, worst


def test_a_gradient_through_attention_over_a_bfloat16_cache_runs_sdpa_with_the_caches_dtype():
    """Where the kernel reads the cache but does not take the call (a gradient wanted), float32 queries meet the
    bfloat16 latents in SDPA in the cache's dtype: what the kernel computes, to bfloat16's precision."""
    from eyas.models.attention import paged_latent_attention

    torch.manual_seed(2)
    attn = AttentionMetadata.build([1, 1], [20, 30], [[0, 1], [2, 3]], 16)
    cache = torch.randn(64, 40).bfloat16()
    q = torch.randn(2, 4, 40).bfloat16().float().requires_grad_()
    out = paged_latent_attention(q, cache, attn, 32, 0.1)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    with torch.no_grad():
        kernel = paged_latent_attention(q, cache, attn, 32, 0.1)
    assert kernel.dtype == torch.float32
    torch.testing.assert_close(out.float(), kernel, rtol=2e-2, atol=2e-2)
