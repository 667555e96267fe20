"""A first apply that cannot run leaves nothing behind: the daemon it started stops again, and the next apply
(with the problem fixed) starts cleanly."""

from __future__ import annotations

import socket

from tests.control.conftest import Cli, base_spec, wait_for, write_spec

NAME = "porttaken"


def test_a_taken_port_fails_apply_and_stops_the_daemon_it_started(tmp_path, tiny_llama):
    cli = Cli(tmp_path / "home")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        spec = base_spec(NAME, tiny_llama, listen=f"127.0.0.1:{port}")
        cfg = write_spec(tmp_path / "llmdeploy.yaml", spec)
        try:
            r = cli.run("apply", str(cfg))
            assert r.returncode == 1, (r.stdout, r.stderr)
            assert f"cannot listen on 127.0.0.1:{port}" in r.stderr + r.stdout
            # no daemon answers any more: status says the deployment is not running
            wait_for(
                lambda: (
                    "not running"
                    in cli.run("status", "--name", NAME).stdout + cli.run("status", "--name", NAME).stderr
                ),
                30,
                what="the daemon to stop",
            )
        finally:
            cli.cleanup(NAME)
