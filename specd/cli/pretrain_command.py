"""`specd pretrain`: train a feature drafter offline from a recipe (`specd.offline.pretrain`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from specd.core.arguments import at_least, non_negative_number, positive_number
from specd.core.errors import ConfigurationError
from specd.model.target import LoadedTarget

PRETRAIN_FLAGS = {"data": "data", "conversations": "conversations", "max_length": "max_length",
                  "draft_vocab": "draft_vocab", "drafter_layers": "drafter_layers", "greedy_only": "greedy_only",
                  "init": "init",
                  "prompt_weight": "prompt_weight",
                  "steps": "steps", "batch": "batch_size", "lr": "learning_rate", "unroll": "unroll",
                  "objective": "objective", "eval_every": "eval_every", "seed": "seed", "max_seconds": "max_seconds",
                  "keep": "keep"}


def add_pretrain_parser(sub: argparse._SubParsersAction) -> None:
    from specd.offline.pretrain import INITS, KEEPS, RECIPES

    p = sub.add_parser("pretrain", help="train a feature drafter offline (by default on the target's own responses)")
    p.add_argument("--out", required=True, help="the version file to write (a .json manifest goes beside it)")
    p.add_argument("--work", required=True, help="work folder: generated data, features, checkpoints; rerun to resume")
    p.add_argument("--target", default=None)
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named recipe (shipped, then shipped-2 and shipped-3, each with --init-from the file "
                        "the stage before made: the bundled drafter's stages); the flags below override it")
    p.add_argument("--data", choices=["distilled", "sharegpt"], default=None,
                   help="distilled: the target's own responses (default); sharegpt: ShareGPT's own text")
    p.add_argument("--conversations", type=at_least(1), default=None, help="sharegpt: conversations read")
    p.add_argument("--max-length", type=at_least(16), default=None,
                   help="sharegpt: tokens kept per conversation (at least 16: shorter conversations are left out)")
    p.add_argument("--draft-vocab", type=at_least(1), default=None, help="ids the output head covers")
    p.add_argument("--drafter-layers", type=at_least(1), default=None, help="the drafter's decoder layers (default 1)")
    p.add_argument("--init", choices=INITS, default=None,
                   help="the drafter layer's starting weights: random (default), or the target's last layer's "
                        "attention and MLP (output projections damped)")
    p.add_argument("--init-from", default=None, metavar="FILE",
                   help="continue training this version file (one `specd pretrain` made, for this target) "
                        "instead of starting a new drafter; its manifest is kept in the new one's")
    p.add_argument("--greedy-only", action="store_true", default=None,
                   help="distilled: train on the greedy answers only, not the sampled ones")
    p.add_argument("--prompt-weight", type=non_negative_number, default=None,
                   help="distilled: label weight of prompt positions (default 0.2; the shipped recipe's 0 trains "
                        "on the answers alone and skips the prompts' cost)")
    p.add_argument("--distill-rounds", type=at_least(1), default=None,
                   help="distilled: answers generated per prompt (the recipe's rounds; fewer reads the first ones)")
    p.add_argument("--first-round", type=at_least(0), default=None,
                   help="distilled: leave out the rounds before this one (with --init-from: train on new answers "
                        "only, not those the file was trained on)")
    p.add_argument("--distill-sample", type=at_least(1), default=None, metavar="N",
                   help="distilled: answer a seeded draw of N of the prompts (default: all)")
    p.add_argument("--later-turns", action="store_true", default=None,
                   help="distilled: also answer every later user turn of the training conversations, its "
                        "context's earliest exchanges dropped until it fits (about 3x the prompts)")
    p.add_argument("--steps", type=at_least(1), default=None, help="training steps (default 4000)")
    p.add_argument("--batch", type=at_least(1), default=None, help="examples per step (default 8)")
    p.add_argument("--lr", type=non_negative_number, default=None, help="peak learning rate (default 6e-4)")
    p.add_argument("--unroll", type=at_least(1), default=None, help="drafting steps trained per position (default 3)")
    p.add_argument("--objective", choices=["kl", "accept"], default=None,
                   help="kl: match the target's distribution (default); accept: raise a draft's chance of acceptance, "
                        "sum(min(p, q))")
    p.add_argument("--eval-every", type=at_least(1), default=None,
                   help="steps between held-out evaluations and the --keep best check (default 250)")
    p.add_argument("--keep", choices=KEEPS, default=None,
                   help="the weights written: the last (default), or those of the evaluation point with the best "
                        "validation accept length")
    p.add_argument("--max-seconds", type=positive_number, default=None,
                   help="stop training after this many training seconds")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=None, help="seed of the data draw and the weights (default 0)")
    p.set_defaults(run=run_pretrain)


def pretrain_config(args: argparse.Namespace):
    """The recipe (or the defaults) with the flags given on the command line in place of its values."""

    from specd.offline.pretrain import PretrainConfig, recipe

    overrides = {name: getattr(args, flag) for flag, name in PRETRAIN_FLAGS.items() if getattr(args, flag) is not None}
    try:
        config = recipe(args.recipe, **overrides) if args.recipe else replace(PretrainConfig(), **overrides)
        distill = {name: value for name, value in (("rounds", args.distill_rounds),
                                                    ("first_round", args.first_round),
                                                    ("sample", args.distill_sample)) if value is not None}
        if distill:
            config = replace(config, distill=replace(config.distill, **distill))
        if args.later_turns:
            config = replace(config, distill=replace(config.distill, later_turns=True))
        return config
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def check_paths(out: Path, work: Path) -> None:
    """Refuse, before hours of training, an --out or --work that could not be written at the end."""
    if out.suffix == ".json":  # the manifest goes to out.with_suffix(".json"): it would overwrite the weights
        raise ConfigurationError(f"--out {out}: the manifest is written beside the weights as .json; give the "
                                 f"weights file another name, e.g. {out.with_suffix('.safetensors')}")
    if out.is_dir():
        raise ConfigurationError(f"--out {out} is a folder: give the version file to write")
    if work.exists() and not work.is_dir():
        raise ConfigurationError(f"--work {work} is a file: give a folder (it is made if missing)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigurationError(f"--out {out}: cannot make its folder ({error.strerror})") from None


def run_pretrain(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from specd.offline.pretrain import RECIPE_PARENTS, pretrain

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("specd").setLevel(logging.INFO)
    config = pretrain_config(args)
    check_paths(Path(args.out), Path(args.work))
    command = "specd " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    parent = Path(args.init_from) if args.init_from else None
    if parent is not None and args.init is not None:
        raise ConfigurationError("--init says how to start a new drafter; --init-from continues the one in a file: "
                                 "give one of them")
    stage_of = RECIPE_PARENTS.get(args.recipe)
    if stage_of is not None and parent is None:
        raise ConfigurationError(f"recipe {args.recipe} continues a version file made by --recipe {stage_of}: "
                                 f"give that file with --init-from")
    loaded = LoadedTarget.load(args.target)
    vocab_size = loaded.model.config.vocab_size
    if args.draft_vocab is not None and args.draft_vocab > vocab_size:
        print(f"specd pretrain: --draft-vocab {args.draft_vocab} is more than the target's {vocab_size} ids: "
              f"the drafter covers all {vocab_size}", file=sys.stderr)
    manifest = pretrain(loaded, config, Path(args.work), Path(args.out), command, parent)
    held_out = manifest["held_out"]
    print(f"wrote {args.out}: held-out accept length {held_out['accept_length']:.3f} on evaluation prompts "
          f"(validation {held_out['validation']['accept_length']:.3f}, k = {held_out['k']}) after "
          f"{manifest['steps']} steps, {manifest['tokens_trained']} tokens")
    return 0
