"""The README and docs/ pages, checked as text: no TensorFlow and no built tfclip needed.

The README is the front door (at most 200 lines) whose two copy-paste commands CI runs; every
other topic is a page of docs/ linked from it. These tests keep the links, the pictures and the
tests the pages name pointing at things that exist."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
TESTS = os.path.join(ROOT, "tests")
CI_RUN = os.path.join(ROOT, ".ci", "run")

MAX_README_LINES = 200
MARKERS = {"demo": "demo-command", "test": "test-command"}
DATE = re.compile(r"20\d\d-\d\d-\d\d")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _doc_pages():
    return sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def _pages():
    """README.md and every docs/*.md page."""
    return [README] + _doc_pages()


def _rel(path):
    return os.path.relpath(path, ROOT)


def _without_fences(text):
    """The text with fenced code blocks blanked (line numbers kept): code is not Markdown."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return out


# ---------------------------------------------------------------- the front door


def test_readme_is_at_most_200_lines():
    n = len(_read(README).splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; the front door keeps to {MAX_README_LINES}"


def _marked_block(text, marker):
    """The lines between <!-- marker --> and <!-- /marker -->, each pair required exactly once."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == start]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    assert len(starts) == 1 and len(ends) == 1, (
        f"README.md must hold {start} and {end} once each, on lines of their own "
        f"(found {len(starts)} and {len(ends)})")
    assert text.count(start) == 1 and text.count(end) == 1, f"{marker}'s markers appear more than once"
    assert starts[0] < ends[0], f"{end} comes before {start}"
    return lines[starts[0] + 1:ends[0]]


@pytest.mark.parametrize("which", sorted(MARKERS))
def test_marked_command_is_one_line_in_a_bash_block(which):
    block = _marked_block(_read(README), MARKERS[which])
    assert len(block) == 3 and block[0] == "```bash" and block[2] == "```", (
        f"between the {MARKERS[which]} markers: a ```bash fence, one command line, a closing fence; got {block}")
    cmd = block[1]
    assert cmd.strip() and not cmd.startswith(("```", "<!--")), cmd
    if which == "demo":
        assert re.search(r"\bpip install \"?\.", cmd), f"the demo command must install the package: {cmd}"
        assert re.search(r"(^|&&|;)\s*tfclip-demo\b", cmd), f"the demo command must run tfclip-demo: {cmd}"
    else:
        assert re.search(r"\bpip install \"\.\[test[^\]]*\]\"", cmd), (
            f'the test command must install ".[test...]": {cmd}')
        assert re.search(r"(^|&&|;)\s*(python3? -m )?pytest\b", cmd), f"the test command must run pytest: {cmd}"


def _ci_extraction(text):
    """What .ci/run's `sed -n '/<!-- test-command -->/,/<!-- \\/test-command -->/p' README.md |
    grep -v '^<!--' | grep -v '^```'` keeps: sed's range (from a line containing the start
    marker through the next line containing the end marker, again for each later start), minus
    the lines starting with a comment or a fence."""
    kept, inside = [], False
    for line in text.splitlines():
        if not inside:
            if "<!-- test-command -->" in line:
                inside = True
                kept.append(line)
        else:
            kept.append(line)
            if "<!-- /test-command -->" in line:
                inside = False
    return [line for line in kept if not line.startswith("<!--") and not line.startswith("```")]


def test_ci_extracts_exactly_the_test_command():
    text = _read(README)
    block = _marked_block(text, MARKERS["test"])
    extracted = _ci_extraction(text)
    assert extracted == [block[1]], f"CI's extraction would give {extracted}, not the one command line"


def test_ci_run_pipeline_itself_extracts_one_command():
    """The pipeline as .ci/run writes it, run by the shell on this README."""
    ci = _read(CI_RUN)
    found = re.search(r'^cmd="\$\((.*README\.md.*)\)"\s*$', ci, re.M)
    assert found, ".ci/run no longer extracts the test command with cmd=\"$(... README.md ...)\"; update this test"
    if not (shutil.which("bash") and shutil.which("sed") and shutil.which("grep")):
        pytest.skip("no bash/sed/grep here")
    out = subprocess.run(["bash", "-c", found.group(1)], cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    block = _marked_block(_read(README), MARKERS["test"])
    assert lines == [block[1]], f".ci/run's pipeline gives {lines!r} (stderr: {out.stderr.strip()!r})"


# ---------------------------------------------------------------- links and pictures

LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path):
    """(line number, target) of every Markdown link and image outside code blocks."""
    for n, line in enumerate(_without_fences(_read(path)), 1):
        for target in LINK.findall(line):
            yield n, target


def _is_external(target):
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) is not None or target.startswith("//")


def test_relative_links_point_at_files_that_exist():
    bad, count = [], 0
    for page in _pages():
        for n, target in _links(page):
            if _is_external(target) or target.startswith("#"):
                continue
            count += 1
            path = target.split("#", 1)[0].split("?", 1)[0]
            full = os.path.normpath(os.path.join(os.path.dirname(page), path))
            if not os.path.exists(full):
                bad.append(f"{_rel(page)}:{n}: {target}")
    assert count > 0
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    linked = set()
    for _, target in _links(README):
        if not _is_external(target):
            linked.add(os.path.normpath(os.path.join(ROOT, target.split("#", 1)[0])))
    missing = [_rel(p) for p in _doc_pages() if os.path.normpath(p) not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# ---------------------------------------------------------------- tests the pages name

NAMED_TEST = re.compile(r"(?<![\w/])(?:tests/)?((?:gpu/)?test_\w+\.py)?::(test_\w+)")
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/.-]*?\.py\b")
TEST_FILE = re.compile(r"(?<![\w/.])(test_\w+\.py)\b")


def _test_file(name):
    """tests/<name>, or tests/gpu/<name> for a bare name that lives there; None if neither."""
    for candidate in (os.path.join(TESTS, name), os.path.join(TESTS, "gpu", name)):
        if os.path.isfile(candidate):
            return candidate
    return None


def test_named_tests_exist():
    """`tests/x.py::test_y`, `test_x.py::test_y`, and `::test_y` after a file named earlier on
    the same line: each is a `def test_y(` in that file."""
    bad, count = [], 0
    for page in _pages():
        for n, line in enumerate(_read(page).splitlines(), 1):
            current = None
            for file_, name in NAMED_TEST.findall(line):
                current = file_ or current
                where = f"{_rel(page)}:{n}"
                if not current:
                    bad.append(f"{where}: ::{name} names no file before it on its line")
                    continue
                path = _test_file(current)
                count += 1
                if path is None:
                    bad.append(f"{where}: {current} (for ::{name}) is not in tests/")
                elif not re.search(rf"^\s*(async\s+)?def {name}\(", _read(path), re.M):
                    bad.append(f"{where}: {_rel(path)}::{name} does not exist")
    assert count > 0
    assert not bad, "named tests that do not exist:\n" + "\n".join(bad)


def test_named_test_files_exist():
    bad = []
    for page in _pages():
        for n, line in enumerate(_read(page).splitlines(), 1):
            for path in TEST_PATH.findall(line):
                if not os.path.exists(os.path.join(ROOT, path)):
                    bad.append(f"{_rel(page)}:{n}: {path}")
            for name in TEST_FILE.findall(line):
                if _test_file(name) is None:
                    bad.append(f"{_rel(page)}:{n}: {name}")
    assert not bad, "test files that do not exist:\n" + "\n".join(bad)


def test_guarantees_page_keeps_the_promises_heading():
    """tests/test_reliability.py reads the promise table under this heading."""
    text = _read(os.path.join(DOCS, "guarantees.md"))
    assert "\n## What tfclip promises\n" in text
    table = text.split("## What tfclip promises", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"::test_\w+", table)) >= 20


# ---------------------------------------------------------------- speed figures carry a date

FLOOR_FIGURE = re.compile(
    r"\d+(?:\.\d+)?x,? (?:(?:its|their|the) )?(?:own )?(?:\d+ B(?:/param)? )?floors?\b")
FLOOR_COLUMN = re.compile(r"^\|.*\bx floor\b.*\|\s*$")


def _sections(text):
    """(heading, body lines) from heading to heading, fenced code included."""
    sections, heading, body, fenced = [], "(top)", [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"^#{1,6} ", line):
            sections.append((heading, body))
            heading, body = line, []
        else:
            body.append(line)
    sections.append((heading, body))
    return sections


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_floor_figures_have_a_date_in_their_section(page):
    bad = []
    for heading, body in _sections(_read(os.path.join(ROOT, page))):
        text = "\n".join(body)
        figures = FLOOR_FIGURE.findall(text) + [line for line in body if FLOOR_COLUMN.match(line)]
        if figures and not DATE.search(heading + "\n" + text):
            bad.append(f"{heading!r}: {figures[:3]}")
    assert not bad, f"{page}: sections with 'x floor' figures but no date (YYYY-MM-DD):\n" + "\n".join(bad)
