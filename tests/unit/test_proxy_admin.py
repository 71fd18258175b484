"""Issue 28, finding 1: only an admin (an admin key, or without admin keys a caller on the proxy's
own host) may add or remove the proxy's nodes; a client key never can. And an api_server with
--proxy-url still joins: with the admin key, or from the same host when the proxy has none."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from proxy_harness import MODEL, ProxyServer, StandInNode

from conveyor.services.ingress.proxy_registration import ProxyRegistration
from conveyor.services.proxy import build_proxy_app
from conveyor.services.proxy.admin import is_loopback

CLIENT, ADMIN = "sk-client", "sk-admin"
REMOTE, LOCAL = ("10.1.2.3", 40000), ("127.0.0.1", 40000)
NOWHERE = "http://127.0.0.1:9"  # a node URL: nothing answers there (it is added down)


def _calls(app, peer: tuple[str, int], calls: list[tuple[str, str, str | None]]) -> list[httpx.Response]:
    """Each ``(method, path, key)`` sent to ``app`` from ``peer``."""
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            answers = []
            for method, path, key in calls:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                body = {"url": NOWHERE, "status": {"models": [MODEL]}} if path == "/nodes/add" else {"url": NOWHERE}
                answers.append(await client.request(method, path, headers=headers,
                                                    json=body if method == "POST" else None))
        await app.state.proxy.http.aclose()
        return answers
    return asyncio.run(run())


def test_without_admin_keys_only_this_host_may_add_or_remove_nodes():
    app = build_proxy_app(health_interval_s=60)
    refused = _calls(app, REMOTE, [("POST", "/nodes/add", None), ("POST", "/nodes/add", "anything"),
                                   ("POST", "/nodes/remove", None)])
    for r in refused:
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "admin_key_required" and "--admin-keys" in r.json()["error"]["message"]
    assert app.state.proxy.table.nodes == {}
    app = build_proxy_app(health_interval_s=60)
    added, removed = _calls(app, LOCAL, [("POST", "/nodes/add", None), ("POST", "/nodes/remove", None)])
    assert (added.status_code, added.json()) == (200, "Added successfully")
    assert (removed.status_code, removed.json()) == (200, "Deleted successfully")


def test_node_routes_take_an_admin_key_and_refuse_a_client_key():
    app = build_proxy_app(api_keys=[CLIENT], admin_keys=[ADMIN], health_interval_s=60)
    none, wrong, client, admin, client_remove = _calls(app, REMOTE, [
        ("POST", "/nodes/add", None), ("POST", "/nodes/add", "sk-wrong"), ("POST", "/nodes/add", CLIENT),
        ("POST", "/nodes/add", ADMIN), ("POST", "/nodes/remove", CLIENT)])
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key", r.text
    for r in (client, client_remove):
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
    assert admin.status_code == 200, admin.text
    assert list(app.state.proxy.table.nodes) == [NOWHERE]  # the client could not remove it
    # from this host too: with admin keys, the key is what counts
    app = build_proxy_app(api_keys=[CLIENT], admin_keys=[ADMIN], health_interval_s=60)
    (local_client,) = _calls(app, LOCAL, [("POST", "/nodes/add", CLIENT)])
    assert local_client.status_code == 403


def test_reading_the_status_takes_either_key_and_the_admin_key_opens_no_client_route():
    app = build_proxy_app(api_keys=[CLIENT], admin_keys=[ADMIN], health_interval_s=60)
    status = _calls(app, REMOTE, [("GET", "/nodes/status", CLIENT), ("GET", "/nodes/status", ADMIN),
                                  ("GET", "/nodes/status", None), ("GET", "/v1/models", ADMIN),
                                  ("GET", "/v1/models", CLIENT)])
    assert [r.status_code for r in status] == [200, 200, 401, 401, 200]


def test_a_key_cannot_be_both_a_client_key_and_an_admin_key():
    with pytest.raises(ValueError, match="both API keys and admin keys"):
        build_proxy_app(api_keys=[CLIENT, "shared"], admin_keys=["shared"])


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                         ("::ffff:127.0.0.1", True), ("10.0.0.1", False), ("::ffff:10.0.0.1", False),
                                         ("testclient", False), (None, False), ("", False)])
def test_loopback_peers(host, local):
    assert is_loopback(host) is local


def test_adding_a_node_never_sends_it_the_admin_key():
    """The node's /v1/models is asked with the proxy's own client key: the admin key would let
    whoever runs that URL change the routing."""
    with StandInNode() as node, ProxyServer(api_keys=[CLIENT], admin_keys=[ADMIN], health_interval_s=60) as proxy:
        r = httpx.post(f"{proxy.url}/nodes/add", json={"url": node.url}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert proxy.table.nodes[node.url].models == [MODEL]
        assert node.auth and all(a != f"Bearer {ADMIN}" for a in node.auth)
        assert node.auth[0] == f"Bearer {CLIENT}"


def _join_and_leave(proxy: ProxyServer, admin_key: str | None) -> tuple[bool, bool]:
    """(joined, gone after leaving) for an api_server's registration at ``proxy``."""
    async def run() -> tuple[bool, bool]:
        registration = ProxyRegistration(proxy.url, NOWHERE, [MODEL], admin_key=admin_key)
        registration.start()
        await asyncio.wait_for(registration._task, 10)
        joined = registration.joined and NOWHERE in proxy.table.nodes
        await registration.leave()
        return joined, NOWHERE not in proxy.table.nodes
    return asyncio.run(run())


def test_an_api_server_joins_with_the_admin_key():
    with ProxyServer(api_keys=[CLIENT], admin_keys=[ADMIN], health_interval_s=60) as proxy:
        assert _join_and_leave(proxy, ADMIN) == (True, True)
        assert _join_and_leave(proxy, CLIENT) == (False, True)  # refused at once, not retried


def test_an_api_server_on_the_same_host_joins_a_proxy_without_admin_keys():
    with ProxyServer(api_keys=[CLIENT], health_interval_s=60) as proxy:
        assert _join_and_leave(proxy, None) == (True, True)
