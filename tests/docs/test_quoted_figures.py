"""The figures the docs quote agree with their source, so a re-measured figure cannot leave an old
copy behind.

* README.md: every paragraph that quotes a measured figure (a duration, a size, a date, a reward
  with decimals, a speed-up, "7 of 12") links the section of benchmarks/README.md it comes from,
  and each of its figures is written in that section too. A figure with no source paragraph (a
  comment in a command block) is refused: quote it in prose, with its link.
* benchmarks/README.md's headline table: each row's figures are written in the section it links.
* Every link into benchmarks/README.md (from README.md, docs/ and the page itself) names a heading
  that exists.
* The build time and size the Makefile states for a venv target (`make gym-venv`, ...) are the
  ones every docs paragraph naming that target states.

Each check is also run on a copy with one planted disagreement, which it must report.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = "benchmarks/README.md"

# What counts as a measured figure. Plain integers and one-decimal settings (temperature 0.7)
# are left out: they are configuration, not measurements.
FIGURE = re.compile(
    r"""(?x)
    <?\ ?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:-\d+(?:\.\d+)?)?
        \ (?:minutes?|min|seconds?|s|ms|hours?|GB|MB|GiB|MiB)\b
        (?:\ \d+\ (?:seconds?|s)\b)?                # 3 min 39 s, 3-11 minutes, 1.2 GB, < 2 min
    | \b\d{4}-\d{2}-\d{2}\b                          # the date of a run
    | \b\d(?:\.\d+)?(?:,\ \d(?:\.\d+)?){3,}\b       # a series: 0.5, 1, 0.5, 0.5
    | [+-]?\b\d+\.\d{2,}\b | [+-]\d+\.\d+\b          # 0.309, +0.195
    | \b\d+(?:\.\d+)?x\b                             # 1.7x
    | \b\d+(?:\.\d+)?\ ?%                            # 15%
    | \b\d+\ of\ \d+\b                               # 7 of 12
    """
)
SIZE_OR_DURATION = re.compile(
    r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? (?:min|s|GB|MB)\b(?: \d+ s\b)?"
)  # on normalised text
LINK = re.compile(r"\]\(((?:\.\./)*)benchmarks/README\.md(?:#([^)]*))?\)")
SAME_PAGE_LINK = re.compile(r"\]\(#([^)]*)\)")
HEADLINES = "headline-figures"


def normalise(text: str) -> str:
    """One spelling per unit and single spaces, so "3 minutes 39\\nseconds" is "3 min 39 s"."""
    text = " ".join(text.replace("**", "").split())
    text = re.sub(r"\b(\d+(?:\.\d+)?) minutes?\b", r"\1 min", text)
    return re.sub(r"\b(\d+(?:\.\d+)?) seconds?\b", r"\1 s", text)


def blocks(text: str) -> Iterator[str]:
    """The page's paragraphs, list items, tables and code blocks: the text between blank lines,
    each item of a list apart."""
    for block in re.split(r"\n[ \t]*\n", text):
        yield from (item for item in re.split(r"\n(?=[-*] )", block) if item.strip())


def commands_with_their_paragraph(text: str) -> Iterator[str]:
    """Blocks, each code block joined to the paragraph after it, which is where a page says what
    the command costs ("    make gym-venv" then "(... about 3-11 minutes and 1.5 GB)")."""
    pending = ""
    for block in blocks(text):
        if all(line.startswith(("    ", "```")) for line in block.strip("\n").splitlines()):
            pending += block + "\n"
            continue
        yield pending + block
        pending = ""
    if pending:
        yield pending


def figures(block: str) -> list[str]:
    return [normalise(match.group()).lstrip("< ") for match in FIGURE.finditer(normalise(block))]


def holds(text: str, figure: str) -> bool:
    """Whether normalised `text` writes `figure` as a whole figure (0.5 is not in 0.508)."""
    return re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w]|\.\d)", text) is not None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    heading = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def sections(markdown: str) -> dict[str, str]:
    """Each heading's anchor and its section: up to the next heading of its level or above."""
    lines = markdown.splitlines()
    found: dict[str, str] = {}
    headings = [
        (index, len(match.group(1)), match.group(2))
        for index, line in enumerate(lines)
        if (match := re.match(r"(#+) (.*)", line))
    ]
    for position, (start, level, title) in enumerate(headings):
        end = next((i for i, lv, _ in headings[position + 1 :] if lv <= level), len(lines))
        anchor, n = slug(title), 1
        while anchor in found:  # GitHub numbers repeated headings
            anchor, n = f"{slug(title)}-{n}", n + 1
        found[anchor] = "\n".join(lines[start:end])
    return found


def readme_figure_problems(root: Path) -> list[str]:
    """README.md's figures against the benchmarks/README.md sections its paragraphs link."""
    source = sections((root / BENCHMARKS).read_text())
    problems = []
    for block in blocks((root / "README.md").read_text()):
        quoted = figures(block)
        if not quoted:
            continue
        start = normalise(block)[:70]
        anchors = [anchor for _, anchor in LINK.findall(block) if anchor]
        if not anchors:
            problems.append(f"README.md quotes {quoted} without linking its source: {start!r}")
            continue
        missing_anchors = [anchor for anchor in anchors if anchor not in source]
        if missing_anchors:
            continue  # reported by link_problems
        text = normalise("\n".join(source[anchor] for anchor in anchors))
        for figure in quoted:
            if not holds(text, figure):
                problems.append(
                    f"README.md quotes {figure!r}, which {BENCHMARKS}#{anchors} does not say: "
                    f"{start!r}"
                )
    return problems


def headline_problems(root: Path) -> list[str]:
    """Rows of benchmarks/README.md's headline table against the sections they link."""
    source = sections((root / BENCHMARKS).read_text())
    rows = [line for line in source[HEADLINES].splitlines() if SAME_PAGE_LINK.search(line)]
    problems = [] if rows else [f"{BENCHMARKS} has no headline table under #{HEADLINES}"]
    for row in rows:
        anchors = [anchor for anchor in SAME_PAGE_LINK.findall(row) if anchor in source]
        text = normalise("\n".join(source[anchor] for anchor in anchors))
        problems += [
            f"{BENCHMARKS}'s headline {figure!r} is not in #{anchors}: {row[:70]!r}"
            for figure in figures(row)
            if not holds(text, figure)
        ]
    return problems


def link_problems(root: Path) -> list[str]:
    """Links into benchmarks/README.md (from README.md, docs/ and itself) that name no heading."""
    page = (root / BENCHMARKS).read_text()
    anchors = sections(page)
    problems = [
        f"{BENCHMARKS} links #{anchor}: no heading"
        for anchor in SAME_PAGE_LINK.findall(page)
        if anchor not in anchors
    ]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for _, anchor in LINK.findall(doc.read_text()):
            if anchor and anchor not in anchors:
                problems.append(f"{doc.relative_to(root)} links {BENCHMARKS}#{anchor}: no heading")
    return problems


def makefile_figures(makefile: str) -> dict[str, list[str]]:
    """Per target, the durations and sizes of the comment block that introduces it (the lines
    above its rule, back to the previous blank line)."""
    lines = makefile.splitlines()
    found = {}
    for index, line in enumerate(lines):
        rule = re.match(r"([\w-]+):(?!=)", line)
        if not rule:
            continue
        start = index
        while start > 0 and lines[start - 1].strip():
            start -= 1
        comment = " ".join(ln.lstrip("# ") for ln in lines[start:index] if ln.startswith("#"))
        quoted = SIZE_OR_DURATION.findall(normalise(comment))
        if quoted:
            found[rule.group(1)] = quoted
    return found


def makefile_problems(root: Path) -> list[str]:
    """Docs paragraphs naming `make <target>` with a duration or size state the Makefile's."""
    stated = makefile_figures((root / "Makefile").read_text())
    problems = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in commands_with_their_paragraph(page.read_text()):
            text = normalise(block)
            if not SIZE_OR_DURATION.search(text):
                continue
            for target, quoted in stated.items():
                if not re.search(rf"make {re.escape(target)}(?![\w-])", text):
                    continue
                missing = [figure for figure in quoted if not holds(text, figure)]
                if missing:
                    problems.append(
                        f"{page.relative_to(root)}: a paragraph on `make {target}` does not say "
                        f"{missing}, which the Makefile says: {text[:70]!r}"
                    )
    return problems


def test_the_readme_quotes_its_figures_as_their_sources_write_them():
    assert readme_figure_problems(ROOT) == []


def test_the_benchmarks_headline_table_quotes_its_sections():
    assert headline_problems(ROOT) == []


def test_every_link_into_the_benchmarks_page_names_a_heading():
    assert link_problems(ROOT) == []


def test_the_docs_state_the_makefile_s_venv_build_times_and_sizes():
    stated = makefile_figures((ROOT / "Makefile").read_text())
    assert {"gym-venv", "sglang-venv", "megatron-venv"} <= set(stated)
    assert makefile_problems(ROOT) == []


def _copy(tmp_path: Path) -> Path:
    """The pages the checks read, copied so one can be changed."""
    for relative in ["README.md", BENCHMARKS, "Makefile", *map(str, _docs())]:
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((ROOT / relative).read_text())
    return tmp_path


def _docs() -> list[Path]:
    return [path.relative_to(ROOT) for path in sorted((ROOT / "docs").glob("*.md"))]


def _plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"the planted change needs {old!r} in {path.name}"
    path.write_text(text.replace(old, new, 1))


def test_a_readme_figure_its_source_does_not_say_is_reported(tmp_path):
    root = _copy(tmp_path)
    reward = re.search(r"\b0\.\d{3}\b", (root / "README.md").read_text())
    assert reward is not None
    _plant(root / "README.md", reward.group(), "0.999")
    [problem] = readme_figure_problems(root)
    assert problem.startswith("README.md quotes '0.999', which benchmarks/README.md#")


def test_a_readme_figure_without_a_source_link_is_reported(tmp_path):
    root = _copy(tmp_path)
    _plant(root / "README.md", "\n## License", "\nThe suite runs in 8 min 12 s.\n\n## License")
    [problem] = readme_figure_problems(root)
    assert "without linking its source" in problem and "8 min 12 s" in problem


def test_a_headline_figure_its_section_does_not_say_is_reported(tmp_path):
    root = _copy(tmp_path)
    _plant(root / BENCHMARKS, "| 1 min 56 s from `make train`", "| 1 min 6 s from `make train`")
    [problem] = headline_problems(root)
    assert problem.startswith(f"{BENCHMARKS}'s headline '1 min 6 s' is not in ")


def test_a_link_to_a_heading_that_moved_is_reported(tmp_path):
    root = _copy(tmp_path)
    [anchor, *_] = [a for _, a in LINK.findall((root / "README.md").read_text()) if a]
    _plant(root / "README.md", f"#{anchor})", f"#{anchor}-moved)")
    problems = link_problems(root)
    assert problems == [f"README.md links {BENCHMARKS}#{anchor}-moved: no heading"]


def test_a_docs_venv_time_other_than_the_makefile_s_is_reported(tmp_path):
    root = _copy(tmp_path)
    minutes = makefile_figures((root / "Makefile").read_text())["gym-venv"][0]
    assert minutes.endswith(" min")
    _plant(root / "docs" / "environments.md", minutes + "utes", "2-3 minutes")
    [problem] = makefile_problems(root)
    assert problem.startswith(
        f"docs/environments.md: a paragraph on `make gym-venv` does not say ['{minutes}']"
    )
