"""serving.public_url: what trainers and clients call, apart from the bind address serving.host.
A TCP forwarder on another port stands in for a load balancer in front of the gateway."""

from __future__ import annotations

import socket
import threading

import pytest
import yaml
from conftest import free_port, policy_version, running_gateway

from clawflow.config import REPO_ROOT, ConfigError, load_config
from clawflow.policy import reload


def config(tmp_path, **serving):
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["serving"].update(serving)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return load_config(tmp_path / "c.yaml")


def test_public_url_defaults_to_the_bind_address(tmp_path):
    assert config(tmp_path, host="10.1.2.3", port=31000).gateway_url == "http://10.1.2.3:31000"
    assert config(tmp_path, host="0.0.0.0", port=31000).gateway_url == "http://127.0.0.1:31000"  # bind-all
    cfg = config(tmp_path, host="0.0.0.0", public_url="https://gw.example.internal/")
    assert cfg.gateway_url == "https://gw.example.internal" and cfg.serving.host == "0.0.0.0"


@pytest.mark.parametrize("bad", ["gw.internal:30000", "ftp://gw", "http://", "http://a b"])
def test_bad_public_url_is_a_one_line_error(tmp_path, bad):
    with pytest.raises(ConfigError, match="serving.public_url: .*http") as err:
        config(tmp_path, public_url=bad)
    assert "\n" not in str(err.value)


class Forwarder:
    """Accepts on its own port and pipes each connection to `target`; counts connections."""

    def __init__(self, target: int):
        self.target, self.connections = target, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_trainer_reload_goes_to_the_public_url(make_config, tiny_model_dir):
    bind_port = free_port()
    lb = Forwarder(bind_port)
    try:
        cfg = make_config(serving={"port": bind_port, "public_url": f"http://127.0.0.1:{lb.port}"})
        assert cfg.gateway_url == f"http://127.0.0.1:{lb.port}"
        with running_gateway(cfg):
            reply = reload.reload_gateway(cfg, 7, tiny_model_dir)  # what the flow's reload task calls
            assert reply is not None and lb.connections >= 1
            assert policy_version(cfg) == 7
        lb_down = make_config(serving={"port": bind_port, "public_url": f"http://127.0.0.1:{free_port()}"})
        with running_gateway(lb_down):  # bound and serving, but the public URL is not it: unreachable
            assert reload.reload_gateway(lb_down, 8, tiny_model_dir) is None
    finally:
        lb.close()
