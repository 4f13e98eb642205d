"""Every relative link of README.md and docs/*.md opens a file inside the repository: a
reader of a clone (or of the repository's web page) finds what the text points to. The article
qkv grew from is in the repository too, as docs/article.txt, word for word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), the target up to a space (a title) or the closing bracket
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code
    found = [target for target in LINK.findall(text)]
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t, re.I)]


def test_the_pattern_finds_links_and_images(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('See [a](docs/a.md#part), ![b](images/b.png "B") and [c](https://x.org).\n'
                    "```\n[d](not/a/link.md)\n```\n")  # fmt: skip
    assert relative_links(page) == ["docs/a.md#part", "images/b.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_inside_the_repository(page):
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(REPO.resolve()), f"{page.name} links outside: {target}"
        assert path.is_file() or path.is_dir(), f"{page.name} links to a missing {target}"


def test_no_page_points_outside_the_repository_in_words():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "shared/seed" not in text and "../shared" not in text, page.name


def test_the_article_is_linked_and_held_word_for_word():
    article = REPO / "docs" / "article.txt"
    text = article.read_text(encoding="utf-8")
    assert text.startswith("A Simpler Description of the Self-Attention Mechanism")
    for heading in ("Introduction", "Normalization", "Multiple Heads", "Cross-Attention"):
        assert heading.lower() in text.lower()
    assert "(docs/article.txt)" in (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/design.md)" in (REPO / "README.md").read_text(encoding="utf-8")
    assert "(article.txt)" in (REPO / "docs" / "walkthrough.md").read_text(encoding="utf-8")
    seed = REPO.parent / "shared" / "seed" / "self-attention-article.txt"
    if seed.is_file():  # where the project's seed is beside the repository: the same words
        assert seed.read_text(encoding="utf-8") == text
