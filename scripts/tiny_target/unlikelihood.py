"""Sequence-level unlikelihood training (Welleck et al., 2019, "Neural Text Generation with Unlikelihood
Training"): the model's own greedy continuations of training prompts, and at every token of theirs inside a repeated
4-gram the loss -log(1 - p(token)), which pushes greedy decoding out of the loops a tiny model falls into.

Only continuations more repetitive than real code are penalised: the held-out functions' real bodies have 10-16% of
their tokens inside a repeated 4-gram on average (the measure `eyas eval` uses, eyas.eval.acceptance), so a
continuation is penalised above `min_share` (default 0.4), and then at each of its repeated tokens.

The loss only pushes probability away from what the model says, so too much of it flattens the model's own
continuations into noise: at weight 1 and learning rate 3e-4 from the stage-2 model, the held-out loops fell from
45% to 16% in 60 steps, then by step 90 greedy tokens had a mean probability near 0.01 and read as noise. The
training log therefore watches held-out answers (repetitive, parsing, stopping) beside the loss.

Prompts come from the training data only, in the three forms of examples/prompts/eval.jsonl: a function request
(the chat conversations' user turn), the same request followed by a request for a usage example, and six lines of a
training file from a `def` or `class` line as raw text to continue.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from evaluate import parses

from eyas import LLM, SamplingParams
from eyas.checkpoint import save_model
from eyas.eval.acceptance import is_repetitive, repeated_positions, repeated_share

MAX_REQUEST_CHARS = 3000
FOLLOW_UPS = ("Show a short example that calls it.", "Give an example of calling it.",
              "How is it used? Show an example.", "Write a short usage example.")


@dataclass
class Continuation:
    tokens: list[int]  # prompt then continuation
    num_prompt: int
    penalised: list[bool]  # per continuation token


class PromptSource:
    """Training prompts in the three eval forms, a pure function of (seed, round)."""

    def __init__(self, work: Path, arrays: dict, tokenizer, continuation_share: float = 0.35) -> None:
        self.continuation_share = continuation_share
        self.requests = []
        for name in ("conversations_train.jsonl", "conversations_packages_train.jsonl"):
            requests = (json.loads(line)["messages"][0]["content"] for line in (work / name).read_text().splitlines())
            # short enough for two turns in the context (the longest docstrings run to thousands of tokens)
            self.requests.append([r for r in requests if len(r) <= MAX_REQUEST_CHARS])
        self.texts = (arrays["train"], arrays["packages_train"])
        self.tokenizer = tokenizer

    def continuation_prompt(self, rng: random.Random) -> str:
        data = self.texts[rng.random() < 0.5]
        while True:
            start = rng.randrange(0, len(data) - 1024)
            text = self.tokenizer.decode(np.asarray(data[start:start + 1024], dtype=np.int64).tolist(),
                                         skip_special_tokens=False)
            text = text.split("<｜end▁of▁sentence｜>")[0]
            lines = text.splitlines(keepends=True)[1:]  # the first line is cut
            starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
            if starts and len(lines) >= starts[0] + 6:
                return "".join(lines[starts[0]:starts[0] + 6])

    def prompts(self, seed: int, round_: int, n: int) -> tuple[list, list[int]]:
        """n prompts: chat message lists or raw text; and the indices of the requests that get a second turn."""
        rng = random.Random(f"{seed}:{round_}")
        prompts, two_turn = [], []
        for i in range(n):
            form = rng.random()
            if form < self.continuation_share:
                prompts.append(self.continuation_prompt(rng))
                continue
            source = self.requests[rng.random() < 0.5]
            prompts.append([{"role": "user", "content": source[rng.randrange(len(source))]}])
            if form > 0.8:  # a fifth of all prompts, while continuations take less than 0.8
                two_turn.append(i)
        return prompts, two_turn


def generate(model: torch.nn.Module, tokenizer_dir: Path, prompts: list, two_turn: list[int], max_tokens: int,
             threads: int, seed: int) -> list:
    """Greedy outputs of `model` (the current training weights, exported in float32) for every prompt, and for the
    requests in `two_turn` a second turn asking for a usage example; a list of RequestOutput."""
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp, dtype=torch.float32)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, Path(tmp) / name)
        llm = LLM(tmp, max_num_seqs=16, threads=threads)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outs = llm.generate(prompts, params)
        rng = random.Random(seed)
        second = [prompts[i] + [{"role": "assistant", "content": outs[i].text},
                                {"role": "user", "content": rng.choice(FOLLOW_UPS)}] for i in two_turn]
        return outs + (llm.generate(second, params) if second else [])


def penalised_continuations(outputs: list, min_share: float) -> list[Continuation]:
    return [Continuation(out.prompt_token_ids + out.token_ids, len(out.prompt_token_ids),
                         repeated_positions(out.token_ids))
            for out in outputs if repeated_share(out.token_ids) > min_share]


def unlikelihood_loss(model: torch.nn.Module, items: list[Continuation]) -> torch.Tensor:
    """Mean over the continuations' tokens of -log(1 - p(token)) at the penalised ones (0 elsewhere)."""
    length = max(len(c.tokens) for c in items)
    tokens = torch.zeros(len(items), length, dtype=torch.long)
    weight = torch.zeros(len(items), length)
    counted = 0
    for b, c in enumerate(items):
        tokens[b, :len(c.tokens)] = torch.tensor(c.tokens)
        weight[b, c.num_prompt:len(c.tokens)] = torch.tensor(c.penalised, dtype=torch.float32)
        counted += len(c.tokens) - c.num_prompt
    logits = model(tokens[:, :-1])
    log_p = torch.gather(F.log_softmax(logits.float(), dim=-1), -1, tokens[:, 1:, None])[..., 0]
    one_minus_p = torch.clamp(1.0 - log_p.exp(), min=1e-5)
    return -(torch.log(one_minus_p) * weight[:, 1:]).sum() / counted


def repetitive_share(outputs: list) -> float:
    return sum(is_repetitive(o.token_ids) for o in outputs) / max(1, len(outputs))


def answer_quality(requests: list, outputs: list) -> dict:
    """Shares of greedy answers to function requests that are repetitive, parse as Python, and stop on their own:
    a model that unlearns loops by turning its answers into noise shows here, not in the loss."""
    codes = [r[0]["content"].split("\n\n", 1)[1] for r in requests]  # the request without its instruction
    n = max(1, len(outputs))
    return {"heldout_repetitive": round(repetitive_share(outputs), 4),
            "heldout_parse": round(sum(parses(c, o.text, o.finish_reason == "stop")
                                       for c, o in zip(codes, outputs)) / n, 4),
            "heldout_stopped": round(sum(o.finish_reason == "stop" for o in outputs) / n, 4)}
