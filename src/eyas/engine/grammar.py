"""Structured output: per-sequence grammar state over xgrammar, and the token bitmask it yields.

A constrained sequence carries a `SequenceGrammar` whose matcher has accepted exactly its committed generated
tokens. Before a token is chosen, the matcher fills one bitmask row (bit t of the row: token t is allowed); the
row turns disallowed logits to -inf before any other processing. End of sequence is allowed only where the grammar
accepts an end: the stop tokens are the only ones the matcher lets through there, and once it has accepted one it
is terminated (every later row allows the stop tokens only, so a token past the end is never garbage).

Speculative decoding asks for K+1 rows at once; `verify_masks` walks the matcher through the drafts and back:

    committed state S, drafts [d1, d2, d3]:
      row 0 = mask(S)                  accept d1
      row 1 = mask(S + d1)             accept d2 -> rejected by the grammar: usable drafts = 1, stop
      rollback(1) -> S again           (rows 2, 3 are never read: the acceptance rule sees 1 draft)

After the acceptance rule commits tokens, `advance` moves S forward by exactly those tokens.
Compiled grammars are cached per spec (`GrammarCache`); matchers are cheap and one per sequence.

JSON is generated compact, so no raw byte below 0x20 can belong in it; xgrammar 0.2.9 nonetheless lets them into
strings that carry minLength/maxLength (its bounded-string rule excludes only quote, backslash, CR and LF), so for
JSON specs every token with such a byte is masked out as well.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from eyas.sampling_params import StructuredOutputParams, load_xgrammar, to_grammar


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[vocab] bool -> one bitmask row [ceil(vocab / 32)] int32 (the inverse of the unpacking in apply_bitmask)."""
    words = -(-allowed.shape[0] // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.shape[0]] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)  # [words], 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits of disallowed tokens to -inf. logits [rows, vocab]; bitmask [rows, ceil(vocab / 32)] int32,
    bit b of word w allows token 32 w + b (an all-ones row, -1, allows every token)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]  # [rows, vocab]
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class GrammarCache:
    """One tokenizer's xgrammar compiler; compiled grammars cached by spec, the `max_entries` most recently used
    (a compiled schema holds its token masks: 200 distinct large schemas added 561 MB unbounded)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], max_entries: int = 64) -> None:
        xgr = load_xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        # xgrammar's own cache is unbounded by default (about 1 MB per large schema); ours below is the bound
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compiled: OrderedDict[tuple, object] = OrderedDict()
        self.max_entries = max_entries
        stop = torch.zeros(vocab_size, dtype=torch.bool)
        stop[self.stop_token_ids] = True
        control = torch.tensor([any(c < 0x20 for c in b) for b in info.decoded_vocab[:vocab_size]])
        self.stop_only = _pack(stop)  # the row past the end of the grammar
        self.no_control = _pack(~control | stop)  # the extra mask of JSON specs

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return load_xgrammar().allocate_token_bitmask(num_rows, self.vocab_size)

    def compile(self, spec: StructuredOutputParams):
        """The compiled grammar of `spec`, from the cache or compiled now (any thread may call this: a server
        compiles before the engine thread admits the request)."""
        key = spec.key
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiler.compile_grammar(to_grammar(spec))
            start = self.new_bitmask(1)
            load_xgrammar().GrammarMatcher(compiled).fill_next_token_bitmask(start, 0)
            if not start.any():  # no token may begin the output: every request with it would hang or fail
                what = "regex" if spec.regex is not None else "JSON schema"
                raise ValueError(f"the {what} can match no output (no token can start it)")
            self.compiled[key] = compiled
            while len(self.compiled) > self.max_entries:
                self.compiled.popitem(last=False)  # the least recently used; running matchers keep their own
        else:
            self.compiled.move_to_end(key)
        return compiled

    def matcher(self, spec: StructuredOutputParams) -> SequenceGrammar:
        json_spec = spec.json_schema is not None or spec.json_object
        return SequenceGrammar(load_xgrammar().GrammarMatcher(self.compile(spec)), self, json_spec)


class SequenceGrammar:
    """The grammar state of one sequence: its matcher has accepted the committed generated tokens."""

    def __init__(self, matcher, cache: GrammarCache, no_control_bytes: bool) -> None:
        self.matcher = matcher
        self.cache = cache
        self.no_control_bytes = no_control_bytes

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the structured output is complete."""
        return self.matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed set of the next position into bitmask[row]."""
        if self.matcher.is_terminated():
            bitmask[row] = self.cache.stop_only
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.no_control_bytes:
            bitmask[row] &= self.cache.no_control

    def allowed_mask(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows at the next position."""
        bitmask = self.cache.new_bitmask(1)
        self.fill_mask(bitmask, 0)
        return apply_bitmask(torch.zeros(1, self.cache.vocab_size), bitmask)[0] == 0

    def accept(self, token: int) -> bool:
        """Advance by one token if the grammar allows it (never past a stop token); False leaves the state as is."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    def advance(self, tokens: list[int]) -> int:
        """Advance by the tokens in order, stopping at the first one the grammar rejects; returns how many it took."""
        for n, t in enumerate(tokens):
            if not self.accept(t):
                return n
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)

    def verify_masks(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Fill bitmask rows first_row + j (j = 0..usable) with the mask that holds once drafts[:j] are accepted;
        return `usable`, the drafts before the first one the grammar rejects. The state is left unchanged."""
        self.fill_mask(bitmask, first_row)
        usable = 0
        for d in drafts:
            allowed = (int(bitmask[first_row + usable, d // 32]) >> (d % 32)) & 1  # by the whole row mask
            if not allowed or not self.accept(d):
                break
            usable += 1
            self.fill_mask(bitmask, first_row + usable)
        self.rollback(usable)
        return usable
