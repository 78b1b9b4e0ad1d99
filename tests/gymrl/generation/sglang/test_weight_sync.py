"""Weight sync by broadcast against stand-in SGLang servers on loopback, over a gloo group."""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import threading
import time

import pytest
import torch

from gymrl.generation.sglang import weight_sync
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.refit import broadcast_backend
from gymrl.generation.sglang.refit_checks.read_back import (
    ReadBackCheck,
    WeightMismatchError,
    checksum,
)
from gymrl.generation.sglang.weight_sync import WeightSender, WeightSyncError, buckets
from gymrl.generation.types import GenerationRequest, SamplingParams
from tests.support.sglang_standin import WEIGHT_OFFSET


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=generator),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=generator).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=generator),
        "model.norm.weight": torch.randn(8, generator=generator),
    }


def _sender(urls, **kwargs) -> WeightSender:
    kwargs.setdefault("bucket_bytes", 1024)
    kwargs.setdefault("timeout_s", 20.0)
    return WeightSender(urls, [1] * len(urls), master_address="127.0.0.1", backend="gloo", **kwargs)


def _check(**kwargs) -> ReadBackCheck:
    return ReadBackCheck(
        **({"every": 0, "rows": 4, "served_dtype": None, "timeout_s": 10.0} | kwargs)
    )


def _kinds(state) -> list[str]:
    return [kind for kind, _ in state.events if kind not in ("generate", "get_weights")]


# ------------------------------------------------------------------------------------ bucketing
def test_buckets_keep_order_never_split_and_hold_one_dtype():
    weights = _state_dict()  # float32 sizes: 1024, 256, (bf16 16), 512, 32 bytes
    plan = list(buckets(weights.items(), bucket_bytes=600))
    assert [bucket.names for bucket in plan] == [
        ["model.embed_tokens.weight"],  # larger than a bucket: alone, whole
        ["model.layers.0.self_attn.q_proj.weight"],
        ["model.layers.0.input_layernorm.weight"],  # a dtype change starts a bucket
        ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
    ]
    assert [bucket.nbytes for bucket in plan] == [1024, 256, 16, 544]
    assert all(len({t.dtype for t in bucket.tensors}) == 1 for bucket in plan)
    assert [name for bucket in plan for name in bucket.names] == list(weights)
    assert len(list(buckets(weights.items(), bucket_bytes=1 << 20))) == 3  # f32 | bf16 | f32


def test_buckets_refuse_a_bad_size_and_repeated_names():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(buckets([], bucket_bytes=0))
    tensor = torch.zeros(2)
    with pytest.raises(ValueError, match="twice"):
        list(buckets([("a", tensor), ("a", tensor)], bucket_bytes=64))


def test_bucket_payload_is_a_flattened_bucket_that_leaves_the_flush_to_the_engine():
    [bucket] = buckets([("w", torch.zeros(2, 3, dtype=torch.bfloat16))], bucket_bytes=64)
    assert bucket.payload(group_name="g7", version=7) == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g7",
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "weight_version": "7",
    }


def test_a_flattened_bucket_is_the_tensors_bytes_back_to_back_in_the_staging_buffer():
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7.0, 8.0])
    [bucket] = buckets([("a", a), ("b", b)], bucket_bytes=1 << 10)
    staging = torch.full((1 << 10,), 255, dtype=torch.uint8)
    flat = bucket.flattened(staging)
    assert flat.dtype == torch.uint8 and flat.numel() == 8 * 4
    assert flat.data_ptr() == staging.data_ptr()  # copied into the reused buffer, no new one
    assert torch.equal(flat[:24].view(torch.float32).reshape(2, 3), a)
    assert torch.equal(flat[24:].view(torch.float32), b)


def test_a_lone_tensor_is_sent_as_its_own_bytes_even_beyond_the_staging_buffer():
    big = torch.arange(64.0)  # 256 bytes, alone in its bucket
    [bucket] = buckets([("big", big)], bucket_bytes=64)
    flat = bucket.flattened(torch.empty(64, dtype=torch.uint8))
    assert flat.data_ptr() == big.data_ptr() and flat.numel() == 256


# ------------------------------------------------------------------------------- against servers
def test_servers_end_with_the_trainers_weights_in_order_and_version(standins):
    servers = standins(2)
    weights = _state_dict()
    sender = _sender([url for url, _ in servers], bucket_bytes=600)
    assert sender.rank_offsets == [1, 2]
    try:
        sender.send(weights.items(), version=3)
        for _, state in servers:
            [init] = [body for kind, body in state.events if kind == "init_group"]
            assert init["world_size"] == 3 and init["backend"] == "gloo"
            assert init["group_name"] == sender.group_name
            assert [name for call in state.received for name, _, _ in call] == list(weights)
            assert state.weights.keys() == weights.keys()
            for name, tensor in weights.items():
                assert torch.equal(state.weights[name], tensor), name
            updates = [body for kind, body in state.events if kind == "update_distributed"]
            assert {u["load_format"] for u in updates} == {"flattened_bucket"}
            assert not any(u["flush_cache"] for u in updates)
            assert {u["weight_version"] for u in updates} == {"3"}
            assert state.weight_version == "3"
            assert _kinds(state) == [
                "begin_update",
                "init_group",
                *["update_distributed"] * 4,
                "end_update",
            ]
        assert sender.broadcasts == 4  # one flat broadcast per bucket, not one per tensor
        assert sender.update_calls == 2 * 4
        assert sender.bytes_sent == sum(t.numel() * t.element_size() for t in weights.values())
        # A second refit reuses the group.
        sender.send(((name, tensor + 1) for name, tensor in weights.items()), version=4)
        assert torch.equal(
            servers[0][1].weights["model.norm.weight"], weights["model.norm.weight"] + 1
        )
        assert sum(kind == "init_group" for kind, _ in servers[0][1].events) == 1
    finally:
        sender.close()
    assert all(not state.groups and not state.session_open for _, state in servers)


def test_the_next_bucket_is_cut_while_the_previous_one_is_on_the_wire(standins):
    """The caller's weights are taken one bucket ahead: a Megatron export of bucket k+1 and its
    copy into the other staging buffer overlap bucket k's broadcast."""
    [(url, state)] = standins(1)
    sender = _sender([url], bucket_bytes=600)  # 4 buckets, as in the test above
    finished_when_taken: dict[str, int] = {}

    def exported():
        for name, tensor in _state_dict().items():
            finished_when_taken[name] = sender.broadcasts
            yield name, tensor

    try:
        sender.send(exported(), version=1)
    finally:
        sender.close()
    # Buckets: embed | q_proj | layernorm | up_proj + norm. A bucket is known to be complete
    # when the first tensor of the next one arrives, so cutting bucket k+1 takes one tensor of
    # k+2; sending each bucket before cutting the next would give 0, 0, 1, 2, 3.
    assert finished_when_taken == {
        "model.embed_tokens.weight": 0,
        "model.layers.0.self_attn.q_proj.weight": 0,
        "model.layers.0.input_layernorm.weight": 0,  # cutting bucket 2 while 1 is on the wire
        "model.layers.0.mlp.up_proj.weight": 1,  # cutting bucket 3 while 2 is on the wire
        "model.norm.weight": 2,  # cutting bucket 4 while 3 is on the wire
    }
    assert sender.broadcasts == 4 and len(state.received) == 4


def test_every_update_runs_inside_a_weight_update_session(standins):
    [(url, state)] = standins(1)
    sender = _sender([url], bucket_bytes=1 << 20)
    try:
        sender.send(_state_dict().items(), version=1)
    finally:
        sender.close()
    assert _kinds(state) == [
        "begin_update",
        "init_group",
        *["update_distributed"] * 3,  # one bucket per dtype run: f32 | bf16 | f32
        "end_update",
        "destroy_group",
    ]
    assert not state.session_open


def test_engine_pauses_around_the_broadcast_and_resumes_generation(standins):
    [(url, state)] = standins(1, token_delay_s=0.02, flush_refusals=2)
    sender = _sender([url])
    request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=20))
    with SGLangEngine([url], request_timeout_s=10.0, refit_timeout_s=10.0) as engine:
        future = engine.submit(request)
        deadline = time.monotonic() + 10
        while state.tokens_sampled < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.begin_refit(1)
        # The scheduler refuses flushes for a while after the pause: an update asking for one
        # would fail although its weights loaded; the engine's flush retries instead.
        sender.send(_state_dict().items(), version=1)
        engine.end_refit(1)
        output = future.result(30)
        sender.close()
        assert engine.weight_version == 1
    assert _kinds(state) == [
        "pause",
        "begin_update",
        "init_group",
        *["update_distributed"] * 4,  # 1 KiB buckets: embed | q_proj | layernorm (bf16) | rest
        "end_update",
        *["flush"] * 3,  # refused twice, then flushed
        "continue",
        "destroy_group",
    ]
    assert len(output.token_ids) == 20  # resumed after the refit, under the new weights
    assert output.token_ids[-1] >= WEIGHT_OFFSET and output.token_ids[0] < WEIGHT_OFFSET
    assert output.weight_version == 0  # the oldest version that contributed tokens


def test_a_refused_group_is_a_clear_error_within_the_deadline(standins):
    [(url, state)] = standins(1)
    sender = WeightSender(
        [url], [1], master_address="127.0.0.1", backend="nccl", bucket_bytes=64, timeout_s=10.0
    )
    start = time.monotonic()
    # The stand-in refuses NCCL (no GPU), and so does this CPU build of torch: whichever end
    # says so first fails the refit, long before the rendezvous deadline.
    with pytest.raises(WeightSyncError, match=r"refused POST /init_weights_update_group|did not"):
        sender.send(_state_dict().items(), version=1)
    assert time.monotonic() - start < 5
    assert not sender.connected and not state.session_open  # the session was closed
    sender.close()


def test_a_broadcast_that_blocks_as_it_starts_fails_by_the_deadline(standins, monkeypatch):
    """NCCL creates its communicator at the first collective, which blocks until every rank
    joins: the deadline must already run then, or a server that never joins stalls rank 0."""
    [(url, _)] = standins(1)
    released = threading.Event()
    started = weight_sync.start_broadcast

    def blocks_until_released(group, tensor):
        if released.wait(30):
            return started(group, tensor)
        raise RuntimeError("the test released no broadcast")

    monkeypatch.setattr(weight_sync, "start_broadcast", blocks_until_released)
    sender = _sender([url], timeout_s=2.0)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"timeout_s=2\.0 s[\s\S]*did not finish"):
            sender.send(_state_dict().items(), version=1)
        assert time.monotonic() - start < 10
    finally:
        released.set()
        sender.close()


def test_a_server_that_never_answers_fails_by_the_deadline():
    # A listening socket that never answers: the session call times out.
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        sender = _sender([url], timeout_s=2.0)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"begin_weight_update|timed out"):
            sender.send(_state_dict().items(), version=1)
        assert time.monotonic() - start < 15
        sender.close()


def test_a_server_refusing_a_bucket_fails_the_refit_at_once_and_the_group_is_rebuilt(standins):
    """A server that lost its end of the group (restarted) refuses the bucket without joining
    the broadcast: the refit fails with its message instead of rank 0 waiting in a broadcast
    nobody completes, every server drops the group, and the next refit forms a new one."""
    (url_a, state_a), (url_b, state_b) = standins(2)
    sender = _sender([url_a, url_b], timeout_s=20.0)
    try:
        sender.send(_state_dict().items(), version=1)
        first_group = sender.group_name
        state_b.groups.clear()  # server b restarted
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"{url_b} refused .*not in") as refused:
            sender.send(_state_dict().items(), version=2)
        # b refused but is alive: the liveness probe says so (a dead one would be named).
        assert "every server still answers GET /get_model_info" in str(refused.value)
        assert time.monotonic() - start < 10  # not the 20 s broadcast deadline
        assert not sender.connected
        assert not state_a.groups, "the surviving server kept the failed group"
        assert not state_a.session_open and not state_b.session_open
        # A fresh group, a fresh name, while the error is still held (`refused`): the failed
        # broadcast's traceback must not keep the old group open, or server a waits on it until
        # the group's timeout and this rendezvous behind it (_broadcast_bucket).
        sender.send(_state_dict().items(), version=2)
        assert sender.group_name != first_group
        assert state_a.weight_version == state_b.weight_version == "2"
    finally:
        sender.close()


class _ResetOnce:
    """A server on loopback that resets its first connection after reading the request (as a
    socket closed under a request does) and refuses every later one with a message."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10.0)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._listener.accept()
                with connection:
                    connection.recv(65536)
                    self.connections += 1
                    if self.connections == 1:  # RST instead of FIN: close with linger 0
                        connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        continue
                    body = b'{"success": false, "message": "the second attempt arrived"}'
                    connection.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                    )

    def close(self):
        self._listener.close()


def test_a_session_call_whose_connection_breaks_is_sent_once_more():
    """A reset before any answer is not the server's verdict: the begin goes once more on a
    new connection, and what the server then says is the error."""
    server = _ResetOnce()
    sender = _sender([server.url])
    try:
        with pytest.raises(WeightSyncError, match="the second attempt arrived"):
            sender.send(_state_dict().items(), version=1)
        assert server.connections >= 2
    finally:
        sender.close()
        server.close()


def test_weights_are_read_back_after_the_first_refit(standins):
    weights = _state_dict()
    [(url, state)] = standins(1, model_weights={n: torch.zeros_like(t) for n, t in weights.items()})
    sender = _sender([url], check=_check(every=2))
    try:
        for version in (1, 2, 3):
            sender.send(weights.items(), version=version)
    finally:
        sender.close()
    read = [name for kind, name in state.events if kind == "get_weights"]
    # Refits 0 and 2 are checked: embedding, attention, norm (first and last) each time.
    per_check = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    assert read == per_check + per_check
    assert sender.check_seconds > 0


def test_a_tensor_the_server_skipped_stops_the_run_naming_it(standins):
    weights = _state_dict()
    model = {n: torch.zeros_like(t) for n, t in weights.items()}
    model["model.layers.0.self_attn.qkv_proj.weight"] = model.pop(
        "model.layers.0.self_attn.q_proj.weight"
    )
    [(url, state)] = standins(1, model_weights=model)
    sender = _sender([url], check=_check())
    try:
        with pytest.raises(WeightMismatchError, match=r"cannot show 'model\.layers\.0\.self_attn"):
            sender.send(weights.items(), version=1)
    finally:
        sender.close()
    assert state.skipped == ["model.layers.0.self_attn.q_proj.weight"]  # and it said success


def test_values_that_differ_stop_the_run_with_both_checksums(standins):
    weights = _state_dict()
    # The server's model holds the embedding in bfloat16: what it holds is rounded.
    model = {n: torch.zeros_like(t) for n, t in weights.items()}
    model["model.embed_tokens.weight"] = model["model.embed_tokens.weight"].bfloat16()
    [(url, _)] = standins(1, model_weights=model)
    sender = _sender([url], check=_check())
    sent = checksum(weights["model.embed_tokens.weight"][:4])
    try:
        with pytest.raises(
            WeightMismatchError,
            match=rf"'model\.embed_tokens\.weight'.*checksum sent {sent} \(shape \[4, 8\]\), held",
        ):
            sender.send(weights.items(), version=1)
    finally:
        sender.close()
    # Compared in the dtype the server holds (policy.dtype), the same values pass.
    del model["model.norm.weight"], model["model.layers.0.mlp.up_proj.weight"]
    model = {n: t.bfloat16() for n, t in model.items()}
    [(url, state)] = standins(1, model_weights=model)
    sender = _sender([url], check=_check(served_dtype=torch.bfloat16))
    try:
        with pytest.raises(WeightMismatchError, match=r"cannot show 'model\.norm\.weight'"):
            sender.send(weights.items(), version=1)  # the embedding, q_proj and layernorm pass
    finally:
        sender.close()
    assert [name for kind, name in state.events if kind == "get_weights"] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]


def test_the_group_meets_a_member_built_the_way_sglang_builds_its_end():
    """SGLang 0.5.23 joins with `init_custom_process_group`: a tcp:// rendezvous, the store
    prefixed with the group name, then torch's own group helper (which adds "<name>/" and
    "<device>/"). The trainer's end must rendezvous on the same keys."""
    from torch.distributed import distributed_c10d as c10d

    from gymrl.generation.sglang.weight_sync import broadcast, join_weight_update_group
    from nemo_gym_ext.ports import free_port

    port = free_port()
    received: dict[str, torch.Tensor] = {}

    def sglang_end() -> None:
        timeout = datetime.timedelta(seconds=20)
        store, _, _ = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
        store = c10d.PrefixStore("weight_update_group", store)
        group, _ = c10d._new_process_group_helper(
            2, 1, [], "gloo", store, group_name="weight_update_group", timeout=timeout
        )
        c10d._world.pg_group_ranks[group] = {0: 0, 1: 1}
        tensor = torch.zeros(4)
        torch.distributed.broadcast(tensor, src=0, group=group)
        received["tensor"] = tensor

    thread = threading.Thread(target=sglang_end, daemon=True)
    thread.start()
    group = join_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        backend="gloo",
        timeout_s=20.0,
        group_name="weight_update_group",
    )
    broadcast(group, [torch.arange(4.0)])
    thread.join(30)
    assert torch.equal(received["tensor"], torch.arange(4.0))


def test_the_broadcast_backend_follows_where_the_weights_live():
    """Both trainers (torch, Megatron) pick the weight-update group's backend this way: NCCL
    cannot send CPU tensors and gloo is the only one a CPU-only trainer has."""
    assert broadcast_backend("cuda") == broadcast_backend(torch.device("cuda", 1)) == "nccl"
    assert broadcast_backend("cpu") == broadcast_backend(torch.device("cpu")) == "gloo"
