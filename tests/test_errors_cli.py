import os
import subprocess
import sys

import pytest

from gradshare import errors
from gradshare.cli import build_parser, main


def test_decode_error_is_a_value_error_and_remote():
    # Callers catch bad wire input as ValueError; the relay counts it as a remote protocol error.
    err = errors.DecodeError("truncated header")
    assert isinstance(err, ValueError)
    assert isinstance(err, errors.RemoteProtocolError)
    assert isinstance(err, errors.GradshareError)
    assert not isinstance(err, errors.LocalProtocolError)


def test_transport_timeout_is_a_timeout_error():
    assert issubclass(errors.TransportTimeout, TimeoutError)
    assert issubclass(errors.TransportTimeout, errors.GradshareError)


def test_cli_without_command_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_cli_help_lists_only_built_commands(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "usage: gradshare" in out


HEAVY = ("numpy", "numba", "torch", "pyspark", "sklearn")


def test_cli_help_imports_no_command_module():
    # gradshare/cli.py's import seam: `gradshare --help` lists the commands without importing them
    code = (
        "import sys\nfrom gradshare.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('gradshare.')))"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "bench" in out.stdout and "relay" in out.stdout  # the help still lists them
    assert out.stdout.strip().splitlines()[-1] == "['gradshare.cli', 'gradshare.errors']"


def test_cli_parser_for_one_command_has_its_options():
    import gradshare.demo

    args = build_parser(["demo", "--workers", "3"]).parse_args(["demo", "--workers", "3"])
    assert args.workers == 3 and args.handler is gradshare.demo.run
    parser = build_parser(["relay"])
    with pytest.raises(SystemExit):  # a command other than the one named has no options yet: usage error
        parser.parse_args(["demo", "--workers", "3"])
