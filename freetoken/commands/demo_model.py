"""``demo-model DIR``: write the built-in demo model (or a random one, or a ``synth:`` one) as a HF
directory."""
from __future__ import annotations

from freetoken.models.demo import BUILTIN
from freetoken.log import logger


def register(sub) -> None:
    p = sub.add_parser("demo-model", help="write the built-in demo model (or --random) to DIR")
    p.add_argument("dir", help="output directory")
    p.add_argument("--random", action="store_true",
                   help="write a deterministic tiny random Qwen3-MoE instead of the trained demo model")
    p.add_argument("--seed", type=int, default=0, help="--random: weight seed (default: 0)")
    p.add_argument("--builtin", choices=sorted(BUILTIN), default="demo",
                   help="which built-in model to write (default: demo)")
    p.add_argument("--synth", metavar="SPEC",
                   help="write the synthetic model synth:SPEC instead (e.g. medium, qwen3-30b-a3b,layers=12)")
    p.set_defaults(run=run)


def run(args) -> int:
    from freetoken.models.demo import write_demo_model, write_random_model
    if args.synth:
        from freetoken.models.synth_export import export_synth
        logger.info("wrote synth:%s to %s", args.synth, export_synth(args.synth, args.dir, logger))
        return 0
    path = write_random_model(args.dir, seed=args.seed) if args.random else write_demo_model(args.dir, args.builtin)
    logger.info("wrote %s model to %s", "random" if args.random else f"the {args.builtin} ({BUILTIN[args.builtin]})", path)
    return 0
