"""What every command line shares: exit codes, the configuration error, one-line argument errors, own variables.

What every command line shares (the exporter's, `gpuwarden fleet`'s and the remediation commands'): exit codes,
the configuration error, a parser whose errors are one line, reading one command's own environment variables.
The lowest layer: the standard library only, so that each command, config/ included, can build on it."""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Mapping
from typing import NoReturn

EXIT_CONFIG = 2  # bad flag, environment, config or web-config file: one line naming the field and the fix
EXIT_FATAL = 3  # NVML unusable for good (driver upgraded under the process; no library with on_missing: exit)
EXIT_LISTEN = 4  # the listen address cannot be bound (in use, not this host's, no permission)

# Each command owns the variables under its prefix; a longer prefix belongs to another command.
EXPORTER_ENV_PREFIX = "GPUWARDEN_"
FLEET_ENV_PREFIX = "GPUWARDEN_FLEET_"
_ENV_PREFIXES = (EXPORTER_ENV_PREFIX, FLEET_ENV_PREFIX)


class ConfigError(ValueError):
    """A configuration problem, as one line that names the field and the fix."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line raised as ConfigError (not usage text and exit code 2 from inside)."""

    def __init__(self, *args: object, hint: str = "", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hint = hint

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}{self.hint}")


def own_environment(environ: Mapping[str, str], prefix: str) -> dict[str, str]:
    """The variables under `prefix` that belong to this command (not to one with a longer prefix)."""
    longer = [other for other in _ENV_PREFIXES if other != prefix and other.startswith(prefix)]
    return {
        var: raw
        for var, raw in environ.items()
        if var.startswith(prefix) and not any(var.startswith(other) for other in longer)
    }


# What Kubernetes injects into every pod of a namespace for each Service (enableServiceLinks, on by default): a
# Service named gpuwarden gives GPUWARDEN_SERVICE_HOST, GPUWARDEN_PORT=tcp://10.0.0.1:10045, GPUWARDEN_PORT_10045_TCP…
SERVICE_LINK = re.compile(
    r"^[A-Z0-9_]+?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)
_log = logging.getLogger(__name__)


def check_known(variables: Mapping[str, str], known: set[str] | Mapping[str, object], what: str) -> list[str]:
    """ConfigError naming the first unknown variable and every known one. Unknown names of Kubernetes' service-link
    form are not ours: they are returned, to be ignored and logged once logging is set up (`log_service_links`);
    a hand-written DaemonSet in a namespace with a Service named gpuwarden would otherwise crash-loop on them."""
    ignored = []
    for var in variables:
        if var in known:
            continue
        if SERVICE_LINK.match(var):
            ignored.append(var)
            continue
        raise ConfigError(f"environment: {var} is not a {what} setting; known: {', '.join(sorted(known))}")
    return ignored


def log_service_links(environ: Mapping[str, str], prefix: str, known: set[str] | Mapping[str, object]) -> None:
    """The one log line for the service-link variables check_known let through."""
    ignored = sorted(var for var in own_environment(environ, prefix) if var not in known and SERVICE_LINK.match(var))
    if ignored:
        logging.getLogger("gpuwarden.config").info(
            "ignoring %d Kubernetes service-link variable(s) (%s); set enableServiceLinks: false in the pod spec "
            "to drop them",
            len(ignored),
            ", ".join(ignored),
        )
