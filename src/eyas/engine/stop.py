"""When a sequence stops: end-of-sequence and stop tokens, stop strings, max_tokens and the context length."""

from __future__ import annotations

from eyas.engine.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: set[int], tokenizer, max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` stops now that `token` is its last, or None. A stop string sets seq.text to the text before it."""
        p = seq.params
        # under a grammar, EOS is allowed only where the structured output is complete: it ends even with ignore_eos
        if (token in self.eos_token_ids and (not p.ignore_eos or seq.grammar is not None)) \
                or token in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            # checked after every token, so a stop string that has just appeared ends within the last few tokens:
            # decode those (a string of n characters spans at most n tokens that print; the margin covers tokens
            # that print nothing or half a character), and the whole text only on a hit, to cut it there.
            # Decoding the whole output each token was quadratic in its length
            window = 2 * max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(seq.generated_ids[-window:], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                text = self.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
                hits = [text.find(s) for s in p.stop if s in text]
                if hits:
                    seq.text = text[:min(hits)]
                    return "stop"
        if seq.num_generated >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None
