"""A launcher's agent (torchrun, DeepSpeed) from its command line, and each of its workers' ranks.

A launcher's agent from its command line, which any user may read (/proc/PID/cmdline): torchrun (or
`python -m torch.distributed.run` / `.launch`) and DeepSpeed's per-node launcher (`deepspeed.launcher.launch`). Their
workers are the agent's children, started in local-rank order, so a worker's rank is the first rank of the agent's
node (its node rank times its workers per node) plus the worker's place among the agent's children. The agent's
environment stays unread (another user's); only options written on the command line count, never their defaults:
torchrun also takes every option from a PET_ variable (as Kubeflow's operator sets them), which the command line
does not show.

- torchrun: the rendezvous is `--rdzv-endpoint`, else (the static backend, torchrun's default)
  `--master-addr:--master-port`; the job is that endpoint with `--rdzv-id`; the node rank is `--node-rank`, used by
  torchrun under the static backend only (other backends rank the nodes as they join; with `--nnodes 1` it is 0);
  `--nnodes` (a number, not a range) and `--nproc-per-node` (a number) give the world size. `--standalone` is one
  node: node rank 0.
- DeepSpeed: `--master_addr:--master_port`, `--node_rank`, `--world_info` (base64 JSON of each node's GPUs: the
  workers per node and the world size).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.jobs.launchers import Where, rendezvous_key

TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
DEEPSPEED_MODULE = "deepspeed.launcher.launch"
# torchrun's and DeepSpeed's options that take no value (torch/distributed/run.py, deepspeed/launcher/launch.py);
# any other option takes one
_FLAGS = frozenset(
    {
        "--standalone",
        "-m",
        "--module",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "--use-env",
        "--use_env",
        "--no_local_rank",
        "--save_pid",
        "--enable_each_rank_log",
        "--bind_cores_to_rank",
        "--enable_elastic_training",
    }
)
_MAX_WORLD_INFO = 64 * 1024


@dataclass(frozen=True)
class Agent:
    """What an agent's command line says of the job its workers form: the rendezvous (address and port, "" where
    the command line does not show it), the run id, the node rank and the workers per node and nodes where written."""

    kind: str  # torchrun | deepspeed
    pid: int
    address: str = ""
    port: str = ""
    run_id: str = ""
    first_rank: int | None = None  # the global rank of this node's local rank 0
    world_size: int | None = None
    standalone: bool = False

    def key(self, where: Where) -> str:
        """The job key its workers share: the rendezvous and run id (the same on every node), kept to this node
        where the rendezvous is loopback or standalone; "" where the command line names no rendezvous."""
        if self.standalone:
            return self.local_key(where)
        if not (self.address and self.port):
            return ""
        key = rendezvous_key(self.address, self.port, where)
        return key if self.run_id in ("", "none") else f"{key}/{self.run_id}"

    def local_key(self, where: Where) -> str:
        """Its workers as a job of this node only (standalone, or a rendezvous the command line does not show)."""
        return "/".join(part for part in ("local", where.scope, f"{self.kind}-{self.pid}") if part)

    def rank(self, local_rank: int | None) -> int | None:
        return None if local_rank is None or self.first_rank is None else self.first_rank + local_rank


def _options(arguments: list[str]) -> dict[str, str]:
    """The agent's options up to the training script: `--name value`, `--name=value`, flags as "1"."""
    found: dict[str, str] = {}
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        if not argument.startswith("-"):
            break  # the training script: what follows are its own arguments
        name, sep, value = argument.partition("=")
        if sep:
            found[name.replace("_", "-")] = value
        elif name in _FLAGS:
            found[name.replace("_", "-")] = "1"
        else:
            index += 1
            found[name.replace("_", "-")] = arguments[index] if index < len(arguments) else ""
        index += 1
    return found


def _entry(argv: list[str]) -> tuple[str, int] | None:
    """(kind, index of the agent's first option) where the command line runs a known agent."""
    for index, argument in enumerate(argv[:6]):  # python [-u] [-X ...] -m module | /path/torchrun
        if Path(argument).name == "torchrun":
            return "torchrun", index + 1
        if argument == "-m" and index + 1 < len(argv):
            module = argv[index + 1]
            if module in TORCHRUN_MODULES:
                return "torchrun", index + 2
            if module == DEEPSPEED_MODULE:
                return "deepspeed", index + 2
    return None


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and len(text) <= 7 else None


def _split_endpoint(endpoint: str, default_port: str) -> tuple[str, str]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:  # no port, or a bare IPv6 literal
        return endpoint, default_port
    return host, port


def parse_agent(argv: list[str], pid: int) -> Agent | None:
    """The agent a command line runs, or None."""
    entry = _entry(argv)
    if entry is None:
        return None
    kind, start = entry
    options = _options(argv[start:])
    return _deepspeed(options, pid) if kind == "deepspeed" else _torchrun(options, pid)


def _product(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a * b


def _torchrun(options: dict[str, str], pid: int) -> Agent:
    per_node = _number(options.get("--nproc-per-node"))
    if "--standalone" in options:
        return Agent("torchrun", pid, first_rank=0, world_size=per_node, standalone=True)
    backend = options.get("--rdzv-backend", "static")
    endpoint = options.get("--rdzv-endpoint", "")
    if endpoint:
        address, port = _split_endpoint(endpoint, "29400")
    elif backend == "static" and "--master-addr" in options:
        address, port = options["--master-addr"], options.get("--master-port", "29500")
    else:
        address = port = ""
    nodes = _number(options.get("--nnodes"))
    # the static backend ranks the nodes by --node-rank; the others as they join, except where there is one node
    node_rank = 0 if nodes == 1 else _number(options.get("--node-rank")) if backend == "static" else None
    return Agent(
        "torchrun",
        pid,
        address,
        port if port.isdigit() else "",
        options.get("--rdzv-id", ""),
        _product(node_rank, per_node),
        _product(nodes, per_node),
    )


def _deepspeed(options: dict[str, str], pid: int) -> Agent:
    hosts = _world_info(options.get("--world-info", ""))
    node_rank = _number(options.get("--node-rank"))
    first_rank = None
    if hosts is not None and node_rank is not None and node_rank < len(hosts):
        first_rank = sum(len(gpus) for gpus in hosts[:node_rank])  # nodes may have different GPU counts
    port = options.get("--master-port", "")
    return Agent(
        "deepspeed",
        pid,
        options.get("--master-addr", ""),
        port if port.isdigit() else "",
        first_rank=first_rank,
        world_size=None if hosts is None else sum(len(gpus) for gpus in hosts),
    )


def _world_info(encoded: str) -> list[list[object]] | None:
    """DeepSpeed's --world_info: base64 JSON {host: [GPU ids]}, in node-rank order."""
    if not encoded or len(encoded) > _MAX_WORLD_INFO:
        return None
    try:
        decoded = json.loads(base64.urlsafe_b64decode(encoded))
    except (binascii.Error, ValueError):
        return None
    if not isinstance(decoded, dict) or not all(isinstance(v, list) for v in decoded.values()):
        return None
    return list(decoded.values())
