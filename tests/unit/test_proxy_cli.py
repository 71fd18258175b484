"""``conveyor serve proxy`` and ``api_server --proxy-url`` on the command line (LMDeploy's spellings)."""

from __future__ import annotations

import pytest

from conveyor.cli import _cmd_proxy, build_parser, hyphenate_options, main


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
