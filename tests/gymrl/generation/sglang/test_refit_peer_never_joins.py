"""A refit whose peer never joins the weight-update group (docs/reliability.md, "Stalls"): two
SGLang stand-ins answer the session, one never joins the rendezvous (its
`/init_weights_update_group` call hangs, as a server whose NCCL cannot reach the trainer's
address does). The refit fails by `generation.refit.timeout_s`, naming the servers whose join
did not finish and the stage."""

import threading
import time

import pytest
import torch

from gymrl.generation.sglang.weight_sync import WeightSender, WeightSyncError
from tests.support.sglang_standin import refit as standin_refit

TIMEOUT_S = 3.0


def test_a_peer_that_never_joins_fails_the_refit_by_its_deadline_naming_it(standins, monkeypatch):
    joined = standin_refit.join_weight_update_group
    released = threading.Event()

    def join_unless_second(**kwargs):
        if kwargs["rank"] == 2:  # the second server's rank: it never joins
            released.wait(30.0)
            raise RuntimeError("never joined")
        # The first server joins, and waits for the group as long as the trainer does.
        return joined(**{**kwargs, "timeout_s": TIMEOUT_S})

    monkeypatch.setattr(standin_refit, "join_weight_update_group", join_unless_second)
    (url_a, _), (url_b, _) = standins(2)
    sender = WeightSender(
        [url_a, url_b],
        [1, 1],
        master_address="127.0.0.1",
        backend="gloo",
        bucket_bytes=1024,
        timeout_s=TIMEOUT_S,
    )
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as failed:
            sender.send({"w": torch.ones(4)}.items(), version=1)
        seconds = time.monotonic() - started
    finally:
        released.set()
        sender.close()
    print(f"peer never joined -> WeightSyncError after {seconds:.1f} s: {failed.value}")
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 10
    # A member's join returns only once every member joined, so every server is still silent:
    # the trainer's end cannot tell which one is missing (NCCL's rendezvous writes nothing per
    # member); it names them all and the stage.
    message = str(failed.value)  # the deadline's, or the rendezvous's when it fails first
    assert f"servers not answering: {', '.join(sorted([url_a, url_b]))}" in message
    assert "the rendezvous did not finish" in message or "did not form" in message
