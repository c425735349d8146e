"""What the fleet service holds of Prometheus' answers, bounded as a whole.

Each answer is capped on its own (max_answer_bytes, max_answer_series), but a view asks 8-14 queries and the page
five views at once: 35 answers of 10,000 series each took the service to 377 MiB, and 25,000 past its 384 MiB
(issue 48). The budget counts the estimated memory of every answer alive at once, from its first byte read to the
moment nothing refers to its series any more (a weakref finalizer on the answer's list): being read, being parsed,
held by views being computed, or cached. A query whose answer would pass the budget makes room by dropping cached
answers, and is refused (503) where that is not enough: the service answers "too much at once" instead of dying.

The estimates are measured (bench/fleet_hostile.py, docs/benchmarks.md): parsed series held 370-900 bytes each for
answers of 61-285 bytes a series (1-10 labels), 1.6x that while json.loads builds them beside the text.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable
from typing import Any

HELD_PER_SERIES = 320  # bytes of a parsed series beyond its labels' text (a Series, its dict, the value)
HELD_PER_BYTE = 2.5  # bytes held per byte of the answer's text (label strings as objects)
PARSE_FACTOR = 1.6  # peak while parsing: json.loads' intermediate objects beside the series kept
# An answer this small is never refused: the readiness probe's `vector(1)` must not fail because large answers fill
# the budget. At most max_concurrent_queries are read at once, so they pass the budget by SMALL_SLACK at most.
SMALL_ANSWER = 64 * 1024
SMALL_SLACK = 4 * 1024 * 1024


def held_estimate(series: int, text_bytes: int) -> int:
    """Memory a parsed answer holds: its series and their labels (an overestimate by 10-30 %)."""
    return int(HELD_PER_SERIES * series + HELD_PER_BYTE * text_bytes)


class OverBudget(Exception):
    """Holding this answer would take the service's answers past the budget."""


class Answer(list):  # type: ignore[type-arg]
    """A parsed answer's series: a list that can be watched for the moment the last reference goes."""

    __slots__ = ("__weakref__", "held")  # held: its estimate, what the query cache counts it as


class AnswerBudget:
    """Estimated bytes of Prometheus answers alive at once, at most `limit`; shared by every query (thread-safe:
    answers are parsed on worker threads, and a finalizer runs wherever the last reference goes)."""

    def __init__(self, limit: int, make_room: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.make_room = make_room or (lambda wanted: None)  # drops cached answers (PrometheusClient sets it)
        self._used = 0
        self._peak = 0
        self._refused = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def refused(self) -> int:
        return self._refused

    def take(self, nbytes: int, small: bool = False) -> None:
        """Reserve `nbytes`, dropping cached answers first if needed; OverBudget where that is not enough. `small`:
        for an answer of at most SMALL_ANSWER bytes, which may pass the limit by SMALL_SLACK."""
        slack = SMALL_SLACK if small else 0
        if self._try(nbytes, slack):
            return
        self.make_room(nbytes)
        if not self._try(nbytes, slack):
            with self._lock:
                self._refused += 1
            raise OverBudget(
                f"holding it would take the answers in memory past {self.limit // 2**20} MiB (max_answers_bytes; "
                f"{self._used // 2**20} MiB held now)"
            )

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def hold(self, answer: Answer, nbytes: int) -> None:
        """Keep `nbytes` reserved until nothing refers to `answer` any more (the reservation is already taken)."""
        weakref.finalize(answer, self.give, nbytes)

    def _try(self, nbytes: int, slack: int) -> bool:
        with self._lock:
            if self._used + nbytes > self.limit + slack and nbytes > 0:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            return True


class Reading:
    """An answer's text as it arrives, its bytes reserved piece by piece (a 8 MB answer at four queries in flight is
    32 MB before any is parsed)."""

    def __init__(self, budget: AnswerBudget) -> None:
        self.budget = budget
        self.text = bytearray()  # grows in place: no copy joining the pieces at the end
        self._reserved = 0

    def add(self, piece: bytes) -> None:
        if piece:
            self.budget.take(len(piece), small=len(self.text) + len(piece) <= SMALL_ANSWER)
            self._reserved += len(piece)
            self.text += piece

    def release(self) -> None:
        self.budget.give(self._reserved)
        self._reserved = 0
        self.text = bytearray()

    def __enter__(self) -> Reading:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class AnswerTooLarge(Exception):
    pass


class BoundedDecoder:
    """Content-Encoding undone (identity, gzip, deflate) in steps that never produce more than `limit` bytes in all:
    zlib's max_length bounds each step, and what it has not consumed waits in its unconsumed tail."""

    def __init__(self, encoding: str, limit: int) -> None:
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            self._inflate = None
        elif encoding in ("gzip", "x-gzip"):
            self._inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS)
        else:
            raise ValueError(f"content-encoding {encoding[:40]!r} was not asked for")
        self.limit, self.size = limit, 0

    def feed(self, data: bytes) -> bytes:
        if self._inflate is None:
            return self._count(data)
        out = []
        while data:
            piece = self._inflate.decompress(data, self.limit - self.size + 1)
            out.append(self._count(piece))
            data = self._inflate.unconsumed_tail
        return b"".join(out)

    def flush(self) -> bytes:
        return b"" if self._inflate is None else self._count(self._inflate.flush(self.limit - self.size + 1))

    def _count(self, piece: bytes) -> bytes:
        self.size += len(piece)
        if self.size > self.limit:
            raise AnswerTooLarge
        return piece
