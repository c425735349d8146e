"""Log lines as logfmt (default) or JSON, one line per event, on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace('"', '\\"')
        line = f'ts={_timestamp(record)} level={record.levelname.lower()} logger={record.name} msg="{message}"'
        if record.exc_info:
            line += ' exc="' + self.formatException(record.exc_info).replace("\n", "\\n").replace('"', "'") + '"'
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])


def set_level(level: str) -> None:
    logging.getLogger().setLevel(_LEVELS[level])
