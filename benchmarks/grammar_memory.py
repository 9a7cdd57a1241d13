"""Memory of the compiled-grammar cache: N distinct JSON schemas of P properties each compiled through the server's
`GrammarCache` (an LRU of 64 by default), RSS growth printed every 50.

    python benchmarks/grammar_memory.py --schemas 400 --properties 200
"""

import argparse
import time
from pathlib import Path

from transformers import AutoTokenizer

from eyas.engine.grammar import GrammarCache
from eyas.paths import DEFAULT_MODEL
from eyas.sampling_params import StructuredOutputParams


def rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=int, default=400, help="distinct schemas (default: 400)")
    parser.add_argument("--properties", type=int, default=200, help="properties per schema (default: 200)")
    parser.add_argument("--max-entries", type=int, default=64, help="the cache's bound (default: 64, the server's)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    cache = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, max_entries=args.max_entries)
    base, start = rss_mb(), time.perf_counter()
    for i in range(args.schemas):
        schema = {"type": "object", "required": [f"k{i}_0"],
                  "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 20} for j in range(args.properties)}}
        cache.compile(StructuredOutputParams(json_schema=schema))
        if (i + 1) % 50 == 0 or i + 1 == args.schemas:
            print(f"{i + 1} schemas: RSS +{rss_mb() - base:.0f} MB, {len(cache.compiled)} cached, xgrammar's own "
                  f"cache {cache.compiler.get_cache_size_bytes() / 2**20:.0f} MB, {time.perf_counter() - start:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
