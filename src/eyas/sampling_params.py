"""Per-request settings: `SamplingParams` (shaped like vLLM's) and `StructuredOutputParams`, each checked on
construction with messages that name the field. A structured-output spec is checked by building the xgrammar
Grammar it describes (`to_grammar`); `eyas.engine.grammar` compiles that grammar per tokenizer."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1_000
MAX_REGEX_CHARS = 10_000
MAX_SCHEMA_PROPERTIES = 1_000
MAX_SCHEMA_DEPTH = 32


# keywords xgrammar (0.2.x) accepts but does not enforce, measured: a grammar with {"not": {"const": "a"}} still
# accepts "a"; if/then/else, contains, dependentRequired, dependentSchemas, unevaluated*, uniqueItems leave the
# compiled grammar unchanged. Output would then break the schema it was promised to follow: refused instead
UNENFORCED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "contains", "dependentRequired", "dependentSchemas",
                              "unevaluatedProperties", "unevaluatedItems", "uniqueItems")
# keywords whose value maps names to subschemas: the names are not keywords
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def _schema_size(schema: dict) -> tuple[int, int, list[str]]:
    """(properties declared anywhere in a JSON schema, how deep its objects and lists nest, the unenforced keywords
    it uses), without recursion: the schema comes from a client."""
    properties, deepest, unenforced = 0, 0, set()
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]  # (node, depth, node maps names to subschemas)
    while stack:
        node, depth, named = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                continue
            if named:
                stack += [(child, depth + 1, False) for child in node.values()]
                continue
            unenforced |= {k for k in node if k in UNENFORCED_SCHEMA_KEYWORDS}
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            stack += [(child, depth + 1, key in _NAMED_SUBSCHEMAS) for key, child in node.items()]
        elif isinstance(node, list) and depth <= MAX_SCHEMA_DEPTH:
            stack += [(child, depth + 1, False) for child in node]
    return properties, deepest, sorted(unenforced)


@dataclass(slots=True)
class StructuredOutputParams:
    """Constrained decoding: exactly one of a JSON schema, any JSON object, or a regular expression. Checked here
    (an invalid schema or regex is a ValueError naming it); compiled per tokenizer by `eyas.engine.grammar`."""

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None

    def __post_init__(self) -> None:
        given = [name for name, on in (("json_schema", self.json_schema is not None),
                                       ("json_object", self.json_object), ("regex", self.regex is not None)) if on]
        if len(given) != 1:
            raise ValueError(f"structured_output sets {given or 'nothing'}; expected exactly one of json_schema, "
                             "json_object, regex")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"structured_output json_schema is a {type(self.json_schema).__name__}; expected a "
                             "JSON schema object (dict)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_output regex is {self.regex!r}; expected a non-empty string")
        # bounded before anything compiles them: a 10,000-property schema took 34 s, a 20,000-word alternation 22 s
        if self.regex is not None and len(self.regex) > MAX_REGEX_CHARS:
            raise ValueError(f"structured_output regex is {len(self.regex)} characters; at most {MAX_REGEX_CHARS}")
        if self.json_schema is not None:
            properties, depth, unenforced = _schema_size(self.json_schema)
            if properties > MAX_SCHEMA_PROPERTIES or depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_output json_schema has {properties} properties nested {depth} deep; "
                                 f"at most {MAX_SCHEMA_PROPERTIES} properties and {MAX_SCHEMA_DEPTH} levels")
            if unenforced:
                raise ValueError(f"structured_output json_schema uses {', '.join(unenforced)}, which the grammar "
                                 "engine would not enforce (the output could break the schema); remove them")
        to_grammar(self)  # raises ValueError naming the problem

    @property
    def key(self) -> tuple:
        """Hashable identity, for caching compiled grammars."""
        schema = json.dumps(self.json_schema, sort_keys=True) if self.json_schema is not None else None
        return (schema, self.json_object, self.regex)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:50:59] /project/cpp/x.cc:5082: " on its messages


def load_xgrammar():
    """The xgrammar module, an optional dependency; a ValueError saying how to install it when it is missing."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured output (response_format, guided_regex) needs the optional xgrammar package: "
                         "pip install 'eyas[structured]'") from e
    return xgrammar


def to_grammar(spec: StructuredOutputParams):
    """The xgrammar Grammar of a spec (no tokenizer needed); an invalid schema or regex is a ValueError naming it.
    JSON is generated compact (no free whitespace), which keeps small models from padding forever."""
    xgr = load_xgrammar()
    try:
        if spec.json_schema is not None:
            return xgr.Grammar.from_json_schema(json.dumps(spec.json_schema), any_whitespace=False)
        if spec.json_object:  # any object: additional properties allowed
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        return xgr.Grammar.from_regex(spec.regex)
    except RuntimeError as e:
        what = "json_schema" if spec.json_schema is not None else "regex"
        reason = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else str(e))
        raise ValueError(f"structured_output {what} is invalid: {reason}") from e


MAX_LOGPROBS = 20  # OpenAI's limit on top log-probabilities per position
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling, shaped like vLLM's. temperature 0 (anything below 1e-5) means greedy.
    `structured_output` constrains the output to a JSON schema, any JSON object, or a regex (a dict is read as
    StructuredOutputParams fields)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    structured_output: StructuredOutputParams | None = None
    # None: no log-probabilities; n >= 0: each generated token's and the n most likely tokens' (target's raw
    # distribution, before temperature and top-k/p: what vLLM reports)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutputParams(**self.structured_output)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature is {self.temperature}; expected a finite number >= 0")
        if self.top_k < -1:
            raise ValueError(f"top_k is {self.top_k}; expected -1 or 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; expected 0 < top_p <= 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p is {self.min_p}; expected 0 <= min_p <= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens is {self.max_tokens}; expected a positive integer")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # every step checks each one against the output: 100,000 of them would stall the engine for everyone
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop has {len(self.stop)} strings of up to {max(map(len, self.stop))} characters; at "
                             f"most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS * 16:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_STRINGS * 16}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs is {self.logprobs}; expected 0..{MAX_LOGPROBS} (the most likely tokens to "
                             "return per position)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids is {self.stop_token_ids}; expected non-negative token ids")

    @property
    def greedy(self) -> bool:
        # below GREEDY_TEMPERATURE (vLLM's sampling epsilon) dividing the logits by the temperature overflows to
        # inf and NaN (1e-40 sampled token 0 every step): such a temperature means greedy
        return self.temperature < GREEDY_TEMPERATURE
