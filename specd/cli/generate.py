"""`specd generate`: decode one prompt with speculative decoding and report what the drafter did.

Contract: impossible settings are refused before the target loads (k above `MAX_DRAFTS` at parse
time, sampling settings and the device before the weights); k is the most drafts a step, capped at
--max-tokens, since a step never needs more drafts than the tokens still wanted: the lookahead
controller picks 0 to k each step from the step costs it measures, so the report gives the cap
(`k`) and how many steps drafted how many (`drafts_per_step`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from specd.core.arguments import at_least
from specd.core.errors import ConfigurationError
from specd.drafter.base import BUILT_IN_VERSION, Drafter
from specd.drafter.checkpoint import load_drafter
from specd.drafter.factory import DrafterSpec, build_drafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.pretrained import SHIPPED_DRAFTER, check_fits_target, check_manifest
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.greedy_recording import record_greedy
from specd.engine.request import SamplingParams
from specd.model.target import DEVICES, DTYPES, LoadedTarget

# drafts per step: acceptance falls off geometrically with depth, so past a few dozen a longer
# chain only costs drafting passes (and a k in the thousands ran for minutes)
MAX_DRAFTS = 32


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt with speculative decoding")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--drafter", default=None,
                   help="a drafter checkpoint file, or shipped (the bundled pretrained drafter) | random | replay "
                        "| none (default: shipped for the bundled target, random for another --target)")
    p.add_argument("-k", type=at_least(0, MAX_DRAFTS), default=4,
                   help=f"most drafts a step, 0 to {MAX_DRAFTS}, capped at --max-tokens; the lookahead controller "
                        f"picks fewer where they do not pay (default: 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: draw from the most likely tokens holding this much probability, "
                        "in (0, 1]; applies when --temperature is above 0 (default: 1.0, all tokens)")
    p.add_argument("--max-tokens", type=at_least(1), default=128, help="most tokens to generate (default: 128)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for sampling and the random drafter, for repeatable runs (default: none, "
                        "a fresh draw each run; the random drafter then uses 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help=f"{DEVICES} (default: cpu)")
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
    path = SHIPPED_DRAFTER if choice == "shipped" else Path(choice)
    if not path.is_file():
        raise ConfigurationError(f"--drafter {choice!r}: not a file, and not one of shipped, random, replay, none")
    check_manifest(path, required=choice == "shipped")   # a file `specd pretrain` wrote matches what it names
    model = load_drafter(path, loaded.fingerprint, DTYPES[dtype], device, target_embedding=loaded.model.embed.weight)
    if isinstance(model, FeatureDrafterModel):
        check_fits_target(path, model, loaded.model)
    return build_drafter(DrafterSpec(kind="learned"), model, BUILT_IN_VERSION)  # a file, not a stored version


def run_generate(args: argparse.Namespace) -> int:
    # sampling settings first: a bad --top-p is refused before the weights load, not after
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    loaded = LoadedTarget.load(args.target, args.dtype, args.device)
    prompt_ids = loaded.encode(args.prompt, chat=args.chat)
    choice = args.drafter or ("shipped" if args.target is None else "random")
    drafter = _build_drafter(choice, loaded, prompt_ids, params, args.dtype, args.device)
    k = min(args.k, args.max_tokens)  # drafts past the tokens wanted are never used, yet still cost time
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=1, num_draft_tokens=k,
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
        "drafter": choice,
        "k": engine.k,
        "drafts_per_step": dict(sorted(Counter(len(step.drafts) for step in seq.steps).items())),
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
