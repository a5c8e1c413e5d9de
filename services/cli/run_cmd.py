"""`pdserve run "prompt"`: run one engine in this process and stream a completion.

A single-process sanity check of the model and engine (no gateway, no workers): the
prompt goes through the chat template unless `--raw`, tokens are printed as they are
decoded, and the engine's KV/prefix stats are printed at the end with `--stats`.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import EngineConfig
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from services.common.config import add_config_args, config_from_args
from services.common.detokenizer import IncrementalDetokenizer


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("run", help="generate in this process (no cluster) and stream")
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--stats", action="store_true", help="print engine stats at the end")
    add_config_args(parser, EngineConfig)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported here: every `pdserve` command parses this module, and the engine brings
    # torch, which the gateway and client commands never need.
    from engine.engine import LLMEngine

    engine = LLMEngine(config_from_args(EngineConfig, args), progress=True)
    tok = engine.tokenizer
    ids = (
        tok.encode(args.prompt) if args.raw else tok.encode_chat([ChatMessage("user", args.prompt)])
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    rid = engine.add_request(RequestSpec(ids, params))
    detok = IncrementalDetokenizer(tok)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(detok.push(out.new_token_ids))
                sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if args.stats:
        print(engine.stats(), file=sys.stderr)
    return 0
