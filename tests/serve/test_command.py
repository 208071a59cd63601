"""`redwood serve`'s flags: bad values are one-line errors (exit 2) before any model loads."""

from __future__ import annotations

import pytest

from redwood.cli import main


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--port", "70000"], "--port"),
        (["--max-queue", "0"], "--max-queue"),
        (["--max-request-bytes", "0"], "--max-request-bytes"),
        (["--api-key", ""], "--api-key"),
        (["--gamma", "3"], "only applies when speculating"),
        (["--draft-model", "x", "--self-speculate"], "mutually exclusive"),
    ],
)
def test_bad_flags_fail_before_loading(flags, message, capsys):
    assert main(["serve", "--model", "/nonexistent/model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and message in err and "Traceback" not in err


def test_help_lists_the_server_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-queue",
        "--max-request-bytes",
        "--draft-model",
        "--self-speculate",
        "--max-num-seqs",
        "--max-model-len",
    ):
        assert flag in out
