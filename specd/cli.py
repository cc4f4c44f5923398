"""The `specd` command line.

Contract: every subcommand either does its job or prints one line `specd: error: <reason>` to
stderr and exits 2; a traceback is never the answer to bad input. `--json` output is one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specd.drafter.base import Drafter
from specd.drafter.checkpoint import load_drafter
from specd.drafter.replay import record_greedy
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.serving.checkpoint import CheckpointError
from specd.serving.engine import Engine, EngineConfig
from specd.serving.request import RequestRefused, SamplingParams
from specd.serving.target import DTYPES, LoadedTarget


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt with speculative decoding")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--drafter", default="random",
                   help="a drafter checkpoint file, or random | replay | none (default: random)")
    p.add_argument("-k", type=int, default=4, help="drafts per step (default: 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_generate)


def _build_drafter(choice: str, loaded: LoadedTarget, prompt_ids: list[int], params: SamplingParams,
                   dtype: str, device: str) -> Drafter | None:
    if choice == "none":
        return None
    if choice == "random":
        shape = DrafterShape.like(loaded.model.config)
        return TokenDrafter(new_drafter_model(loaded.model, shape, copy_from_target=True, seed=params.seed or 0))
    if choice == "replay":
        return record_greedy(loaded.model, [prompt_ids], params.max_tokens, loaded.eos_token_ids, max_batch=1)
    path = Path(choice)
    if not path.is_file():
        raise CheckpointError(f"--drafter {choice!r}: not a file, and not one of random, replay, none")
    return TokenDrafter(load_drafter(path, loaded.fingerprint, DTYPES[dtype], device), version=path.stem)


def run_generate(args: argparse.Namespace) -> int:
    loaded = LoadedTarget.load(args.target, args.dtype, args.device)
    prompt_ids = loaded.encode(args.prompt, chat=args.chat)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    drafter = _build_drafter(args.drafter, loaded, prompt_ids, params, args.dtype, args.device)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=1, num_draft_tokens=args.k,
                                                        eos_token_ids=loaded.eos_token_ids))
    seq = engine.add_request(prompt_ids, params)
    begin = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - begin
    text = loaded.decode(seq.output_ids)
    result = {
        "text": text,
        "token_ids": seq.output_ids,
        "finish_reason": seq.finish_reason,
        "drafter": args.drafter,
        "k": engine.k,
        "accept_length": round(seq.accept_length, 4),
        "acceptance_rate": round(seq.acceptance_rate, 4),
        "target_passes": seq.num_target_passes,
        "tokens_per_s": round(seq.num_output_tokens / seconds, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(text)
        print(f"\n[{seq.num_output_tokens} tokens, {result['tokens_per_s']} tok/s, accept length "
              f"{result['accept_length']}, acceptance {result['acceptance_rate']:.1%}, "
              f"{seq.num_target_passes} target passes]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return int(args.run(args))
    except (CheckpointError, RequestRefused, FileNotFoundError) as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
