"""How the lessons extend each other: through public contracts, not each other's private parts.

scripts/count_private_reaches.py counts, over the lesson packages, the private methods a lesson
overrides in an earlier lesson's class, the private names it imports from another lesson, and
the private names of earlier lessons it reads or writes. A later lesson plugs in through L5's KV
manager contract and the engine's and scheduler's documented hooks (L5 §2.10), so the count is
none; any new one fails here and names where it is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import count_private_reaches as reaches  # noqa: E402

pytestmark = [pytest.mark.course]

CEILING = 0  # 2026-11-28: was 95 (issue 54), 55 with the first public helpers, 0 behind the KV manager


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_counter_finds_each_kind_of_reach_and_nothing_public(tmp_path):
    write(tmp_path / "l1_base" / "__init__.py",
          "class Engine:\n"
          "    def _commit(self):\n        self._pending = 1\n"
          "    def step(self):\n        return self._commit()\n"
          "def _helper():\n    return 1\n")
    write(tmp_path / "l2_later" / "__init__.py",
          "from l1_base import Engine, _helper\n"
          "class Later(Engine):\n"
          "    def _commit(self):\n        return super()._commit() + _helper()\n"  # override + import
          "    def step(self):\n        return self._pending\n"  # a reach (public step is no override)
          "    def __repr__(self):\n        return 'later'\n")
    found = reaches.findings(tmp_path)
    assert sorted((f.kind, f.lesson) for f in found) == [("import", "l2_later"), ("override", "l2_later"),
                                                         ("reach", "l2_later")], [str(f) for f in found]


def test_lessons_reach_into_each_others_private_parts_no_more_than_counted():
    found = reaches.findings()
    assert len(found) <= CEILING, "\n".join(map(str, found))
