"""``demo-model DIR``: write the built-in demo model (or a random one) as a HF directory."""
from __future__ import annotations

from freetoken.log import logger


def register(sub) -> None:
    p = sub.add_parser("demo-model", help="write the built-in demo model (or --random) to DIR")
    p.add_argument("dir", help="output directory")
    p.add_argument("--random", action="store_true",
                   help="write a deterministic tiny random Qwen3-MoE instead of the trained demo model")
    p.add_argument("--seed", type=int, default=0, help="--random: weight seed (default: 0)")
    p.set_defaults(run=run)


def run(args) -> int:
    from freetoken.demo import write_demo_model, write_random_model
    path = write_random_model(args.dir, seed=args.seed) if args.random else write_demo_model(args.dir)
    logger.info("wrote %s model to %s", "random" if args.random else "demo", path)
    return 0
