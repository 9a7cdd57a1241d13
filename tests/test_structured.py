"""Structured output: every constrained output parses and validates, speculation still helps under a grammar, and
greedy constrained speculative output equals greedy constrained plain output token for token."""

import json
import re

import jsonschema
import pytest
from tiny import REGEX, SCHEMAS, STRUCTURED_PROMPTS, make_served_checkpoint, spec
from transformers import AutoTokenizer

from eyas import LLM, SamplingParams
from eyas.engine.grammar import GrammarCache
from eyas.paths import DEFAULT_MODEL
from eyas.sampling_params import StructuredOutputParams

shipped = pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").is_file(), reason="no shipped model")


# -- the spec and the matcher ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,word", [
    ({"json_schema": {"type": "objectx"}}, "objectx"),
    ({"json_schema": {"type": "object", "properties": 5}}, "properties"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    ({"json_schema": [1]}, "dict"),
    ({"regex": "[a-"}, "regex"),
    ({}, "exactly one"),
    ({"regex": "a", "json_object": True}, "exactly one"),
])
def test_invalid_spec_is_a_value_error_naming_it(fields, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(structured_output=fields)


@pytest.fixture(scope="module")
def grammars():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return tok, GrammarCache(tok, 8192, {1})


def test_verify_masks_stop_at_the_first_rejected_draft_and_restore_the_state(grammars):
    tok, cache = grammars
    g = cache.matcher(StructuredOutputParams(regex="[0-9]{3}"))
    one, two, x = (tok.encode(c, add_special_tokens=False)[0] for c in "12x")
    before = g.allowed_mask()
    assert before[one] and before[two] and not before[x] and not before[1]  # EOS only where the grammar ends
    bitmask = cache.new_bitmask(4)
    # drafts [1, 2, x]: row 0 = mask(), row 1 = mask after "1", row 2 = mask after "12"; x is rejected -> 2 usable
    assert g.verify_masks([one, two, x], bitmask, 0) == 2
    assert (bitmask[3] == -1).all()  # the row after the rejected draft is left unmasked (never read)
    assert (g.allowed_mask() == before).all()  # rolled back to the committed state
    assert g.advance([one, two, two]) == 3
    assert g.allowed_mask().nonzero().flatten().tolist() == [1]  # complete: EOS only
    assert g.advance([1]) == 1 and g.is_terminated
    assert g.allowed_mask().nonzero().flatten().tolist() == [1]  # past the end: still EOS only, no crash
    g.rollback(2)
    assert not g.is_terminated and g.allowed_mask()[two]


def test_json_strings_never_take_raw_control_bytes(grammars):
    tok, cache = grammars
    g = cache.matcher(StructuredOutputParams(json_schema={"type": "string", "maxLength": 8}))
    quote, control = tok.encode('"', add_special_tokens=False)[0], tok.convert_tokens_to_ids("ĝ")  # byte 0x1d
    assert g.advance([quote]) == 1
    allowed = g.allowed_mask()
    assert allowed[tok.encode("a", add_special_tokens=False)[0]] and not allowed[control]
    assert g.matcher.accept_token(control)  # xgrammar alone would take it (invalid JSON): the mask is ours


# -- end to end --------------------------------------------------------------------------------------------------

def check(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


@shipped
def test_fifty_json_schema_requests_parse_validate_and_still_speculate():
    llm = LLM(max_num_seqs=16, speculative_method="mtp", num_speculative_tokens=3)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(50)]
    prompts = [STRUCTURED_PROMPTS[i % len(STRUCTURED_PROMPTS)] for i in range(50)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=128, structured_output=spec(n))
              for i, n in enumerate(names)]
    outs = llm.generate(prompts, params)
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", out.text
        check(name, out.text)
    # the first 10 requests again without the grammar (unconstrained text runs to max_tokens: keep it short)
    free = llm.generate(prompts[:10], [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=64)
                                       for p in params[:10]])
    print(f"\n50/50 parse and validate; acceptance length (K=3) constrained {al(outs):.3f} over 50, "
          f"{al(outs[:10]):.3f} over the first 10; the first 10 unconstrained {al(free):.3f}")
    assert al(outs) > 1.0
    assert llm.allocator.num_used == 0


def al(outs) -> float:
    return 1 + sum(o.num_accepted for o in outs) / sum(o.num_verify_steps for o in outs)


@shipped
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_constrained_speculative_equals_plain_shipped(k):
    plain = LLM(max_num_seqs=8)
    specd = LLM(max_num_seqs=8, speculative_method="mtp", num_speculative_tokens=k)
    specs = [spec(n) for n in SCHEMAS] + [StructuredOutputParams(regex=REGEX), StructuredOutputParams(json_object=True)]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_output=s) for s in specs]
    prompts = STRUCTURED_PROMPTS[:len(params)]
    for a, b in zip(plain.generate(prompts, params), specd.generate(prompts, params)):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert specd.scheduler.metrics.acceptance_length > 1.0


@shipped
def test_regex_output_matches():
    llm = LLM(max_num_seqs=8, speculative_method="mtp", num_speculative_tokens=3)
    outs = llm.generate(STRUCTURED_PROMPTS, SamplingParams(temperature=0.7, seed=3, max_tokens=32,
                                                           structured_output=StructuredOutputParams(regex=REGEX)))
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    """A random target (mostly rejected drafts) with the shipped tokenizer and an MTP layer."""
    return make_served_checkpoint(tmp_path_factory.mktemp("structured_ckpt"))


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_constrained_speculative_equals_plain_random_target(random_target, k):
    params = [SamplingParams(temperature=0, max_tokens=48, structured_output=spec(n)) for n in SCHEMAS]
    params.append(SamplingParams(temperature=0, max_tokens=48, structured_output=StructuredOutputParams(regex=REGEX)))
    prompts = STRUCTURED_PROMPTS[:len(params)]
    plain = LLM(random_target, max_num_seqs=4, block_size=4, max_num_batched_tokens=11).generate(prompts, params)
    llm = LLM(random_target, max_num_seqs=4, block_size=4, max_num_batched_tokens=11, speculative_method="mtp",
              num_speculative_tokens=k)
    for a, b, p in zip(plain, llm.generate(prompts, params), params):
        assert b.token_ids == a.token_ids
        if p.structured_output.json_schema is not None and a.finish_reason == "stop":
            jsonschema.validate(json.loads(a.text), p.structured_output.json_schema)
    assert llm.allocator.num_used == 0


def test_ungrammatical_drafts_are_cut_and_output_unchanged(random_target):
    """Drafts the grammar rejects (here: overwritten with BOS every other step) shrink the usable drafts; the
    committed output and the KV bookkeeping are as if they had been rejected. ignore_eos does not outlive the
    grammar: the request stops where the structured output is complete."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, structured_output=spec("person"))
    kw = dict(max_num_seqs=4, block_size=4, max_num_batched_tokens=11)
    plain = LLM(random_target, **kw).generate([STRUCTURED_PROMPTS[0]], params)[0]
    llm = LLM(random_target, speculative_method="mtp", num_speculative_tokens=3, **kw)
    seq = llm.add_request(STRUCTURED_PROMPTS[0], params)
    assert not seq.grammar.allowed_mask()[0]
    step = 0
    while llm.scheduler.has_work():
        llm.step()
        step += 1
        if seq.draft_tokens and step % 2:
            seq.draft_tokens = [0] * len(seq.draft_tokens)
    out = llm.output(seq)
    assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason == "stop"
    check("person", out.text)
    assert llm.allocator.num_used == 0


def test_without_xgrammar_a_structured_request_names_the_extra(monkeypatch):
    """xgrammar is optional (`eyas[structured]`): without it, plain requests run and a structured one fails with an
    error naming the extra."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # makes `import xgrammar` raise ImportError
    from eyas.sampling_params import to_grammar

    with pytest.raises(ValueError, match=r"pip install 'eyas\[structured\]'"):
        to_grammar(spec("person"))


def test_compiled_grammars_are_an_lru_of_bounded_size():
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    cache = GrammarCache(tok, 8192, {1}, max_entries=2)
    specs = [StructuredOutputParams(regex=f"[0-9]{{{n}}}") for n in (1, 2, 3)]
    cache.matcher(specs[0])
    cache.matcher(specs[1])
    cache.matcher(specs[0])  # used again: now the most recent
    cache.matcher(specs[2])  # evicts specs[1], the least recently used
    assert list(cache.compiled) == [specs[0].key, specs[2].key]
    matcher = cache.matcher(specs[1])  # compiled again when asked for again
    assert len(cache.compiled) == 2 and matcher is not None


def test_two_hundred_distinct_large_schemas_leave_memory_bounded():
    """Each compiled 100-property schema holds about 0.5 MB of token masks. Past the first 32 (the cache full and
    the allocator warm), 168 more distinct ones grow RSS by under 16 MB; xgrammar's own cache, unbounded by
    default and about 1 MB a schema, is off."""
    def rss_mb() -> float:
        line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    cache = GrammarCache(tok, 8192, {1}, max_entries=16)
    for i in range(200):
        if i == 32:
            warm = rss_mb()
        schema = {"type": "object", "required": [f"k{i}_0"],
                  "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 20} for j in range(100)}}
        cache.compile(StructuredOutputParams(json_schema=schema))
    grown = rss_mb() - warm
    print(f"RSS grew {grown:.1f} MB over schemas 32..199")
    assert len(cache.compiled) == 16 and cache.compiler.get_cache_size_bytes() == 0
    assert grown < 16, grown


def test_schema_keywords_the_grammar_would_not_enforce_are_refused():
    """xgrammar accepts `not`, `if`/`then`, `contains`, `uniqueItems`, ... and ignores them: refused, naming them;
    a property that happens to be called "not" is no keyword."""
    for schema, word in [({"not": {"type": "string"}}, "not"),
                         ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                         ({"type": "object", "properties": {"a": {"if": {"const": 1}, "then": {"const": 2}}}},
                          "if, then")]:
        with pytest.raises(ValueError, match=f"uses {word}, which the grammar engine would not enforce"):
            StructuredOutputParams(json_schema=schema)
    StructuredOutputParams(json_schema={"type": "object", "properties": {"not": {"type": "string"},
                                                                          "if": {"type": "integer"}}})
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1001)}}
    with pytest.raises(ValueError, match="1001 properties"):
        StructuredOutputParams(json_schema=big)
    with pytest.raises(ValueError, match="regex is 10001 characters"):
        StructuredOutputParams(regex="a" * 10_001)
