"""The guide's table of SharedTrainer options (docs/guide/options.md) is the signature: every option, in
order, with its default. A new option, a changed default or a removed one fails here until the guide says so."""

import ast
import inspect
import os
import re

from gradshare import SharedTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the repo
README = os.path.join(ROOT, "README.md")
OPTIONS = os.path.join(ROOT, "docs", "guide", "options.md")
SPARK_ML = os.path.join(ROOT, "docs", "guide", "spark-ml.md")
HEADING = "# Every option"


def readme_options() -> list[tuple[str, str]]:
    """(option, default cell) per row of the first table after HEADING in the options page."""
    text = open(OPTIONS, encoding="utf-8").read()
    assert HEADING in text, f"docs/guide/options.md has no {HEADING!r} section"
    lines = text[text.index(HEADING):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option | default |"))
    rows = []
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name = re.fullmatch(r"`(\w+)`", cells[0])
        assert name, f"options table: cell {cells[0]!r} is not one `name`"
        rows.append((name.group(1), cells[1]))
    return rows


def default_of(cell: str):
    """The Python value of a default cell: its first `literal` ("required" for none)."""
    if cell == "required":
        return inspect.Parameter.empty
    literal = re.match(r"`([^`]+)`", cell)
    assert literal, f"default cell {cell!r} starts with no `literal`"
    return ast.literal_eval(literal.group(1))


def test_the_options_table_lists_every_option_with_its_default_in_signature_order():
    params = inspect.signature(SharedTrainer).parameters
    rows = readme_options()
    listed = [name for name, _ in rows]
    missing, extra = [n for n in params if n not in listed], [n for n in listed if n not in params]
    assert not missing and not extra, f"options table: missing {missing}, not options {extra}"
    assert listed == list(params), "options table is not in the signature's order"
    wrong = [(name, cell, params[name].default) for name, cell in rows
             if type(default_of(cell)) is not type(params[name].default) or default_of(cell) != params[name].default]
    assert not wrong, f"options table defaults differ from the signature (option, table, signature): {wrong}"


def test_the_options_page_points_to_the_ml_page_and_the_readme_to_the_design_document():
    options = open(OPTIONS, encoding="utf-8").read()
    assert "# Spark ML: `gradshare.ml`" in open(SPARK_ML, encoding="utf-8").read()
    assert "([Spark ML: `gradshare.ml`](spark-ml.md))" in options
    text = open(README, encoding="utf-8").read()
    assert "docs/design.md" in text and os.path.exists(os.path.join(ROOT, "docs", "design.md"))
