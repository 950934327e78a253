"""The README stays a landing page, and every link in it and in docs/ leads somewhere.

README.md is at most 265 lines and links every page of docs/; each relative link (a file, a
folder, an image, a file#heading) in README.md and docs/*.md must resolve in the checkout. The
README's two commands, the demo run and the test run, are the ones users copy: they stay
word for word.
"""

import glob
import os
import re
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
from benchmark_report import ABS_PATH  # noqa: E402

README_MAX_LINES = 265  # with the DDP program it shows (docs/snippets.md)
DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && "
    ".venv/bin/python tools/make_demo_data.py && "
    ".venv/bin/torchrun --nproc_per_node=2 distributed.py"
)
TEST_COMMAND = "bash dev/test.sh"

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def docs():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def prose(text):
    """The text without code blocks and code spans, where link-like text is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def link_targets(text):
    text = prose(text)
    return [
        m.group(1) for pattern in (INLINE, REFERENCE, HTML_ATTR) for m in pattern.finditer(text)
    ]


def anchors(path):
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped,
    spaces to hyphens, -1, -2, ... for repeats."""
    seen, found = {}, set()
    with open(path) as f:
        for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(f.read()), re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(path, root=ROOT):
    """The relative links of the Markdown file `path` that lead nowhere, with the reason."""
    with open(path) as f:
        text = f.read()
    broken = []
    for target in link_targets(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto:: not checked here (no network in the tests)
        file_part, _, anchor = target.partition("#")
        dest = (
            os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        )
        if target.startswith("/"):
            broken.append((target, "absolute path: links must be relative to the file"))
        elif not os.path.exists(dest):
            broken.append((target, f"no such file: {os.path.relpath(dest, root)}"))
        elif not os.path.realpath(dest).startswith(os.path.realpath(root) + os.sep):
            broken.append((target, "outside the repository"))
        elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
            broken.append((target, f"no heading #{anchor} in {os.path.relpath(dest, root)}"))
    return broken


@pytest.mark.parametrize("path", docs(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# Here\n\n## A section, with words\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n[ok](here.md) [ok too](here.md#a-section-with-words) ![img](../gone.png)\n"
        "[missing](nothere.md) [bad anchor](here.md#nowhere) [web](https://example.org/x)\n"
        "`[in code](not-a-link.md)`\n\n```\n[in a block](not-a-link-either.md)\n```\n"
        '[ref]: ./missing-ref.md\n<img src="pic.png">\n'
    )
    found = dict(broken_links(str(page), root=str(tmp_path)))
    assert set(found) == {
        "../gone.png",
        "nothere.md",
        "here.md#nowhere",
        "./missing-ref.md",
        "pic.png",
    }, found


def test_readme_is_a_landing_page_that_links_every_doc():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: move the details into docs/"
    linked = {os.path.normpath(t.partition("#")[0]) for t in link_targets(text)}
    pages = {os.path.relpath(p, ROOT) for p in docs()[1:]}
    assert pages and pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


def test_readme_keeps_the_two_commands_users_copy():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [line.strip() for line in f]
    assert DEMO_COMMAND in lines and TEST_COMMAND in lines


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "results", "*.md"))), ids=os.path.basename
)
def test_committed_reports_show_commands_without_this_machines_paths(path):
    with open(path) as f:
        found = ABS_PATH.findall(f.read())
    assert found == [], (
        f"{os.path.relpath(path, ROOT)}: write these relative to the checkout: {found}"
    )
