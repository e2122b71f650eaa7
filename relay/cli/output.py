"""Tables and times for people (``--json`` prints the API's own JSON instead).

A table is kubectl's: a header in capitals, columns aligned with two spaces,
no borders; ``-`` for a value that is not there. Times are shown in the local
time zone, to the second; ``--json`` keeps the API's UTC ISO 8601 strings.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click

from relay.cli.errors import EXIT_USAGE, CliError
from relay.core.times import local_seconds, us_iso

MISSING = "-"
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# C0 and C1 control characters and DEL. A terminal acts on them: ESC and the 8-bit CSI (0x9b) start
# sequences that set its title, write its clipboard (OSC 52), move the cursor over earlier lines.
# And the bidirectional formatting characters (the marks U+200E, U+200F, U+061C, the embeddings and
# overrides U+202A-U+202E, the isolates U+2066-U+2069): a terminal that reorders text shows what
# follows one in another order than it has ("Trojan Source", CVE-2021-42574), so that a workflow
# name or an error can hide what is beside it. Text from executors (workflow names, errors, outputs)
# and from the API is shown with all of them escaped.
_BIDI = r"\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROLS = re.compile(rf"[\x00-\x1f\x7f-\x9f{_BIDI}]")
# The ones json.dumps writes as they are (it escapes those below 0x20); in JSON they can only be in strings.
_JSON_UNESCAPED = re.compile(rf"[\x7f-\x9f{_BIDI}]")


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with its control and bidirectional characters written as escapes (``\\x1b``,
    ``\\u202e``), so that none reaches the terminal."""
    return _CONTROLS.sub(lambda m: _escape(m.group()), text)


def shell_word(text: str) -> str:
    """``text`` as one word of a command to copy into a shell, which bash and zsh read back as
    ``text`` itself: as it is, or single-quoted (:func:`shlex.quote`); one with a control or a
    bidirectional character in ANSI-C quotes, each such character escaped (``$'cut\\u202e'``), so that
    none reaches the terminal either. (:func:`cell` escapes them too, but its ``\\u202e`` copied into
    a command is six other characters.)"""
    if not _CONTROLS.search(text):
        return shlex.quote(text)
    quoted = text.replace("\\", "\\\\").replace("'", "\\'")
    # \xHH for ASCII only: bash writes \x85 as the byte 0x85, \u0085 as the character.
    escaped = _CONTROLS.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if m.group() < "\x80" else f"\\u{ord(m.group()):04x}", quoted
    )
    return f"$'{escaped}'"


def shell_command(command: str, args: Sequence[str], options: Sequence[str] = ()) -> str:
    """``command`` with its positional ``args`` as shell words (:func:`shell_word`), then ``options``;
    ``--`` before the arguments, options first, if one starts with ``-`` (an app may be named ``-x``),
    which click would otherwise read as an option. As the console's ``shellCommand``."""
    words = [shell_word(a) for a in args]
    dashed = any(a.startswith("-") for a in args)
    return " ".join([command, *([*options, "--", *words] if dashed else [*words, *options])])


def json_text(data: Any) -> str:
    """``data`` as indented JSON, DEL, C1 and the bidirectional characters escaped too (``\\u009b``,
    ``\\u202e``): the same values, nothing raw for a terminal."""
    text = json.dumps(data, indent=2, ensure_ascii=False)
    return _JSON_UNESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def cell(value: Any) -> str:
    if value is None or value == "":
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return visible(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    # One line per row, whatever the value holds; no control character reaches the terminal.
    return visible(" ".join(str(value).split()))


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def show_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str) -> None:
    """The table on stdout, or ``empty`` on stderr when there are no rows (stdout stays empty)."""
    if rows:
        click.echo(table(headers, rows))
    else:
        click.echo(empty, err=True)


# One page of a listing the API pages (it takes at most 1,000 at a time).
limit_option = click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
offset_option = click.option("--offset", type=click.IntRange(0), default=0, show_default=True)
# A delete's ``--yes`` (it asks first, ask() below).
yes_option = click.option("--yes", is_flag=True, help="Do not ask first (needed when stdin is not a terminal).")


def ask(question: str, yes: bool, refusal: str) -> None:
    """Go on when ``yes`` (``--yes``) or when the person at the terminal says so. With no terminal to
    ask (a script, a pipe), refuse (exit 2) with ``refusal`` rather than act unasked."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise CliError(refusal, EXIT_USAGE)
    click.confirm(question, abort=True, err=True)


def page_hint(count: int, limit: int, offset: int, also: str = "") -> None:
    """Say so on stderr when a page came back full: there may be more (``also``: other options the
    next page needs, with their leading space)."""
    if count and count >= limit:
        click.echo(f"(showing {count} from offset {offset}; more with --offset {offset + count}{also})", err=True)


def parse_iso(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def when(value: str | None) -> str:
    """An API time (ISO 8601, UTC) as local time to the second."""
    parsed = parse_iso(value)
    if parsed is None:
        return value or MISSING
    return local_seconds(parsed)


def age(value: str | None, now: datetime | None = None) -> str:
    """How long ago: ``45s``, ``12m``, ``3h20m``, ``2d4h``."""
    parsed = parse_iso(value)
    if parsed is None:
        return MISSING
    secs = max(0, int(((now or datetime.now(UTC)) - parsed).total_seconds()))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m"
    if secs < 86400:
        return f"{secs // 3600}h{secs % 3600 // 60}m"
    return f"{secs // 86400}d{secs % 86400 // 3600}h"


def duration_ms(start: str | None, end: str | None) -> str:
    a, b = parse_iso(start), parse_iso(end)
    if a is None or b is None:
        return MISSING
    ms = (b - a).total_seconds() * 1000
    return f"{ms:.0f}ms" if ms < 10_000 else f"{ms / 1000:.1f}s"


def seconds(value: float) -> str:
    """A setting in seconds as it is: ``60s``, ``0.5s``, ``1209600s`` (``:g`` would show two weeks as
    ``1.2096e+06s``, and 1234567 s as ``1.23457e+06s``, which is not the setting)."""
    number = float(value)
    return f"{int(number)}s" if number.is_integer() else f"{number!r}s"


if TYPE_CHECKING:
    ParamType = click.ParamType[Any, Any]  # generic from click 8.3 on (pyproject allows 8.1)
    Choice = click.Choice[str]  # generic from click 8.2 on
else:
    ParamType = click.ParamType
    Choice = click.Choice


class Off:
    """An option given as ``off`` (a retention setting turned off: null in the API's body), told
    apart from one not given (None)."""

    def __repr__(self) -> str:
        return "off"


OFF = Off()


class DurationType(ParamType):
    """A duration option in seconds: ``90s``, ``15m``, ``2h``, ``7d``, or a number of seconds (``30``,
    ``0.5``); with ``off``, also ``off`` (:data:`OFF`). Whether it is in range is the API's to say
    (a 422), as it says for the same value in relay.yaml or a PATCH.

    ``smallest``: the API's unit, for an option sent in milliseconds. A positive duration below it
    would be sent rounded to 0, which the API refuses as not greater than 0, in words about a value
    the user did not give; refused here instead, naming the option and the smallest value. Not
    rounded up: these are retention settings, and a tenth of a millisecond taken for a millisecond
    would delete or cancel at once, where the value given was surely a slip (a unit left out)."""

    name = "duration"

    def __init__(self, off: bool = False, smallest: float = 0.0) -> None:
        self.off = off
        self.smallest = smallest

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if self.off and text == "off":
            return OFF
        match = _RELATIVE.match(text)
        try:
            secs = float(match.group(1)) * _UNITS[match.group(2)] if match else float(text)
        except ValueError:
            secs = math.nan
        if not math.isfinite(secs):  # nan and inf are numbers to float(), and no duration
            also = ", or off" if self.off else ""
            self.fail(f"{value!r} is not a duration (30s, 5m, 2h, 7d or seconds{also})", param, ctx)
        if 0 < secs < self.smallest:
            least = seconds(self.smallest)
            self.fail(f"{value!r} is less than {least}, the smallest it takes (it is sent in milliseconds)",
                      param, ctx)  # fmt: skip
        return secs


class ApiChoice(Choice):
    """One of the API's names (a kind, a state, a status), taken in any case and shown as the API
    spells it: in the error for a wrong one, the one for a missing one and shell completion. Since
    click 8.2, ``Choice(case_sensitive=False)`` shows the casefolded names there (``executordead``),
    names the API and README never use, and its missing-value error spans lines."""

    def __init__(self, choices: Sequence[str]) -> None:
        super().__init__(choices, case_sensitive=False)

    def get_invalid_choice_message(self, value: Any, ctx: click.Context | None) -> str:
        return f"{value!r} is not one of {', '.join(self.choices)}"

    def get_missing_message(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return f"Choose from {', '.join(self.choices)}"

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        start = incomplete.casefold()
        return [CompletionItem(c) for c in self.choices if c.casefold().startswith(start)]


class CountOrOff(ParamType):
    """A whole number, or ``off`` (:data:`OFF`). Its range is the API's to check (a 422)."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        if value.strip() == "off":
            return OFF
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number, or off", param, ctx)


def time_option(value: str | None, now: datetime | None = None) -> str | None:
    """An option's time as the API takes it (ISO 8601 UTC): ``2026-01-31T12:00:00Z``, ``2026-01-31``
    (a time without a zone is local), or an age: ``90s``, ``15m``, ``2h``, ``7d`` ago."""
    if value is None:
        return None
    match = _RELATIVE.match(value.strip())
    try:
        if match:
            ago = timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
            moment = (now or datetime.now(UTC)) - ago
        else:
            try:
                moment = datetime.fromisoformat(value.strip())
            except ValueError as exc:
                raise CliError(
                    f"not a time: {value!r} (ISO 8601 like 2026-01-31T12:00:00Z, or an age like 15m, 2h, 7d)",
                    EXIT_USAGE,
                ) from exc
            if moment.tzinfo is None:
                moment = moment.astimezone()  # a time written without a zone is the local time
        return us_iso(moment.astimezone(UTC))
    except (OverflowError, ValueError) as exc:  # 1000000d ago; 0001-01-01 local, east of UTC: before year 1
        raise CliError(f"not a time: {value!r} is out of range (years 1 to 9999)", EXIT_USAGE) from exc
