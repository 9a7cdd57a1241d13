"""The compiled step (eyas.engine.compiled_step) computes what the eager step computes: greedy output token for token,
plain and speculative (EAGLE-3 drafts and the MTP layer compiled too), each kernel checked against its eager layer,
each layer's kernel its own weights frozen in, kernels kept on disk and loaded back."""

import argparse
import zipfile

import pytest
import torch
from tiny import (
    YARN,
    add_mtp_weights,
    make_hf_checkpoint,
    mha_config,
    mha_weights,
    mla_config,
    mla_weights,
    write_draft,
)

from eyas import LLM, SamplingParams
from eyas.engine import compiled_step
from eyas.engine.compiled_step import CompiledTarget, compile_kernel
from eyas.engine_args import EngineArgs

PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 9, [40, 41], [17]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    make_hf_checkpoint(target, rope_parameters=YARN)
    add_mtp_weights(target)
    drafts = tmp_path_factory.mktemp("drafts")
    return target, {"mla": write_draft(drafts / "mla", mla_config(), mla_weights()),
                    "mha": write_draft(drafts / "mha", mha_config(), mha_weights())}


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    """One disk cache for this module's tests: the kernels are compiled once (about 30 s) and loaded after."""
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "eyas-cache"))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The name of every compiled kernel called, in order."""
    calls = []
    call = compiled_step.Kernel.__call__
    monkeypatch.setattr(compiled_step.Kernel, "__call__", lambda self, *a: calls.append(self.name) or call(self, *a))
    return calls


def run(path, compiled, **spec):
    llm = LLM(path, max_num_seqs=4, block_size=4, max_num_batched_tokens=11, compiled_step=compiled, **spec)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))
    assert llm.allocator.num_used == 0
    return [o.token_ids for o in outs], outs


def test_compiled_greedy_equals_eager_greedy(models, kernel_calls):
    target, drafts = models
    eager, _ = run(target, compiled=False)
    plain, _ = run(target, compiled=True)
    assert plain == eager
    assert kernel_calls.count("first-layer0") > 20  # the compiled kernels ran the decode steps
    for spec in (dict(speculative_method="eagle", draft_model=drafts["mla"], num_speculative_tokens=3),
                 dict(speculative_method="eagle", draft_model=drafts["mha"], num_speculative_tokens=2),
                 dict(speculative_method="mtp", num_speculative_tokens=2)):
        kernel_calls.clear()
        tokens, outs = run(target, compiled=True, **spec)
        assert tokens == eager, spec
        assert sum(o.num_drafted for o in outs) > 0
        assert kernel_calls.count("first-layer0") > 5
        drafted = {name for name in kernel_calls if name.startswith(("draft-", "mtp-"))}
        arch = spec["draft_model"].name if "draft_model" in spec else None
        # the MTP layer's MoE has a one-row form (the last sequence drafts alone)
        assert drafted == ({f"draft-{arch}-{part}" for part in ("fuse", "inputs", "outputs")} if arch else
                           {"mtp-inputs", "mtp-outputs", "mtp-outputs-1row"}), spec


def test_a_float32_step_of_few_rows_runs_the_kernels_with_its_prompt_chunk(models, kernel_calls):
    """A prompt longer than a decode query but within FEW_ROWS runs the kernels (an eager step costs ~10 ms however
    few its rows); a longer one runs eager; greedy output is eager's either way."""
    target, _ = models
    short = [(5 * i) % 90 + 2 for i in range(compiled_step.FEW_ROWS - 2)]
    long = [(7 * i) % 90 + 2 for i in range(compiled_step.FEW_ROWS + 9)]
    eager = LLM(target, compiled_step=False)
    llm = LLM(target, compiled_step=True)
    assert llm.runner.compiled is not None and not llm.runner.compiled.every_step  # float32
    for prompt, kernels in ((short, 1), (long, 0)):
        kernel_calls.clear()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the prompt's step alone
        assert kernel_calls.count("first-layer0") == kernels, len(prompt)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert llm.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids


def test_each_kernel_computes_its_own_layer(models):
    """Float32 kernels hold their layer's weights frozen in, as bfloat16 ones do: layers 1 and 2 (both MoE, then
    attention inputs) run kernels of their own, and layer 1's computes layer 1, not layer 2."""
    llm = LLM(models[0], compiled_step=True)
    compiled = llm.runner.compiled
    layers = llm.model.model.layers
    assert not compiled.every_step  # float32 prompt chunks run eager
    kernel_1, kernel_2 = compiled.steps[1], compiled.steps[2]
    assert kernel_1 is not kernel_2
    rows = 3
    h = torch.randn(rows, llm.model.config.hidden_size)
    out = torch.randn(rows, llm.model.config.num_attention_heads, llm.model.config.kv_lora_rank)
    cos, sin = llm.model.model.rotary(torch.arange(rows))
    step_2 = compiled_step._step_fn(layers[2], layers[3])
    compiled_step._check_against_eager("layer 2", kernel_2, step_2, (h, out, cos, sin))
    with pytest.raises(RuntimeError, match="for layer 2 differs from the eager layer"):
        compiled_step._check_against_eager("layer 2", kernel_1, step_2, (h, out, cos, sin))


def test_kernels_are_loaded_from_disk_the_second_time(models, monkeypatch):
    model = LLM(models[0], compiled_step=True).model  # compiled here or by an earlier test: on disk now
    cached = sorted(compiled_step.cache_dir().glob("*.pt2"))
    # a kernel a layer (its weights frozen in), and each draft's (when the first test ran before)
    assert {p.name.rsplit("-", 1)[0] for p in cached} >= {"first-layer0", "step-mlp-layer0", "step-moe-layer1",
                                                         "step-moe-layer2", "last-moe-layer3"}

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    heard = []
    CompiledTarget(model.model, progress=heard.append)
    assert heard == []  # progress tells of compiling only
    assert sorted(compiled_step.cache_dir().glob("*.pt2")) == cached


def test_loaded_kernels_leave_nothing_unpacked_while_the_engine_runs(models, tmp_path, monkeypatch):
    """AOTInductor unpacks each package under $TMPDIR and removes it only when its loader is destroyed, which a
    server stopped by a signal never reaches: nothing may stay there once the kernels are loaded."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    llm = LLM(models[0], max_num_seqs=4, block_size=4, compiled_step=True, speculative_method="eagle",
              draft_model=models[1]["mla"], num_speculative_tokens=2)
    # while the engine and its loaded kernels live
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("aotinductor_", "eyas-kernel-"))] == []
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))
    assert [o.token_ids for o in outs] == run(models[0], compiled=False)[0]  # the kernels still run


def test_drafts_with_the_same_tensors_and_another_switch_compile_apart(models, tmp_path):
    """norm_output changes a draft's step but none of its tensors: each draft gets its own kernels (one draft's
    were loaded for the other and refused by the check against its eager layer), and greedy output stays plain's."""
    target, drafts = models
    switched = write_draft(tmp_path / "mla-norm-output", dict(mla_config(), norm_output=True), mla_weights())
    plain, _ = run(target, False)
    for draft in (drafts["mla"], switched, drafts["mla"]):
        assert run(target, True, speculative_method="eagle", draft_model=str(draft))[0] == plain



def test_bfloat16_greedy_output_is_one_alone_batched_preempted_and_speculative(models, monkeypatch):
    """bfloat16 weights: each layer's kernel holds its own weights frozen in, every step runs the kernels (prompt
    chunks too, never the eager layers), the C kernel attends over bfloat16 latents in float32 arithmetic, and logits
    are float32; each kernel gives a row the same bits alone as beside other rows, so greedy output is one, token
    for token: one request at a time, batched with chunked prompts, preempted, and speculative (an EAGLE-3 draft and
    the MTP layer)."""
    from eyas.models.deepseek_v3 import DeepseekV3Model

    target, drafts = models
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    alone = LLM(target, max_num_seqs=1, dtype="bfloat16", compiled_step=True)
    monkeypatch.setattr(DeepseekV3Model, "forward", lambda *a: pytest.fail("a step ran the eager layers"))
    expected = [alone.generate([p], params)[0].token_ids for p in PROMPTS]
    assert alone.runner.cache.tensors.dtype == alone.model.lm_head.weight.dtype == torch.bfloat16
    moe_layers = alone.model.model.layers[alone.model.config.first_k_dense_replace:alone.model.config.num_hidden_layers]
    assert moe_layers and all(layer.mlp.all_gate_up is not None for layer in moe_layers)  # MoE.pack_all's linears
    compiled = alone.runner.compiled
    first, steps, last = compiled.first, compiled.steps, compiled.last
    config, model = alone.model.config, alone.model.model
    rows = 7
    cos, sin = (t.to(torch.bfloat16) for t in model.rotary(torch.arange(rows)))
    h = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)
    out = torch.randn(rows, config.num_attention_heads, config.kv_lora_rank, dtype=torch.bfloat16)
    calls = [(first, (h, cos, sin)), *[(step, (h, out, cos, sin)) for step in steps], (last, (h, out))]
    assert len({kernel.name for kernel, _ in calls}) == len(calls)  # a kernel of its own for each call
    for kernel, args in calls:
        together = kernel(*args)
        for r in range(rows):
            one = kernel(*(x[r:r + 1] for x in args))
            assert all(torch.equal(a[r:r + 1], b) for a, b in zip(together, one)), (kernel.name, r)
    assert run(target, True, dtype="bfloat16")[0] == expected
    small = LLM(target, max_num_seqs=3, block_size=4, num_blocks=16, max_num_batched_tokens=16, dtype="bfloat16",
                compiled_step=True)
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == expected and small.scheduler.num_preemptions > 0
    for spec in (dict(speculative_method="eagle", draft_model=drafts["mla"], num_speculative_tokens=3),
                 dict(speculative_method="mtp", num_speculative_tokens=2)):
        tokens, outs = run(target, True, dtype="bfloat16", **spec)
        assert tokens == expected and sum(o.num_drafted for o in outs) > 0, spec

def test_a_bfloat16_draft_runs_its_kernels_over_prompt_positions_too(models, monkeypatch):
    """With frozen kernels a draft (EAGLE-3 MLA- and Llama-shaped, the MTP layer) runs them over a prompt's positions
    too, more than MAX_ROWS of them in pieces, never its eager layer (on the bundled draft 512 prompt positions took
    12 ms against 16.7 eager); greedy output is the target's own."""
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.models.mtp import MTPDraft

    target, drafts = models
    prompt = [(7 * i) % 90 + 2 for i in range(compiled_step.MAX_ROWS + 22)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(max_num_seqs=2, max_num_batched_tokens=256, dtype="bfloat16", compiled_step=True)
    expected = LLM(target, **common).generate([prompt, [5, 6, 7]], params)
    for draft in (Eagle3Draft, MTPDraft):
        monkeypatch.setattr(draft, "forward", lambda *a: pytest.fail("a draft step ran the eager layer"))
    seen = []
    call = compiled_step.Kernel.__call__
    monkeypatch.setattr(compiled_step.Kernel, "__call__",
                        lambda self, *a: seen.append((self.name, a[0].shape[0])) or call(self, *a))
    for spec in (dict(speculative_method="eagle", draft_model=drafts["mla"], num_speculative_tokens=3),
                 dict(speculative_method="eagle", draft_model=drafts["mha"], num_speculative_tokens=3),
                 dict(speculative_method="mtp", num_speculative_tokens=2)):
        llm = LLM(target, **spec, **common)
        seen.clear()
        outs = llm.generate([prompt, [5, 6, 7]], params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected], spec
        assert sum(o.num_drafted for o in outs) > 0
        # the prompt's positions through the draft's input kernel in pieces: MAX_ROWS, then the rest
        inputs = [rows for name, rows in seen if name.startswith(("draft-", "mtp-")) and name.endswith("-inputs")]
        assert compiled_step.MAX_ROWS in inputs, (spec, seen)


def test_a_kernel_over_more_rows_than_it_takes_runs_in_pieces_none_under_its_fewest():
    """MAX_ROWS rows a call; a kernel that takes 2 rows at least (the MTP layer's many-row form) never gets a last
    piece of one."""
    rows = []

    def kernel(x):
        rows.append(x.shape[0])
        return [x * 2]

    x = torch.arange(2 * compiled_step.MAX_ROWS + 1.0)
    for least, expected in ((1, [compiled_step.MAX_ROWS, compiled_step.MAX_ROWS, 1]),
                            (2, [compiled_step.MAX_ROWS, compiled_step.MAX_ROWS - 1, 2])):
        rows.clear()
        assert torch.equal(compiled_step._in_pieces(kernel, x, least_rows=least)[0], x * 2)
        assert rows == expected


def test_kernels_are_called_at_every_row_count_when_loaded(models, monkeypatch):
    """A kernel's GEMMs set themselves up on the first call at each row count: that is paid at load, not by
    a server's first prompts of each length (nor in the adaptive width's timings)."""
    from collections import defaultdict

    target, drafts = models
    seen = defaultdict(set)
    call = compiled_step.Kernel.__call__
    monkeypatch.setattr(compiled_step.Kernel, "__call__",
                        lambda self, *a: seen[self.name].add(a[0].shape[0]) or call(self, *a))
    every = set(range(1, compiled_step.MAX_ROWS + 1))
    for dtype in ("float32", "bfloat16"):
        seen.clear()
        LLM(target, max_num_seqs=1, dtype=dtype, compiled_step=True, speculative_method="eagle",
            draft_model=drafts["mla"], num_speculative_tokens=3)
        assert any(name.startswith("draft-") for name in seen) and len(seen) > 3
        assert all(rows >= every for rows in seen.values()), (dtype, {name: len(r) for name, r in seen.items()})


def test_enforce_eager_and_where_the_step_compiles(monkeypatch):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    monkeypatch.delenv("EYAS_ENFORCE_EAGER", raising=False)
    assert EngineArgs.from_cli_args(parser.parse_args([])).compiled_step
    assert not EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).compiled_step
    assert not EngineArgs.from_cli_args(parser.parse_args(["--device", "cuda"])).compiled_step
    monkeypatch.setenv("EYAS_ENFORCE_EAGER", "1")
    assert not EngineArgs.from_cli_args(parser.parse_args([])).compiled_step
    with pytest.raises(ValueError, match="compiled step runs on CPU only"):
        LLM(device="cuda", compiled_step=True)


def test_the_moe_runs_every_expert_as_two_linears_only_where_a_token_chooses_a_large_share():
    """MoE.pack_all (the frozen kernels' MoE): every expert over every row, the routing weights between the two
    linears, gives what each row's chosen experts give; with 16 experts for 2 a token it keeps the chosen slices."""
    from tiny import BASE

    from eyas.config import DeepseekV3Config
    from eyas.models.deepseek_v3 import MoE

    torch.manual_seed(0)
    for experts, packs in ((8, True), (16, False)):
        moe = MoE(DeepseekV3Config.from_dict({**BASE, "n_routed_experts": experts, "model_type": "deepseek_v3",
                                              "architectures": ["DeepseekV3ForCausalLM"]}))
        for p in moe.parameters():
            p.data.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
        moe.eval().pack()
        x = torch.randn(7, BASE["hidden_size"])
        expert_ids, weights = moe.route(x)
        assert moe.pack_all() is packs and (moe.all_gate_up is not None) is packs
        if packs:
            torch.testing.assert_close(moe._all_linear(x, expert_ids, weights),
                                       moe._few_tokens(x, expert_ids, weights), rtol=1e-5, atol=1e-6)


def test_a_kernel_compiled_at_one_thread_count_is_not_run_at_another():
    """The compiler writes the thread count into the kernel's code (at one thread, no parallel region at all):
    kernels for 1 and 2 threads are kept apart, and each one parallelises as its count says."""
    scale = torch.nn.Linear(1, 4096, bias=False)
    before = torch.get_num_threads()
    packages = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kernel = compile_kernel("t", [scale], lambda h: torch.relu(h * scale.weight[:, 0]),
                                    (torch.zeros(2, 4096),), (1, 64))
            h = torch.randn(3, 4096)
            assert torch.equal(kernel(h)[0], torch.relu(h * scale.weight[:, 0]))
            packages[threads] = set(compiled_step.cache_dir().glob("t-*.pt2")) - set().union(*packages.values())
    finally:
        torch.set_num_threads(before)
    assert all(len(found) == 1 for found in packages.values()), packages
    for threads, (package,) in packages.items():
        with zipfile.ZipFile(package) as archive:
            source = "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith(".cpp"))
        assert ("#pragma omp parallel" in source) == (threads == 2), threads
