"""`eyas bench serve` without the `eyas` command (the same arguments), e.g. plain vs MTP on the shipped target:

    python benchmarks/serve.py --speculative-method mtp --num-speculative-tokens 3 --concurrency 1 4 16
"""

import argparse
import sys

from eyas.bench import add_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/serve.py")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
