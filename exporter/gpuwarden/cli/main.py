"""Entry point: parse flags, load settings, wire NVML (real or simulated) → poller → renderer → HTTP, run."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwarden import __version__
from gpuwarden.commandline import (
    EXIT_CONFIG,
    OneLineParser,
)
from gpuwarden.config.settings import ConfigError, Settings, load_settings, options
from gpuwarden.config.typed import choices

log = logging.getLogger("gpuwarden")

SIM_LISTEN_ADDRESS = "127.0.0.1:10045"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        hint="; see gpuwarden --help",
        prog="gpuwarden",
        description="NVIDIA GPU exporter for Prometheus. Subcommands: `gpuwarden check-config FILE` validates a "
        "config file; `gpuwarden scenarios` lists the simulator's scenarios; `gpuwarden rules --thresholds FILE` "
        "writes the alert rules for a thresholds file; `gpuwarden validate` "
        "compares its readings with nvidia-smi on a GPU host; `gpuwarden fleet --prometheus-url URL` "
        "serves the fleet view from Prometheus; `gpuwarden npd-plugin` and `gpuwarden slurm-healthcheck` tell "
        "node-problem-detector and Slurm what the exporter found.",
        epilog="Precedence: defaults < --config file < GPUWARDEN_* environment < flags.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration file.")
    parser.add_argument(
        "--sim",
        action="store_true",
        help=f"Shorthand for --nvml.backend=sim; listens on {SIM_LISTEN_ADDRESS} unless an address is given.",
    )
    add_setting_flags(parser)
    return parser


def _help_text(opt: Any) -> str:
    """Description, the allowed values of a choice, the default (or that there is none), the environment name."""
    default = opt.default
    shown = ",".join(default) if isinstance(default, tuple) else default
    allowed_values = choices(opt.annotation)
    allowed = f" One of: {', '.join(map(str, allowed_values))}." if allowed_values else ""
    default_text = "none" if shown in (None, "", ()) else str(shown)
    return f"{opt.description}{allowed} Default: {default_text}. Env: {opt.env}."


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, named and documented from the settings model."""
    for opt in options():
        help_text = _help_text(opt)
        if opt.annotation is bool:
            parser.add_argument(
                opt.flag, dest=opt.key, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif opt.is_list:
            parser.add_argument(
                opt.flag,
                dest=opt.key,
                default=None,
                metavar="GLOBS",
                type=lambda raw: [item.strip() for item in raw.split(",") if item.strip()],
                help=help_text,
            )
        else:
            parser.add_argument(opt.flag, dest=opt.key, default=None, metavar=opt.name.upper(), help=help_text)


def check_config(args: list[str]) -> int:
    if args in (["--help"], ["-h"]):
        print(
            "usage: gpuwarden check-config FILE\n\nValidate a config file (and its scenario on the simulator) without "
            "starting: prints 'FILE: ok', or one line naming the field and the fix and exits 2."
        )
        return 0
    if len(args) != 1:
        print("gpuwarden: usage: gpuwarden check-config FILE", file=sys.stderr)
        return EXIT_CONFIG
    try:
        settings = load_settings(Path(args[0]), environ={})
        _load_referenced_files(settings)
        if settings.nvml.backend == "sim":
            from gpuwarden.sim.scenario import load_scenario

            load_scenario(settings.nvml.scenario or "training")
    except ConfigError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{args[0]}: ok")
    return 0


def _load_referenced_files(settings: Settings) -> None:
    """The files a config names (thresholds, web config) loaded as the daemon loads them at start, so a path that
    does not exist or a file that does not parse is one line and exit 2 from check-config too, not only from the
    daemon."""
    from gpuwarden.health.thresholds import load_thresholds

    load_thresholds(settings.health.thresholds_file)
    if settings.web.config_file is not None:
        from gpuwarden.config.web import load_web_config

        load_web_config(settings.web.config_file)


def list_scenarios() -> int:
    from gpuwarden.sim.scenario import load_scenario, shipped_scenarios

    names = sorted(shipped_scenarios())
    lines = [f"{name:24} {load_scenario(name).description.strip().split('. ')[0]}" for name in names]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `gpuwarden scenarios | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
    return 0


def settings_from_argv(argv: list[str]) -> Settings:
    args = build_parser().parse_args(argv)
    flags: dict[str, Any] = {key: value for key, value in vars(args).items() if "." in key and value is not None}
    defaults: dict[str, Any] = {}
    if args.sim:
        flags.setdefault("nvml.backend", "sim")
        # a simulated node on a laptop is for this machine: loopback unless an address is given (the demo's
        # containers give :10045)
        defaults["web.listen_address"] = SIM_LISTEN_ADDRESS
    return load_settings(args.config, os.environ, flags, defaults)


def _subcommand(module: str, function: str = "main") -> Callable[[list[str]], int]:
    """A subcommand's entry point, imported only when it runs (the daemon's start-up loads none of them)."""

    def run(args: list[str]) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "check-config": check_config,
    "scenarios": lambda _args: list_scenarios(),
    "rules": _subcommand("gpuwarden.cli.rules"),
    "validate": _subcommand("gpuwarden.cli.validate"),
    "fleet": _subcommand("gpuwarden.fleet.main"),
    "npd-plugin": _subcommand("gpuwarden.remediation.npd"),
    "kernel-log-relay": _subcommand("gpuwarden.cli.kernel_log_relay"),
    "slurm-healthcheck": _subcommand("gpuwarden.remediation.slurm"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    # Start-up allocates ~100,000 objects that nearly all live for good: the cyclic GC's collections during it
    # (about a tenth of the import time) find nothing to free. settle_memory() turns it back on after the first
    # snapshot, with one full collection; whatever ends start-up early turns it back on here.
    gc.disable()
    from gpuwarden.runtime.service import limit_malloc_arenas

    limit_malloc_arenas(os.environ)  # before the first thread
    try:
        return _load_and_serve(argv)
    finally:
        gc.enable()


def _load_and_serve(argv: list[str]) -> int:
    try:
        settings = settings_from_argv(argv)
        _load_referenced_files(settings)  # one line and exit 2 now, not a traceback in the poller
        if settings.nvml.backend == "sim":
            from gpuwarden.sim import install_simulator

            install_simulator(settings.nvml.scenario)
    except ConfigError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from gpuwarden.runtime.service import serve

    # A native crash in the parent (the driver's library corrupting the heap: "malloc(): corrupted top size" killed
    # one on a lent 2x H200, docs/validation/2026-11-28-h200x2-jobs) leaves every thread's Python stack on stderr,
    # so the NVML call each thread was in is known; the GPM child runs with -X faulthandler for the same reason.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    return serve(settings, lambda: settings_from_argv(argv))
