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


def test_errors_name_the_flags_that_set_them(tiny_target, capsys):
    assert main(_generate(tiny_target, "--prompt", "t5", "--min-new-tokens", "9")) == 2
    assert "tandem: error: --min-new-tokens must be in [0, max_tokens = 3]" in capsys.readouterr().err
    assert main(_generate(tiny_target, "--prompt", "t5", "--speculative-algorithm", "ngram",
                          "--speculative-num-draft-tokens", "0")) == 2
    assert "tandem: error: --speculative-num-draft-tokens must be" in capsys.readouterr().err


def test_a_schema_file_that_is_not_json_is_named(tiny_target, tmp_path, capsys):
    schema = tmp_path / "trunc.json"
    schema.write_text('{"type": ')
    assert main(_generate(tiny_target, "--prompt", "t5", "--json-schema", str(schema))) == 2
    assert f"--json-schema {schema}: the file is not JSON" in capsys.readouterr().err


def test_progress_in_a_log_is_lines_at_the_bars_pace(monkeypatch, capsys):
    """Where stderr is no terminal, a bar is a line at most every LOG_LINE_EVERY_S (postfix
    updates included), and its last state is kept even for a transient bar."""
    from tandem import progress as progress_module

    monkeypatch.setattr(progress_module, "LOG_LINE_EVERY_S", 3600.0)
    bar = progress_module.progress(total=50, desc="work", leave=False)
    for i in range(50):
        bar.update(1)
        bar.set_postfix(step=i, refresh=False)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("work:   0%") and lines[-1].startswith("work: 100%")
    assert all("\r" not in line for line in lines)

