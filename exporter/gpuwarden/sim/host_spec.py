"""A scenario's host process: what the simulated host's /proc shows of one process, for the job view.

A scenario's host process: what the simulated host's /proc shows of one process (sim/fake_host_proc.py writes
it), for the job view: the ranks' launcher variables, their launcher agent, their cgroup, their main thread's state.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HostProcessSpec(BaseModel):
    """One process of the simulated host (docs/simulator.md, Host processes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(ge=1, le=4_194_304)
    ppid: int = Field(1, ge=0, le=4_194_304, description="its parent (a launcher agent, a supervisor, a shell)")
    session: int = Field(1, ge=0, le=4_194_304)
    comm: str = Field("python", min_length=1, max_length=15, pattern=r"^[^\s()/]+$")
    cmdline: tuple[str, ...] = Field((), max_length=64, description="its arguments (default: its comm)")
    environ: dict[str, str] = Field(default_factory=dict, description="its environment at exec (launcher variables)")
    cgroup: str = Field("0::/user.slice/user-1000.slice/session-1.scope", max_length=4096)
    uid: int = Field(1000, ge=0, le=4_294_967_294)
    state: Literal["R", "S", "D"] = Field(
        "S", description="its main thread: R running (a CPU-bound loop, or a rank spinning in a collective), S, D"
    )
