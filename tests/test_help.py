"""Every command's --help reads at the terminal's width: prose wraps to it, examples keep their lines."""

import re

import pytest

from eyas.commands import HelpFormatter, build_parser


def subcommand_parsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices


@pytest.mark.parametrize("width", [80, 100])
def test_help_prose_wraps_to_the_terminal(width, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(width))
    for name, parser in subcommand_parsers().items():
        text = parser.format_help()
        description = text.split("\noptions:")[0].split("\npositional arguments:")[0]
        for line in description.splitlines():
            if line.startswith(" "):  # an example or a table, kept as written
                continue
            assert len(line) <= width, (name, line)


def test_paragraphs_are_joined_and_list_items_kept():
    formatter = HelpFormatter("eyas", width=40)
    text = "one two three four five six\nseven eight nine ten eleven\n\n- an item that is long enough to wrap\n" \
           "- another\n  kept   as written"
    out = formatter._fill_text(text, 40, "")
    assert out.splitlines() == ["one two three four five six seven eight", "nine ten eleven", "",
                                "- an item that is long enough to wrap", "- another", "  kept   as written"]
    assert re.sub(r"\s+", " ", out.split("\n\n")[0]) == re.sub(r"\s+", " ", text.split("\n\n")[0])
