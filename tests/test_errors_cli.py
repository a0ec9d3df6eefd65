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
