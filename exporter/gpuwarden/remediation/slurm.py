"""`gpuwarden slurm-healthcheck`: a Slurm HealthCheckProgram that drains on a critical GPU verdict, resumes its own.

`gpuwarden slurm-healthcheck`: a Slurm HealthCheckProgram that drains a node on a critical GPU verdict and resumes
only the drains it made.

slurmd runs it as root every HealthCheckInterval and kills it after 60 s; any action is the program's own
(`scontrol update`). The rails, in the order they apply:
- the exporter cannot be asked, could not see, or a check is pending (its window not yet watched, as after a
  start without the state file): Unknown, exit 2, nothing changes: a drain stays, none is made, nothing resumes;
- a drain is gpuwarden's when its reason begins with --reason-prefix; anyone else's drain is left alone, fault or not;
- a node whose AvailableFeatures hold --opt-out-feature is never drained;
- a fault already drained once and resumed by a person is not drained again until it clears (state on tmpfs);
- at most --max-drained nodes of the node's partitions drained by gpuwarden, converging within one run (see
  `hold_the_cap`): slurmd runs the check on every node at once, so a count before draining is not enough;
- --dry-run logs each scontrol command instead of running it.
Each run is stateless about events: it acts on the verdicts of now, so nothing stale is replayed after a pause.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.commandline import ConfigError, OneLineParser
from gpuwarden.remediation.flags import add_endpoint_flags, endpoint, family_names
from gpuwarden.remediation.verdicts import LEVELS, Outcome, outcomes

log = logging.getLogger("gpuwarden.slurm")
EXIT_OK, EXIT_PROBLEM, EXIT_UNKNOWN = 0, 1, 2
DEFAULT_STATE_DIR = Path("/run/gpuwarden/slurm")
DRAINED_STATES = ("drain", "drained", "draining")  # sinfo %T, lower case, a trailing * when not responding
COMMAND_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeState:
    """What sinfo says of one node: its state word, its drain reason ("" when none), its partitions, and when the
    reason was set (sinfo %H, ISO 8601 to the second; "" when unknown)."""

    name: str
    state: str
    reason: str
    partitions: tuple[str, ...]
    since: str = ""

    @property
    def drained(self) -> bool:
        return any(word in DRAINED_STATES for word in self.state.rstrip("*~#!%$@^-").split("+"))


class SlurmError(Exception):
    """A Slurm command failed or answered something unreadable."""


# slurmd runs a HealthCheckProgram with an empty environment (no PATH): Slurm's tools are looked for on PATH, then
# where distributions and source builds put them
SLURM_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin")


@dataclass(frozen=True)
class Slurm:
    """The Slurm commands this check runs (sinfo, scontrol), from --slurm-bin-dir or found as slurmd's empty
    environment requires; each under a 10 s deadline, a failure as SlurmError with the command's own words."""

    bin_dir: str | None = None

    def tool(self, name: str) -> str:
        if self.bin_dir:
            return str(Path(self.bin_dir) / name)
        found = shutil.which(name) or next(
            (f"{d}/{name}" for d in SLURM_DIRS if os.access(f"{d}/{name}", os.X_OK)), None
        )
        if found is None:
            raise SlurmError(f"{name} not found on PATH or in {', '.join(SLURM_DIRS)}: give --slurm-bin-dir")
        return found

    def run(self, command: list[str]) -> str:
        command = [self.tool(command[0]), *command[1:]]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SlurmError(f"{command[0]}: {error}") from None
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(command[:3])}: exit {done.returncode}: {done.stderr.strip()[:200]}")
        return done.stdout

    def nodes(self, selector: list[str]) -> list[NodeState]:
        """Nodes as sinfo lists them (one line per node and partition), merged per node."""
        out = self.run(["sinfo", "-h", "-N", *selector, "-o", "%N|%T|%P|%H|%E"])
        found: dict[str, NodeState] = {}
        for line in out.splitlines():
            parts = line.split("|", 4)
            if len(parts) != 5:
                raise SlurmError(f"sinfo answered an unreadable line: {line[:100]!r}")
            name, state, partition, since, reason = parts
            reason = "" if reason == "none" else reason
            since = since if since[:1].isdigit() else ""  # "Unknown" where no reason is set
            known = found.get(name)
            partitions = (known.partitions if known else ()) + (partition.rstrip("*"),)
            found[name] = NodeState(name, state.lower(), reason, partitions, since)
        return list(found.values())

    def features(self, node: str) -> set[str]:
        """The node's AvailableFeatures (scontrol show node -o)."""
        for field in self.run(["scontrol", "show", "node", "-o", node]).split():
            if field.startswith("AvailableFeatures="):
                value = field.split("=", 1)[1]
                return set() if value in ("(null)", "") else set(value.split(","))
        return set()


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="gpuwarden slurm-healthcheck",
        description=__doc__.split("\n\n")[0],
        hint=" (gpuwarden slurm-healthcheck --help)",
    )
    parser.add_argument(
        "--node", default=None, help="the Slurm node name (default $SLURMD_NODENAME, else the short host name)"
    )
    parser.add_argument("--dry-run", action="store_true", help="log the scontrol commands instead of running them")
    parser.add_argument(
        "--max-drained",
        type=int,
        default=1,
        help="the most nodes of this node's partitions gpuwarden keeps drained at once (default 1)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds to wait after draining before counting again, plus up to a quarter more at random: longer "
        "than sinfo and scontrol take on a busy slurmctld (default 2)",
    )
    parser.add_argument(
        "--reason-prefix",
        default="gpuwarden:",
        help="drain reasons gpuwarden writes begin with it; only those are ever resumed",
    )
    parser.add_argument(
        "--opt-out-feature",
        default="gpuwarden-no-drain",
        help="a node feature that keeps gpuwarden from draining the node",
    )
    parser.add_argument(
        "--conditions",
        default=",".join(family_names()),
        help=f"condition families that drain (default all: {','.join(family_names())})",
    )
    parser.add_argument(
        "--slurm-bin-dir",
        default=None,
        help=f"where sinfo and scontrol are (default: PATH, then {', '.join(SLURM_DIRS)})",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where a person's resume of a gpuwarden drain is remembered (default {DEFAULT_STATE_DIR})",
    )
    add_endpoint_flags(parser, timeout_s=10.0)
    return parser


def _judge(args, target) -> Outcome:  # noqa: ANN001 - argparse namespace, Endpoint
    """The worst of the chosen families: a problem in any, else unknown in any, else ok."""
    results = outcomes(target, args.families, LEVELS[args.level], limit=200)  # one request for every family
    for state in ("problem", "unknown"):
        hits = [r for r in results if r.state == state]
        if hits:
            return hits[0]
    return results[0]


class Memory:
    """The drain gpuwarden made (node, fault), kept on tmpfs: a person's resume of it is honoured until it clears."""

    def __init__(self, state_dir: Path, node: str) -> None:
        self.path = state_dir / f"{node}.json"

    def load(self) -> dict[str, str]:
        try:
            loaded = json.loads(self.path.read_text())
            return loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self, value: dict[str, str]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(value))
        except OSError as error:
            log.warning("cannot remember the drain in %s (%s): a person's resume may be undone", self.path, error)


def cap_order(node: NodeState) -> tuple[str, str]:
    """The order in which gpuwarden's drains keep their place under the cap: the earliest drain first, then the node
    name. Every run sees the same order, so the runs of one round agree on who keeps the drain."""
    return (node.since or "9999", node.name)


def drained_by_gpuwarden(args, slurm: Slurm, node: NodeState) -> list[NodeState]:  # noqa: ANN001 - argparse
    """The nodes of this node's partitions that gpuwarden has drained (its reason prefix), as sinfo says now."""
    return [
        n
        for n in slurm.nodes(["-p", ",".join(node.partitions)])
        if n.drained and n.reason.startswith(args.reason_prefix)
    ]


def over_the_cap(args, slurm: Slurm, node: NodeState) -> list[NodeState]:  # noqa: ANN001 - argparse namespace
    """gpuwarden's drains in the node's partitions that come before this node in `cap_order`, where this node is
    not among the first --max-drained of them; [] where it keeps its place."""
    ours = sorted(drained_by_gpuwarden(args, slurm, node), key=cap_order)
    names = [n.name for n in ours]
    if node.name not in names or names.index(node.name) < args.max_drained:
        return []
    return ours[: names.index(node.name)]


def hold_the_cap(args, slurm: Slurm, node: NodeState, undo) -> str | None:  # noqa: ANN001 - argparse, a callable
    """Count again after draining and give the drain back where it went over the cap.

    slurmd runs HealthCheckProgram on every node at once, so several runs can each count below the cap and drain
    (four runs drained four nodes under --max-drained 1 before this check existed). Counting again after the others
    have had time to drain (--settle), each run ranks gpuwarden's drains by `cap_order`, and a node beyond the first
    --max-drained resumes itself. The earliest drains never give way, so the cap is never undershot; a run slower than
    the settle time is caught at the node's next health check (the "still drained" path counts too). Returns the line
    that says so, or None where the drain stays."""
    before = over_the_cap(args, slurm, node)
    if not before:
        return None
    undo()
    names = ",".join(n.name for n in before)
    return f"over --max-drained {args.max_drained}: {names} drained first; gave the drain back"


def act(args, slurm: Slurm, node: NodeState, verdict: Outcome, memory: Memory) -> str:  # noqa: ANN001 - argparse
    """What to do, done (or logged in dry-run); returns the one line that says it."""
    ours = node.drained and node.reason.startswith(args.reason_prefix)
    remembered = memory.load()
    prefix = "dry-run: would run" if args.dry_run else "ran"

    def scontrol(*words: str) -> None:
        command = ["scontrol", "update", f"NodeName={node.name}", *words]
        log.info("%s: %s", prefix, " ".join(command))
        if not args.dry_run:
            slurm.run(command)

    if verdict.state == "ok":
        if remembered:
            memory.save({})
        if ours:
            scontrol("State=UNDRAIN")  # only the drain flag gpuwarden set: a DOWN or FAIL state stays
            return f"{node.name}: GPUs healthy again; {prefix} the resume of gpuwarden's drain ({node.reason})"
        return f"{node.name}: GPUs healthy" + (
            f"; drained by someone else, left alone ({node.reason})" if node.drained else ""
        )

    def give_back() -> None:
        scontrol("State=UNDRAIN")
        memory.save({})  # not a person's resume: the next run may drain again once the cap has room

    # a problem
    if ours:
        released = None if args.dry_run else hold_the_cap(args, slurm, node, give_back)
        if released:
            return f"{node.name}: {verdict.message}; {released}"
        return f"{node.name}: still drained by gpuwarden ({node.reason})"
    if node.drained:
        return f"{node.name}: {verdict.message}; drained by someone else, left alone ({node.reason})"
    if remembered.get("fault") == verdict.fault:
        return f"{node.name}: {verdict.message}; gpuwarden's drain for it was resumed by a person: not drained again"
    if args.opt_out_feature and args.opt_out_feature in slurm.features(node.name):
        return f"{node.name}: {verdict.message}; feature {args.opt_out_feature} set: not drained"
    drained = drained_by_gpuwarden(args, slurm, node)
    if len(drained) >= args.max_drained:
        names = ",".join(sorted(n.name for n in drained))
        return (
            f"{node.name}: {verdict.message}; not drained: {len(drained)} node(s) of {','.join(node.partitions)} "
            f"already drained by gpuwarden ({names}), --max-drained {args.max_drained}"
        )
    reason = f"{args.reason_prefix} {verdict.message}"[:250]
    scontrol("State=DRAIN", f"Reason={reason}")
    if args.dry_run:
        return f"{node.name}: {verdict.message}; {prefix} the drain"
    memory.save({"fault": verdict.fault})
    time.sleep(args.settle * (1 + random.random() / 4))  # the other nodes' runs of this round drain meanwhile
    released = hold_the_cap(args, slurm, node, give_back)
    if released:
        return f"{node.name}: {verdict.message}; drained, then {released}"
    return f"{node.name}: {verdict.message}; {prefix} the drain"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="gpuwarden slurm-healthcheck: %(message)s", stream=sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        args.families = [f for f in args.conditions.split(",") if f]
        unknown = [f for f in args.families if f not in family_names()]
        if unknown or not args.families:
            raise ConfigError(f"--conditions {args.conditions!r}: choose from {','.join(family_names())}")
        if args.max_drained < 1:
            raise ConfigError(f"--max-drained {args.max_drained}: give 1 or more (use --dry-run to act on none)")
        if not 0 <= args.settle <= 20:
            raise ConfigError(f"--settle {args.settle:g}: give 0 to 20 seconds (inside slurmd's 60 s)")
        if not args.reason_prefix.strip():
            raise ConfigError("--reason-prefix must not be empty: it is how gpuwarden knows its own drains")
        target = endpoint(args)
    except (ConfigError, ValueError) as error:
        print(f"gpuwarden slurm-healthcheck: {error}", file=sys.stderr)
        return EXIT_UNKNOWN
    slurm = Slurm(args.slurm_bin_dir)
    name = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    verdict = _judge(args, target)
    if verdict.state == "unknown":
        print(f"{name}: unknown, nothing changed: {verdict.message}")
        return EXIT_UNKNOWN
    try:
        (node,) = slurm.nodes(["-n", name]) or [None]
        if node is None:
            raise SlurmError(f"sinfo does not know node {name!r}: give --node as slurm.conf names it")
        print(act(args, slurm, node, verdict, Memory(args.state_dir, name)))
    except SlurmError as error:
        print(f"{name}: unknown, nothing changed: {error}")
        return EXIT_UNKNOWN
    return EXIT_PROBLEM if verdict.state == "problem" else EXIT_OK
