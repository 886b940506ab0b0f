"""Every tracked text file speaks of the project alone, never of how or by whom it was made.

The scan looks for work periods, tickets, people's labels, assistants, first person and the machine a
figure was taken on; that history belongs in commit messages. Results data (benchmarks/results/*.json)
is scanned too, its strings only: they carry commands and labels.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # holds the patterns themselves


class Phrase(NamedTuple):
    kind: str
    needles: tuple[str, ...]  # every match contains one of these: files without any are not searched
    pattern: re.Pattern[str]


# Precise on purpose: a hit must be worth rewording. Words that are also the project's own ("an all-reduce
# session", "session_id", "helper function", "I/O", "issues a call") must not match.
PHRASES: tuple[Phrase, ...] = (
    # numbered work periods: "session 3", "(session 6)", "Session 5's", "sessions 3 and 4"
    Phrase("work period", ("ession",), re.compile(r"\b[Ss]essions? \d+\b")),
    # work periods by name
    Phrase("work period", ("eriod",), re.compile(r"\b[Ww]ork(?:ing)? periods?\b")),
    # tickets by number: "issue 4's targets", "Issue #2", "ticket 7", "PR 12"
    Phrase("ticket", ("ssue", "icket", "PR", "ull request"),
           re.compile(r"\b(?:[Ii]ssues?|[Tt]ickets?|PRs?|[Pp]ull requests?) #?\d+\b")),
    # a bare "#12" as a ticket reference (not "#018x" format specs, "#333;" colours or "# comment")
    Phrase("ticket", ("#",), re.compile(r"(?:^|(?<=[\s(\[,]))#\d{1,5}(?=[\s),.:\]]|$)", re.MULTILINE)),
    # tickets by name: "the contract", "the dashboard issue", "a later issue"
    Phrase("ticket", ("issue",),
           re.compile(r"\b[Tt]he issue's\b|\b(?:dashboard|later|earlier|next|previous|follow-up) issue\b")),
    # people by role or label: "engineer A2", "C2's averager", "(B1)", "the lead"
    Phrase("person", ("ngineer",), re.compile(r"\b[Ee]ngineers?\b")),
    Phrase("person", ("'s",), re.compile(r"\b[A-E][0-9]'s\b")),
    Phrase("person", ("(",), re.compile(r"\([A-E][0-9]\)")),
    Phrase("person", ("he lead",), re.compile(r"\b[Tt]he lead\b")),
    # helpers as people: "a helper's ad-hoc driver", "A helper swept", "helpers ran" (not "helper function")
    Phrase("person", ("elper",), re.compile(
        r"\b[Aa] helper's\b|\b[Hh]elpers? (?:ran|swept|wrote|measured|found|tried|looked|added|fixed|reported)\b")),
    # assistants and agents that write code
    Phrase("assistant", ("ssistant", "agent", "Claude", "ChatGPT", "Copilot"), re.compile(
        r"\b[Aa]ssistants?\b|\b(?:AI|LLM|coding) agents?\b|\b[Ss]ub-?agents?\b|\b(?:Claude|ChatGPT|Copilot)\b")),
    # first person: "I measured", "before I looked", "I'm" (not "I/O", "host I gets", a variable I)
    Phrase("first person", ("I",), re.compile(
        r"I(?<![\w/.+(-]I)(?:'m|'ve|'d|'ll| (?:\w+ed|am|was|have|had|did|do|think|thought|saw|see|ran|run|found"
        r"|made|wrote|kept|left|chose|took|believe|guess|can|could|will|would|should|might|must|need|want"
        r"|also|then|now|still))\b")),
    # first person possessive: "my run" (not "my-run", "my_results")
    Phrase("first person", ("my", "My"), re.compile(r"\b[Mm]y\b(?![-_.])")),
    # the machine a figure was taken on: "this box", "the quiet box", "quiet-box estimate", "dev box"
    Phrase("this machine", ("box",), re.compile(
        r"(?<!out of )\b(?:[Tt]his|[Tt]he|[Qq]uiet|[Dd]ev|[Dd]evelopment|[Ss]hared)[- ](?:[\w-]+ )?box\b")),
    # rehearsals of the CI run: "6 CI rehearsals"
    Phrase("rehearsal", ("ehearsal",), re.compile(r"\b[Rr]ehearsals?\b")),
)


def find_phrases(files: Iterable[tuple[str, str]]) -> list[str]:
    """`path:line: kind: 'matched'` for every hit in (path, text) pairs, in order."""
    hits = []
    for path, text in files:
        # whole-text searches, gated by a substring test, keep the scan of ~2 MB well under a second
        found = sorted((m.start(), p.kind, m.group(0)) for p in PHRASES if any(n in text for n in p.needles)
                       for m in p.pattern.finditer(text))
        hits.extend(f"{path}:{text.count(chr(10), 0, pos) + 1}: {kind}: {matched!r}" for pos, kind, matched in found)
    return hits


def _tracked_text_files() -> Iterator[tuple[str, str]]:
    """Tracked and new (not ignored) files of the checkout; binary files (NUL bytes, not UTF-8) skipped."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                 cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, no file list to scan: {e}")
    for rel in sorted(set(listing.decode().split("\0")) - {"", THIS_FILE}):
        path = ROOT / rel
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if rel.endswith(".json"):  # results data: words live in its strings; blank number-only lines, keep numbering
            text = "\n".join(line if '"' in line else "" for line in text.split("\n"))
        yield rel, text


def test_no_phrase_about_how_the_repository_was_made() -> None:
    hits = find_phrases(_tracked_text_files())
    if hits:
        pytest.fail("reword these to say what the project is or does:\n" + "\n".join(hits), pytrace=False)


def test_scan_covers_every_kind_of_text_file() -> None:
    scanned = {path for path, _ in _tracked_text_files()}
    for expected in ("README.md", "pyproject.toml", "deploy/docker-compose.yml", "docker/entrypoint.sh",
                     "proto/swarmtrain/wire/averaging.proto", "swarmtrain/compress/kernels/quant_cuda.cu",
                     "benchmarks/results/allreduce.json", "tests/unit/test_boundaries.py"):
        assert expected in scanned, expected
    assert not any(path.endswith(".png") for path in scanned)
    assert THIS_FILE not in scanned


@pytest.mark.parametrize("line", [
    "Measured in session 7 on the testbed.",
    "(Fixed in session 6: it used to leave a checkpoint.)",
    "Issue 4's targets: each codec arm's val loss.",
    "Asserts the issue's contract: the survivors keep committing rounds.",
    "served on 8080 (the dashboard issue);",
    "see #12 for the plan",
    "island.py      (engineer A2) several local ranks",
    "adapts C2's blocking averager and C1's async matchmaker",
    "A helper's test loops ran on the same cores.",
    "A helper swept inner and outer lr.",
    "the logs were gone before I looked",
    "I measured 0.59%.",
    "Measured on the 2-core AMD EPYC dev box.",
    "can run on this box",
    "a quiet-box estimate is 3620 s",
    "once in 6 CI rehearsals",
    "written with an AI assistant",
])
def test_flags_a_phrase_added_to_any_file(line: str) -> None:
    files = [("src/clean.py", "x = 1\n"), ("some/new/file.md", f"# Title\n\nText.\n{line}\n")]
    hits = find_phrases(files)
    assert hits and all(h.startswith("some/new/file.md:4: ") for h in hits), hits


@pytest.mark.parametrize("line", [
    "Open this peer's reducer session for `key` (an all-reduce session).",
    "s = self._sessions[key.session_id]",
    "no session for round 0 attempt 1",
    "Each child runs in its own session (process group).",
    "testing/ (test helpers; never imported by the library); a helper function",
    "DiLoCo, pure torch, no I/O or networking.",
    "host I gets 10.77.0.(10+I); for i in range(n): x[i] = I",
    "`expect_upload` / `offer_download` issue tickets; it issues a call",
    "a known issue with the kernel",
    "checksum mismatch (xxh3-64 {h:#018x}); color: #333;",
    "K1: SIGKILL p3; blocks stay in L1/L2; -O3",
    "windows wide enough for a loaded 2-core CI box; works out of the box",
    "the leader's group; mean of shard 2",
    "select = [\"E\", \"F\", \"W\", \"I\", \"B\"]",
    "--name my-run --out my_results.json",
])
def test_legitimate_lines_pass(line: str) -> None:
    assert find_phrases([("swarmtrain/module.py", line)]) == []
