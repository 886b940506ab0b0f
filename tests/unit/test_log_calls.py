"""Every logging call in the package passes as many arguments as its format string asks for.

A mismatch raises only when the record is formatted: in a handler, on a path a run seldom takes (a leave's
deadline, a heal's fallback), where it replaces the message with a traceback, and under pytest's log capture
it fails whichever test reads the captured messages."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "swarmtrain"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")


def _placeholders(fmt: str) -> int:
    """The arguments a %-format string consumes (``%%`` consumes none, ``*`` widths one each)."""
    count = 0
    for match in PLACEHOLDER.finditer(fmt):
        spec = match.group(0)
        if spec == "%%":
            continue
        count += 1 + spec.count("*")
    return count


def _calls() -> list[tuple[str, int, str, int]]:
    """(file, line, format, arguments given) of every ``log.<level>("literal", ...)`` call in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in {"log", "logger", "logging"} and node.args):
                continue
            fmt = node.args[0]
            if not (isinstance(fmt, ast.Constant) and isinstance(fmt.value, str)):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args):
                continue
            found.append((str(path.relative_to(PACKAGE.parent)), node.lineno, fmt.value, len(node.args) - 1))
    return found


def test_the_placeholder_count_reads_format_strings_as_logging_does() -> None:
    assert _placeholders("%s: round %d of %5.2f%%") == 3
    assert _placeholders("100%% done") == 0
    assert _placeholders("%*d") == 2
    assert _placeholders("no placeholders") == 0


def test_the_package_has_logging_calls_to_check() -> None:
    assert len(_calls()) > 50


def test_every_logging_call_passes_as_many_arguments_as_its_format_asks() -> None:
    # With no arguments logging prints the string as it is, so only calls with arguments are checked.
    wrong = [f"{where}:{line}: {fmt!r} asks for {_placeholders(fmt)} argument(s), given {given}"
             for where, line, fmt, given in _calls() if given and given != _placeholders(fmt)]
    assert not wrong, "\n".join(wrong)
