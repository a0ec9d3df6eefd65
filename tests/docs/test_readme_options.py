"""The guide's table of SharedTrainer options (docs/guide/options.md) is the signature: every option, in
order, with its default. A new option, a changed default or a removed one fails here until the guide says so."""

import inspect
import os
import re

from gradshare import SharedTrainer
from gradshare.config import options_table
from gradshare.config.grouping import GROUPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the repo
README = os.path.join(ROOT, "README.md")
OPTIONS = os.path.join(ROOT, "docs", "guide", "options.md")
SPARK_ML = os.path.join(ROOT, "docs", "guide", "spark-ml.md")
HEADING = "# Every option"


def test_the_options_page_is_the_generated_table_of_every_option_and_group():
    text = open(OPTIONS, encoding="utf-8").read()
    assert HEADING in text, f"docs/guide/options.md has no {HEADING!r} section"
    start, end = "<!-- generated: gradshare.config.options_table() -->\n", "<!-- end generated -->"
    page = text[text.index(start) + len(start) : text.index(end)]
    assert page == options_table(), "docs/guide/options.md differs from options_table(): paste it again"
    params = inspect.signature(SharedTrainer).parameters
    listed = re.findall(r"^\| `(\w+)` \|", page.split("### ")[1], re.M)  # the flat table's rows
    assert listed == [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for keyword, group in GROUPS.items():  # each group's table lists its fields
        assert f"### `{keyword}={group.__name__}(...)`" in page


def test_the_options_page_points_to_the_ml_page_and_the_readme_to_the_design_document():
    options = open(OPTIONS, encoding="utf-8").read()
    assert "# Spark ML: `gradshare.ml`" in open(SPARK_ML, encoding="utf-8").read()
    assert "([Spark ML: `gradshare.ml`](spark-ml.md))" in options
    text = open(README, encoding="utf-8").read()
    assert "docs/design.md" in text and os.path.exists(os.path.join(ROOT, "docs", "design.md"))
