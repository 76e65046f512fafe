"""Serve's proxy port: picked outside the ephemeral range, and a bind race retried."""

import socket

import pytest

from cluster import loopback


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    lo, hi = loopback.ephemeral_range()
    ports = {loopback.free_port() for _ in range(20)}
    for port in ports:
        assert not lo <= port <= hi
        assert loopback.PORT_RANGE[0] <= port < loopback.PORT_RANGE[1]
        assert loopback.port_free(port)


def test_a_taken_port_is_not_free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not loopback.port_free(s.getsockname()[1])


class FakeServe:
    def __init__(self, errors):
        self.errors = list(errors)
        self.ports, self.shutdowns, self.kwargs = [], 0, []

    def start(self, http_options, **kwargs):
        self.ports.append(http_options["port"])
        self.kwargs.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_serve(monkeypatch):
    from ray import serve

    def install(errors):
        fake = FakeServe(errors)
        monkeypatch.setattr(serve, "start", fake.start)
        monkeypatch.setattr(serve, "shutdown", fake.shutdown)
        return fake
    return install


def test_start_serve_tries_another_port_when_the_proxy_cannot_bind(fake_serve):
    fake = fake_serve([RuntimeError("Failed to bind to address '127.0.0.1:34131'.")])
    port = loopback.start_serve(proxy_location="HeadOnly")
    assert len(fake.ports) == 2 and port == fake.ports[1]
    assert fake.shutdowns == 1  # the half-started Serve is shut down before the retry
    assert fake.kwargs[-1] == {"proxy_location": "HeadOnly"}


def test_start_serve_raises_other_errors_and_gives_up_after_its_attempts(fake_serve):
    fake = fake_serve([ValueError("bad options")])
    with pytest.raises(ValueError):
        loopback.start_serve()
    assert fake.shutdowns == 0 and len(fake.ports) == 1
    fake = fake_serve([RuntimeError("Failed to bind")] * 3)
    with pytest.raises(RuntimeError):
        loopback.start_serve(attempts=3)
    assert len(fake.ports) == 3


@pytest.mark.ray
def test_serve_comes_up_on_another_port_when_its_first_pick_is_taken(tmp_path, monkeypatch):
    """The race CI hit, forced: the first port picked is taken before the proxy binds it."""
    import httpx

    from tests.serving import local_serve

    real = loopback.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = [taken.getsockname()[1]]
        monkeypatch.setattr(loopback, "free_port", lambda host="127.0.0.1": picks.pop() if picks else real(host))
        with local_serve({"tenants": []}, tmp_path) as (url, _, serve):
            assert not picks  # the taken port was tried first
            assert url != f"http://127.0.0.1:{taken.getsockname()[1]}"

            @serve.deployment
            def hello(request):
                return "ok"

            serve.run(hello.bind(), name="hello", route_prefix="/")
            assert httpx.get(url, timeout=30).text == "ok"
