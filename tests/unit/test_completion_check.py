"""The completion check (plugins.train.completion_check): which methods it picks, what "parses" and
"degenerate" mean on hand-made completions, and a run of the CLI on a tiny seeded model."""

import json

from plugins.train.completion_check import Method, body_lines, degenerate, heldout_methods, main, methods_of, parses

SOURCE = '''import os


class Path:
    def name(self):
        """The last part."""
        return self._parts[-1]

    def parent(self):
        """The logical parent
        of the path."""
        return self._parent

    def empty(self):
        """Nothing after me."""

    @property
    def suffix(self):
        \'\'\'The extension.\'\'\'
        i = self.name().rfind(".")
        return self.name()[i:]
'''

METHOD = Method(file="x.py", name="A.f", prefix="", header='def f(self):\n    """Doc."""', indent=4, reference="")


def test_methods_are_one_line_docstrings_with_a_body():
    found = methods_of("pathlib.py", SOURCE)
    assert [m.name for m in found] == ["Path.name", "Path.suffix"]
    name, suffix = found
    assert name.prefix.endswith('    def name(self):\n        """The last part."""') and SOURCE.startswith(name.prefix)
    assert name.header == 'def name(self):\n    """The last part."""' and name.indent == 4
    assert name.reference == "return self._parts[-1]"
    assert suffix.header.startswith("def suffix(self):")  # the decorator is not part of the header


def test_parse_and_degenerate_on_hand_made_completions():
    cases = {  # completion -> (parses, degenerate)
        "\n        return self._x\n": (True, False),
        "\n        return self._x\n        retu": (True, False),            # the cut-off last line is dropped
        "\n        return (self._x,\n        1": (False, False),             # an unclosed statement
        "\n        self._path.\n        self._path.\n        self._path.\n        self._": (False, True),
        '\n        """\n        """\n        """\n': (False, True),
        "\n        return 1\n\n    def g(self):\n        pass\n": (True, False),  # the body ends at the dedent
        "\n    def g(self):\n        pass\n": (False, False),                # no body line at all
        "\n        x = 1\n      y = 2\n": (False, False),                  # inconsistent indentation
        "\n        if x:\n            return 1\n        return 2\n": (True, False),
        "\n        return self._to_to_to_to\n": (True, True),             # a loop inside a line
        "\n        return f(x, x, x, x, x\n": (False, True),
        "\n        # ----------------\n        return 1\n": (True, False),  # a rule is not a loop
        "": (False, True),
    }
    for completion, want in cases.items():
        assert (parses(METHOD, completion), degenerate(completion)) == want, completion
    assert body_lines(METHOD, "\n        return 1\n\n    def g(self):\n") == ["        return 1", ""]


def test_the_cli_runs_on_a_tiny_model(ckpt_factory, tmp_path, capsys):
    picked = heldout_methods(3, seed=0)
    assert len(picked) == 3 and picked == heldout_methods(3, seed=0) and len({m.name for m in picked}) == 3
    out = tmp_path / "completions.json"
    assert main([str(ckpt_factory("tiny")), "--n", "2", "--new-tokens", "4", "--json", str(out),
                 "--method", "asyncio/futures.py:cancelled"]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == 2 and len(result["completions"]) == 2
    assert result["shown"][0]["name"] == "Future.cancelled"
    printed = capsys.readouterr().out
    assert "Future.cancelled" in printed and "/2 parse," in printed
