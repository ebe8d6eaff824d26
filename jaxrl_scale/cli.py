"""`jaxrl-scale` command line: parse arguments, build the config, call one function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxrl_scale.config import ConfigError, load_config

DEFAULT_DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-scale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="short CPU run of the policy end to end")
    demo.add_argument("--config", type=Path, default=None, help="YAML config (default: demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--steps", type=int, default=150)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from jaxrl_scale.demo import run_demo

            config_path = args.config
            if config_path is None and DEFAULT_DEMO_CONFIG.exists():
                config_path = DEFAULT_DEMO_CONFIG
            cfg = load_config(config_path, args.overrides)
            run_demo(cfg, args.out, steps=args.steps)
    except ConfigError as e:
        print(f"jaxrl-scale: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
