"""The command line's prompt sources and errors: `tandem generate` reads its prompts from
--prompt or stdin (one JSON object per prompt with --json), refuses an empty stdin, and an
interrupted command says so instead of a traceback."""

from __future__ import annotations

import io
import json

import pytest

from conftest import write_tiny_target
from tandem import cli
from tandem.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("target"))


def _generate(tiny_target, *extra):
    return ["generate", "--model", str(tiny_target[0]), "--max-new-tokens", "3", "--threads", "1", *extra]


def test_generate_json_takes_each_stdin_line_as_a_prompt(tiny_target, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("t5 t6 t7\n\nt9 t10\n"))
    assert main(_generate(tiny_target, "--json")) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["usage"]["prompt_tokens"] for r in records] == [3, 2]
    assert all(r["usage"]["completion_tokens"] == len(r["token_ids"]) <= 3 for r in records)


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_generate_refuses_an_empty_stdin_before_loading(tiny_target, monkeypatch, capsys, json_flag):
    def no_loading(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "llm_from_args", no_loading)
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    assert main(_generate(tiny_target, *json_flag)) == 2
    assert "no prompt: stdin held none" in capsys.readouterr().err


def test_an_interrupted_command_says_so(tiny_target, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "llm_from_args", interrupted)
    assert main(_generate(tiny_target, "--prompt", "t5")) == 130
    assert capsys.readouterr().err.strip() == "tandem: interrupted"
