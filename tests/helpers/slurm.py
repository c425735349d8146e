"""A one-node Slurm cluster on loopback from Debian's packages (slurmctld, slurmd, munge), in a temporary folder:
what gpuwarden's health check talks to in the tests. Node gpu-1 has a slurmd; gpu-2..gpu-6 are defined only (they
can be drained, which is all the cap needs); gpu-4 carries the feature gpuwarden-no-drain."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.helpers.common import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")


def missing() -> list[str]:
    found = [name for name in DAEMONS if shutil.which(name) or Path(f"/usr/sbin/{name}").exists()]
    return [name for name in DAEMONS if name not in found]


def _version() -> tuple[int, int]:
    """slurmctld's version ("slurm-wlm 24.11.5" → (24, 11)); (0, 0) where it cannot say."""
    try:
        out = subprocess.run([_which("slurmctld"), "-V"], capture_output=True, text=True, timeout=10).stdout
        major, minor = out.split()[-1].split(".")[:2]
        return int(major), int(minor)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0, 0


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, health_check: Path | None = None, interval: int = 0) -> None:
        self.root = root
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.processes: list[subprocess.Popen] = []
        host = socket.gethostname()
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # Slurm 23.11+ (Debian 13 has 24.11) initialises a cgroup plugin in slurmd even for proctrack/linuxproc and
        # fails where /sys/fs/cgroup is not mounted (a chroot, some CI containers): nothing here needs cgroups
        if _version() >= (23, 11):
            (root / "cgroup.conf").write_text("CgroupPlugin=disabled\n")
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        check = f"HealthCheckProgram={health_check}\nHealthCheckInterval={interval}\nHealthCheckNodeState=ANY\n"
        (root / "slurm.conf").write_text(
            f"""ClusterName=gw
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
{check if health_check else ""}NodeName=gpu-1 NodeHostname={host} NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN
NodeName=gpu-[2-3],gpu-[5-6] NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN
NodeName=gpu-4 NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 Feature=gpuwarden-no-drain State=UNKNOWN
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self) -> SlurmCluster:
        root = self.root
        self._spawn([_which("munged"), "-F", "-f", f"--key-file={root}/munge.key", f"--socket={root}/munge.sock",
                     f"--log-file={root}/log/munge.log", f"--pid-file={root}/munge.pid",
                     f"--seed-file={root}/munge.seed"])  # fmt: skip
        self._wait(lambda: (root / "munge.sock").exists(), "munged")
        self._spawn([_which("slurmctld"), "-D", "-i"])
        self._wait(lambda: self.sinfo_ok(), "slurmctld")
        self._spawn([_which("slurmd"), "-D", "-N", "gpu-1"])
        return self

    def _spawn(self, command: list[str]) -> None:
        log = (self.root / "log" / f"{Path(command[0]).name}.out").open("a")
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=log,
                                               start_new_session=True))  # fmt: skip

    def _wait(self, ready, what: str, timeout: float = 30) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-800:] for p in sorted((self.root / "log").glob("*")))
                raise RuntimeError(f"{what} did not start:\n{logs}")
            time.sleep(0.2)

    def sinfo_ok(self) -> bool:
        done = subprocess.run(["sinfo", "-h"], env=self.env, capture_output=True, text=True)
        return done.returncode == 0

    def node(self, name: str) -> tuple[str, str]:
        """(state, reason) as sinfo shows them ("idle", "" / "drained", "gpuwarden: ...")."""
        return self.nodes()[name]

    def scontrol(self, *words: str) -> None:
        subprocess.run(["scontrol", *words], env=self.env, check=True, capture_output=True)

    def reset(self) -> None:
        """Every node back to undrained (UNDRAIN: gpu-2..4 have no slurmd, and RESUME of a node that never registered
        is refused by Slurm 24)."""
        for name, (state, _) in self.nodes().items():
            if "drain" in state:
                self.scontrol("update", f"NodeName={name}", "State=UNDRAIN")

    def nodes(self) -> dict[str, tuple[str, str]]:
        """Every node's (state, reason), in one sinfo call."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], env=self.env, capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        found = {}
        for line in out.splitlines():
            name, state, reason = line.split("|", 2)
            found[name] = (state.rstrip("*"), "" if reason == "none" else reason)
        return found

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
