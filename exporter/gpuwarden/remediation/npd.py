"""`gpuwarden npd-plugin`: a node-problem-detector custom plugin, one rule per condition family.

NPD's protocol: exit 0 is OK (the condition False), 1 a problem (True, stdout its message, cut at
max_output_length, 80 bytes by default), anything else Unknown. NPD kills a plugin after its timeout (5 s by
default). So: one question to the exporter within --timeout (3 s), a message of at most --max-output-length bytes
naming the GPU and the fault, and exit 2 (Unknown) whenever the exporter cannot be asked, or a check of the
condition is pending (its window not yet watched, as after a start without the state file: "GPU2 temperature
pending: 92 °C, seen for 13 s of 120 s"); a fault is never reported cleared because nothing answered or nothing
was watched long enough. Only the unhealthy direction is debounced: a fault is reported once it
is seen --debounce runs in a row, a recovery at once. The count lives on the host's tmpfs (--state-dir) so that a
replaced NPD pod does not start it again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpuwarden.commandline import ConfigError, OneLineParser
from gpuwarden.remediation.flags import add_endpoint_flags, endpoint, family_names
from gpuwarden.remediation.verdicts import LEVELS, Outcome, _fit, outcome

EXIT_OK, EXIT_PROBLEM, EXIT_UNKNOWN = 0, 1, 2
DEFAULT_STATE_DIR = Path("/run/gpuwarden/npd")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="gpuwarden npd-plugin", description=__doc__.split("\n\n")[0], hint=" (gpuwarden npd-plugin --help)"
    )
    parser.add_argument(
        "--condition", required=True, choices=family_names(), help="the condition family this rule reports"
    )
    parser.add_argument(
        "--debounce", type=int, default=2, help="runs in a row a fault must be seen before it is reported (default 2)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where the debounce count is kept, on tmpfs (default {DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--max-output-length",
        type=int,
        default=80,
        help="NPD's max_output_length: the message is cut to it (default 80 bytes)",
    )
    add_endpoint_flags(parser, timeout_s=3.0)
    return parser


def _confirmed(state_dir: Path, condition: str, result: Outcome, debounce: int) -> tuple[bool, str, str, int]:
    """(report the fault now?, a note for stderr, the fault's message, runs in a row it was seen). Unknown leaves the
    count as it was.

    The count is kept per fault (GPU and check): a different fault starts it again, never counting as a repeat of
    the last one. While one fault lasts, its first message is printed again, so that NPD's message-based condition
    update (`enable_message_change_based_condition_update`, on in the shipped config) does not patch the Node and emit
    an Event every run because a live value (°C, %) moved."""
    path = state_dir / f"{condition}.json"
    try:
        stored = json.loads(path.read_text())
        stored = stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        stored = {}
    if result.state == "unknown":
        return False, "", result.message, 0
    same = result.state == "problem" and stored.get("fault") == result.fault
    seen = (_count(stored.get("seen")) + 1 if same else 1) if result.state == "problem" else 0
    message = result.message
    if same and isinstance(stored.get("message"), str) and stored["message"]:
        message = stored["message"]
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seen": seen, "fault": result.fault, "message": message}))
    except OSError as error:
        # without a place to count, a fault is reported at once: better early than never
        return result.state == "problem", f"debounce off: {path}: {error.strerror}", message, seen
    return result.state == "problem" and seen >= debounce, "", message, seen


def _count(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.debounce < 1:
            raise ConfigError(f"--debounce {args.debounce}: give 1 or more runs")
        if not 20 <= args.max_output_length <= 4096:
            raise ConfigError(f"--max-output-length {args.max_output_length}: give 20 to 4096 bytes")
        target = endpoint(args)
    except (ConfigError, ValueError) as error:
        print(f"gpuwarden npd-plugin: {error}", file=sys.stderr)
        print("gpuwarden npd-plugin: bad flags (see stderr)")
        return EXIT_UNKNOWN
    result = outcome(target, args.condition, LEVELS[args.level], args.max_output_length)
    report, note, message, seen = _confirmed(args.state_dir, args.condition, result, args.debounce)
    if note:
        print(note, file=sys.stderr)
    if result.state == "problem" and not report:
        # exit 0 is NPD's "condition False": its message must not read as a fault that was reported
        message = _fit(f"no fault yet: seen {seen} of {args.debounce} runs: {message}", args.max_output_length)
    print(message)
    if result.state == "unknown":
        return EXIT_UNKNOWN
    return EXIT_PROBLEM if report else EXIT_OK
