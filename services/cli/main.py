"""The `pdserve` command: one entry point, one subcommand module per noun.

Lifecycle: `main()` builds the parser from each subcommand's `register`, parses argv,
configures logging and runs the chosen handler, turning expected errors (bad flags, a
missing model, an invalid request) into a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.errors import EngineError
from services.cli import (
    cluster_cmd,
    model_cmd,
    ray_cmd,
    rollout_cmd,
    run_cmd,
    serve_cmd,
    usage_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    parser.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    model_cmd.register(sub)
    run_cmd.register(sub)
    serve_cmd.register(sub)
    cluster_cmd.register(sub)
    ray_cmd.register(sub)
    rollout_cmd.register(sub)
    usage_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.die_with_parent:
        from services.cluster.local_cluster import die_with_parent

        die_with_parent()
    try:
        code: int = args.handler(args)
    except (EngineError, ValueError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
