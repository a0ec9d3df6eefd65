"""The guide's page of worker-count defaults shows the planner's table as it is (policy.table)."""

import os

from gradshare.driver.policy import auto_for, table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_defaults_page_holds_the_planners_table():
    page = open(os.path.join(ROOT, "docs", "guide", "defaults.md"), encoding="utf-8").read()
    assert table() in page, "docs/guide/defaults.md: paste gradshare.driver.policy.table() over its table"


def test_the_table_changes_where_the_policy_says():
    assert auto_for(31).momentum == 0.5 and auto_for(32).momentum == 0.0
    assert auto_for(15).forwarding == "per-rank" and auto_for(16).forwarding == "aggregate"
    assert "| 32 | off (0) | 0.1 × initial norm | 0.02 | 0.35 |" in table()
    assert "| 16 | 0.5 | 0.06 × norm now | off |" in table()
