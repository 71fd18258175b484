"""``conveyor serve proxy`` and ``api_server --proxy-url`` on the command line (LMDeploy's spellings)."""

from __future__ import annotations

import pytest

from conveyor.cli import (ADMIN_KEYS_ENV, _admin_keys, _api_keys, _cmd_proxy, _proxy_admin_key, build_parser,
                          hyphenate_options, main)


def _parse(*argv: str):
    return build_parser().parse_args(hyphenate_options(list(argv)))


def test_proxy_takes_lmdeploys_options_in_both_spellings() -> None:
    a = _parse("serve", "proxy", "--server_name", "127.0.0.1", "--server_port", "9000", "--strategy", "random",
               "--api-keys", "k1", "k2")
    assert (a.server_name, a.server_port, a.strategy, a.api_keys, a.func) == \
        ("127.0.0.1", 9000, "random", ["k1", "k2"], _cmd_proxy)
    assert _parse("serve", "proxy").strategy == "min_expected_latency"  # LMDeploy's default
    assert _parse("serve", "proxy", "--routing_strategy", "min_observed_latency").strategy == "min_observed_latency"
    with pytest.raises(SystemExit):
        _parse("serve", "proxy", "--strategy", "round_robin")


def test_a_bad_health_interval_is_refused_before_serving(capsys) -> None:
    assert main(["serve", "proxy", "--health-interval", "0"]) == 2
    assert "--health-interval" in capsys.readouterr().err


def test_proxy_url_must_be_an_http_url(capsys) -> None:
    assert _parse("serve", "api_server", "m", "--proxy_url", "http://10.0.0.1:8000/").proxy_url == \
        "http://10.0.0.1:8000"
    assert _parse("serve", "stage", "ingress", "--proxy-url", "https://proxy").proxy_url == "https://proxy"
    with pytest.raises(SystemExit):
        _parse("serve", "api_server", "m", "--proxy-url", "localhost:8000")
    assert "http://HOST:PORT" in capsys.readouterr().err


def test_the_proxy_listens_on_this_host_unless_told_otherwise() -> None:
    assert _parse("serve", "proxy").server_name == "127.0.0.1"
    assert _parse("serve", "proxy", "--server-name", "0.0.0.0").server_name == "0.0.0.0"


def test_admin_keys_come_from_flags_a_file_and_the_environment(tmp_path, monkeypatch) -> None:
    keys = tmp_path / "admin"
    keys.write_text("# the proxy's admin keys\nsk-file-1\n\nsk-file-2\n")
    monkeypatch.setenv(ADMIN_KEYS_ENV, "sk-env-1, sk-env-2")
    args = _parse("serve", "proxy", "--admin-keys", "sk-flag", "--admin_keys_file", str(keys))
    assert _admin_keys(args) == ["sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2"]
    # an api_server presents one: its file's first key, else the environment's
    args = _parse("serve", "api_server", "m", "--proxy-url", "http://p:8000", "--proxy-admin-key-file", str(keys))
    assert _proxy_admin_key(args) == "sk-file-1"
    assert _proxy_admin_key(_parse("serve", "stage", "ingress", "--proxy-url", "http://p:8000")) == "sk-env-1"
    monkeypatch.delenv(ADMIN_KEYS_ENV)
    assert _proxy_admin_key(_parse("serve", "api_server", "m")) is None
    assert _admin_keys(_parse("serve", "proxy")) is None


def test_a_key_file_that_cannot_be_read_or_is_empty_is_refused(tmp_path, capsys) -> None:
    # Before: a traceback for a missing file, and an empty --api-keys-file started a server without keys.
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    reads = [lambda: main(["serve", "proxy", "--api-keys-file", str(tmp_path / "missing")]),
             lambda: main(["serve", "proxy", "--admin-keys-file", str(empty)]),
             lambda: _api_keys(_parse("serve", "api_server", "m", "--api-keys-file", str(empty))),
             lambda: _proxy_admin_key(_parse("serve", "api_server", "m", "--proxy-url", "http://p:8000",
                                             "--proxy-admin-key-file", str(tmp_path / "missing")))]
    for read in reads:
        with pytest.raises(SystemExit) as exit_:
            read()
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and ("cannot read the key file" in err or "holds no key" in err), err


def test_a_proxy_admin_key_file_without_a_proxy_is_refused(tmp_path, capsys) -> None:
    keys = tmp_path / "admin"
    keys.write_text("sk-admin\n")
    with pytest.raises(SystemExit) as exit_:
        _proxy_admin_key(_parse("serve", "api_server", "m", "--proxy-admin-key-file", str(keys)))
    assert exit_.value.code == 2 and "--proxy-url" in capsys.readouterr().err


def test_the_admin_key_is_not_in_the_server_settings_repr() -> None:
    from conveyor.services.launcher import ServerArgs

    assert "sk-secret" not in repr(ServerArgs(model_path="m", proxy_admin_key="sk-secret"))


@pytest.mark.parametrize("argv, flag", [(["--first-byte-timeout", "0"], "--first-byte-timeout"),
                                        (["--chunk-timeout", "-1"], "--chunk-timeout"),
                                        (["--api-keys", "k", "--admin-keys", "k"], "both an API key and an admin key")])
def test_bad_timeouts_and_shared_keys_are_refused_before_serving(argv, flag, capsys) -> None:
    assert main(["serve", "proxy", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_the_timeout_defaults_are_the_proxys() -> None:
    from conveyor.services.proxy.relay import DEFAULT_CHUNK_TIMEOUT_S, DEFAULT_FIRST_BYTE_TIMEOUT_S

    args = _parse("serve", "proxy")
    assert (args.first_byte_timeout, args.chunk_timeout) == (DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_CHUNK_TIMEOUT_S)
