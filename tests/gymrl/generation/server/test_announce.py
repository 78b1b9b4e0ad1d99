"""The policy server's announcement: what a Gym deployment needs, readable by its owner only,
and a console line that never shows the key."""

import json
import stat

from gymrl.config.compose import compose_raw
from gymrl.generation.server.announce import announce_policy_server, policy_server_host
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.gym_launch import PolicyEndpoint


def test_announcement_holds_url_model_and_key_in_a_private_file(tmp_path, capsys):
    stale = tmp_path / "policy_server.json"
    stale.write_text("{}")
    stale.chmod(0o644)
    path = announce_policy_server(
        tmp_path, PolicyEndpoint("http://127.0.0.1:8123/v1", "s3cr3t-key", "m")
    )
    assert path == stale
    assert json.loads(path.read_text()) == {
        "policy_base_url": "http://127.0.0.1:8123/v1",
        "policy_model_name": "m",
        "policy_api_key": "s3cr3t-key",
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8123/v1" in out and str(path) in out and "'m'" in out
    assert "s3cr3t-key" not in out


def test_the_host_is_loopback_alone_every_interface_on_a_cluster_or_the_configured_one():
    def host(*overrides):
        return policy_server_host(validate_config(compose_raw(["+experiment=smoke", *overrides])))

    assert host() == "127.0.0.1"
    assert host("cluster.ray_address=auto") == "0.0.0.0"
    assert host("generation.server.host=10.1.2.3") == "10.1.2.3"
