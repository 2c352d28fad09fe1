"""A tool file named as ``file.py:name`` may import its sibling modules, as a script can."""

from __future__ import annotations

import textwrap

from verl_trainer.agents import MultiTurnConfig, resolve_tools


def test_a_tool_file_imports_its_sibling_module(tmp_path):
    (tmp_path / "word_table_for_tool_test.py").write_text('WORDS = {"cat": "feline"}\n')
    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''
        from word_table_for_tool_test import WORDS   # a sibling module of this file

        def lookup(word: str) -> str:
            """Look a word up.

            Args:
                word: The word.
            """
            from word_table_for_tool_test import WORDS as late   # imported at call time too
            return late.get(word, WORDS.get(word, "unknown"))
    '''))
    config = MultiTurnConfig(enable=True, tools=[f"{tmp_path}/my_tools.py:lookup"])
    [tool] = resolve_tools(config.tools)
    assert tool.execute("t0", {"word": "cat"}) == "feline"
