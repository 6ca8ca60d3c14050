"""python -m deepinfer <command>. Commands: run-batch (OpenAI batch files offline, entrypoints/run_batch.py)."""
import argparse
import sys

from deepinfer.entrypoints import run_batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer")
    run_batch.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
