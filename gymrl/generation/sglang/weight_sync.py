"""Weight sync to SGLang servers over a process group (NCCL on GPUs, gloo in the CPU tests).

A disk refit writes the whole checkpoint once and every server reads it back (about 61 GB per
step for a 30B model). With generation and training on separate GPUs, SGLang can instead join a
process group with the trainer and receive the weights by broadcast. The protocol of the pinned
SGLang 0.5.23 (`sglang/srt/entrypoints/http_server.py`, the scheduler's
`scheduler_components/weight_updater.py`, `model_runner_components/weight_updater.py`), one
refit, generation already paused by the engine (`SGLangEngine.begin_refit`):

1. `POST /begin_weight_update {}` on every server: opens the weight-update session. Outside a
   session `/update_weights_from_distributed` answers `success: false` and never joins the
   broadcast.
2. Once per connection, `POST /init_weights_update_group {master_address, master_port,
   rank_offset, world_size, group_name, backend}`: the server's TP ranks join as
   `rank_offset + tp_rank`; the trainer is rank 0. Each connection has a fresh `group_name`, so a
   group a failed refit left on a server can never block the next one (torch refuses a name in
   use).
3. Per bucket, `POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
   load_format: "flattened_bucket", flush_cache: false, weight_version}`: the server allocates
   one flat byte buffer for the bucket, receives it in one broadcast from rank 0, cuts it back
   into tensors (`FlattenedTensorBucket`) and loads them; it answers `{success, message}`. The
   cache is not flushed here: a flush the scheduler refuses (requests not yet gone after the
   pause) fails the whole call although the weights loaded, so the engine flushes once, with
   retries, in `end_refit`.
4. `POST /end_weight_update {}` on every server, also after a failure (a session left open makes
   the next `/begin_weight_update` fail).

Every answer is read while the broadcast runs, so a server that refuses (or dies) fails the
refit with its own message at once instead of leaving rank 0 in a broadcast nobody joins; a
server that does not answer fails it at `timeout_s`. After any failure the group is destroyed on
every server (`/destroy_weights_update_group`) and the trainer's end is aborted, so the next refit
connects afresh. Buckets go one at a time: SGLang serialises update calls behind one lock in
arrival order, and two calls in flight to one server could be served in the other order than
their broadcasts, so a bucket's call is posted only once the previous one was answered. While a
bucket is on the wire, the next one is taken from the caller's weights (a Megatron trainer
exports it then) and flattened into the other of two staging buffers, so copying overlaps
sending.

The staging buffers are kept from bucket to bucket, and on the CPU from refit to refit: a fresh
host buffer is faulted in page by page on first write, which cost more than the copy itself in
the gloo measurements (benchmarks/README.md, "Flattened buckets"). On a GPU they are released
after each refit: the caching allocator hands the same memory back to the next one, and in
between training can use it.

The trainer's end (:func:`join_weight_update_group`) is a TCP store at its address and a backend
process group made directly on it, so it is separate from any default process group the trainer
already has; its store keys carry the prefixes SGLang's end uses. The stand-in server of the
tests joins through the same function. After a refit that
:class:`~gymrl.generation.sglang.refit_checks.read_back.ReadBackCheck` says is due, samples of what
was sent are read back from every server.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import numpy as np
import orjson
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from gymrl.generation.sglang.refit_checks.read_back import ReadBackCheck, WeightSamples
from nemo_gym_ext.keep_alive import CLIENT_KEEPALIVE_EXPIRY_S
from nemo_gym_ext.ports import free_port

Backend = Literal["nccl", "gloo"]
FLATTENED_BUCKET = "flattened_bucket"
# SGLang sets these two in its own processes unless the environment already has them
# (`_set_envs_and_config` in sglang/srt/entrypoints/engine.py of 0.5.23). The trainer's
# weight-sync rank joins the same communicator, so both sides get them from here: the servers'
# environment (`SGLangServerProcess`) and every trainer rank's (`gymrl.roles.trainer`).
WEIGHT_SYNC_NCCL_ENV: Mapping[str, str] = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
_POLL_S = 0.002
_CLEANUP_TIMEOUT_S = 10.0  # destroying a failed group is best effort, never another long wait
_LIVENESS_PROBE_S = 2.0  # after a failed refit, how long each server has to say it is alive
LIVENESS_ROUTE = "/get_model_info"  # answered by SGLang's front end without generating
_REFUSAL_GRACE_S = 2.0  # after a broken broadcast, how long the servers' answers may take
_connection_numbers = itertools.count()


class WeightSyncError(RuntimeError):
    """A server refused or did not answer a weight-sync call, or the broadcast failed."""


@dataclass(frozen=True)
class Bucket:
    """Tensors sent in one `/update_weights_from_distributed` call, all of one dtype."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def payload(self, *, group_name: str, version: int) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "dtypes": [dtype_name(tensor.dtype) for tensor in self.tensors],
            "shapes": [list(tensor.shape) for tensor in self.tensors],
            "group_name": group_name,
            "load_format": FLATTENED_BUCKET,
            "flush_cache": False,  # the engine flushes once, with retries, in end_refit
            "weight_version": str(version),
        }

    def flattened(self, staging: torch.Tensor) -> torch.Tensor:
        """The bucket as one byte tensor on `staging`'s device, tensors back to back in order:
        SGLang's `FlattenedTensorBucket` layout, which the server cuts back by names, dtypes and
        shapes. One dtype per bucket keeps every tensor's offset aligned to its element size.

        Several tensors are copied into the front of `staging` (a byte tensor of at least
        `nbytes`, which the sender reuses for bucket after bucket); a lone tensor is sent as its
        own bytes, without a copy, and may be larger than `staging`."""
        if len(self.tensors) == 1:
            return _as_bytes(self.tensors[0].detach().to(staging.device))
        flat = staging[: self.nbytes]
        offset = 0
        for tensor in self.tensors:
            data = _as_bytes(tensor.detach())
            _copy(flat[offset : offset + data.numel()], data)
            offset += data.numel()
        return flat


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target[:] = source`; between host tensors one thread's memcpy (numpy's, without the GIL).

    torch splits a large host copy over its OpenMP threads, which meet at a barrier after each
    tensor; while the previous bucket is on the wire, gloo's threads hold the cores those
    threads wait for. On 2 shared cores that made the copy of 621 MiB take 0.5-2.8 s against
    0.1-0.3 s on one thread, which copies as fast as two there (memory-bound).
    """
    if target.device.type == "cpu" and source.device.type == "cpu":
        np.copyto(target.numpy(), source.numpy())
    else:
        target.copy_(source)


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang turns back into a dtype with `getattr(torch, name)` ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[Bucket]:
    """`named_tensors` in their order, cut into buckets of at most `bucket_bytes` of one dtype.

    A tensor is never split (SGLang receives whole parameters); one larger than `bucket_bytes`
    travels alone. A dtype change starts a new bucket. Order is the caller's (a state dict's).
    Lazy: a bucket is cut as soon as it is full, so a trainer that exports its weights one at a
    time (Megatron) holds at most two buckets of them (the one sent and the one being cut).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in the state dict to send")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if tensors and (tensor.dtype != tensors[0].dtype or size + nbytes > bucket_bytes):
            yield Bucket(names, tensors)
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(tensor)
        size += nbytes
    if tensors:
        yield Bucket(names, tensors)


def join_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: Backend,
    timeout_s: float,
    group_name: str,
) -> Any:
    """This process's member of the weight-update group (rank 0 hosts the store).

    Blocks until all `world_size` members have joined, or `timeout_s`. The result is a backend
    process group (`ProcessGroupGloo` or `ProcessGroupNCCL`), used through :func:`broadcast`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    # The key prefixes SGLang's end puts on the store (`init_custom_process_group` prefixes it
    # with the group name, torch's `_new_process_group_helper` with "<group name>/" and
    # "<device>/"), so both ends' backends meet on the same keys.
    device = "cpu" if backend == "gloo" else "cuda"
    prefixed = PrefixStore(
        f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def start_broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from rank 0 (receivers pass a buffer); returns its work."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def broadcast(group: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0 in order, then wait for all."""
    works = [start_broadcast(group, tensor) for tensor in tensors]
    for work in works:
        work.wait()


def fresh_group_name() -> str:
    """A group name no earlier connection of this process (or another trainer) used."""
    return f"gymrl_refit_{os.getpid()}_{next(_connection_numbers)}_{time.time_ns()}"


class WeightSender:
    """Rank 0 of the weight-update group: sends state dicts to SGLang servers by broadcast.

    `tp_sizes[i]` is server i's tensor-parallel size: its ranks are `1 + sum(tp_sizes[:i])` on.
    The group is created on the first :meth:`send` and kept while refits succeed; a failed one
    destroys it everywhere, so the next send connects afresh. Every HTTP call and the group's
    rendezvous and broadcasts end by `timeout_s`.
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        tp_sizes: Sequence[int],
        *,
        master_address: str,
        backend: Backend,
        bucket_bytes: int,
        timeout_s: float,
        check: ReadBackCheck | None = None,
    ) -> None:
        if len(server_urls) != len(tp_sizes) or not server_urls:
            raise ValueError(
                f"need one tp size per server URL, got {len(server_urls)} URLs and tp_sizes "
                f"{list(tp_sizes)}"
            )
        if bucket_bytes <= 0 or timeout_s <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} and timeout_s={timeout_s} must be > 0")
        self._urls = [url.rstrip("/") for url in server_urls]
        offsets = [1]
        for size in tp_sizes[:-1]:
            offsets.append(offsets[-1] + size)
        self._rank_offsets = offsets
        self._world_size = 1 + sum(tp_sizes)
        self._master_address = master_address
        self._backend: Backend = backend
        self._device = "cuda" if backend == "nccl" else "cpu"
        self._bucket_bytes = bucket_bytes
        self._timeout_s = timeout_s
        self._check = check
        self._group: Any = None
        self._group_name = ""
        # Two byte buffers of bucket_bytes, used in turn (see the module docstring).
        self._staging: list[torch.Tensor | None] = [None, None]
        # One thread per server for its HTTP call, plus one for the rendezvous or a broadcast.
        self._pool = ThreadPoolExecutor(max_workers=len(self._urls) + 1, thread_name_prefix="refit")
        self._client = httpx.Client(
            timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
        )
        self._refits = 0
        # For the benchmark and metrics: tensor bytes, broadcast calls, update calls so far.
        self.bytes_sent = 0
        self.broadcasts = 0
        self.update_calls = 0
        self.check_seconds = 0.0  # time spent reading weights back

    @property
    def rank_offsets(self) -> list[int]:
        return list(self._rank_offsets)

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def group_name(self) -> str:
        return self._group_name

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send `named` (a state dict's items, or `(name, tensor)` pairs produced one at a
        time) to every server as weight version `version`, while generation is paused; then
        read samples back when this refit's check is due."""
        samples = self._check.samples(self._refits) if self._check is not None else None
        self._call_all("/begin_weight_update", lambda _: {})
        try:
            self._send_in_session(named, version, samples)
        except WeightSyncError as error:
            self._disconnect()
            self._end_session(quiet=True)
            raise WeightSyncError(f"{error}; {self._liveness()}") from error
        except BaseException:
            self._disconnect()
            self._end_session(quiet=True)
            raise
        finally:
            if self._device != "cpu":
                self._staging = [None, None]  # back to the caching allocator until next time
        self._end_session(quiet=False)
        self._refits += 1
        if samples is not None and self._check is not None:
            start = time.perf_counter()
            self._check.verify(self._client, self._urls, samples)
            self.check_seconds += time.perf_counter() - start

    def _liveness(self) -> str:
        """Which servers still answer at all, asked after a failed refit: a refusal or a
        broken broadcast can surface at a server that is fine (its peer in the group died), so
        the one that is gone is named here. `GET LIVENESS_ROUTE` is answered by the server's
        front end without generating (its `/health` generates a token, which a paused server
        does not), each within `_LIVENESS_PROBE_S`."""
        gone = []
        for url in self._urls:
            try:
                answered = self._client.get(f"{url}{LIVENESS_ROUTE}", timeout=_LIVENESS_PROBE_S)
                alive = answered.status_code == 200
            except httpx.HTTPError:
                alive = False
            if not alive:
                gone.append(url)
        if not gone:
            return f"every server still answers GET {LIVENESS_ROUTE}"
        return f"servers that no longer answer GET {LIVENESS_ROUTE}: {', '.join(gone)}"

    def _send_in_session(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        samples: WeightSamples | None,
    ) -> None:
        if self._group is None:
            self._connect()
        plan = buckets(named, self._bucket_bytes)
        slot = 0
        current = self._cut(plan, slot)
        while current is not None:
            bucket, flat = current
            if samples is not None:
                samples.offer(bucket.names, bucket.tensors)
            calls, work = self._start_bucket(bucket, flat, version)
            slot = 1 - slot
            following = self._cut(plan, slot)  # while this bucket is on the wire
            self._await("/update_weights_from_distributed", calls, work, what=bucket.names[0])
            self.broadcasts += 1
            self.update_calls += len(self._urls)
            self.bytes_sent += bucket.nbytes
            current = following

    def _start_bucket(
        self, bucket: Bucket, flat: torch.Tensor, version: int
    ) -> tuple[list[Future[httpx.Response]], Any]:
        """Post the bucket's update call to every server and start its broadcast."""
        payload = bucket.payload(group_name=self._group_name, version=version)
        calls = self._start_all("/update_weights_from_distributed", lambda _: payload)
        # On a pool thread, so the deadline runs from here: NCCL creates its communicator at
        # the first collective, and that blocks until every rank joins, which a server that
        # refused the bucket never does.
        return calls, self._pool.submit(_broadcast_bucket, self._group, flat)

    def _cut(self, plan: Iterator[Bucket], slot: int) -> tuple[Bucket, torch.Tensor] | None:
        """The next bucket of `plan` and its bytes in staging buffer `slot`; None at the end."""
        bucket = next(plan, None)
        if bucket is None:
            return None
        staging = self._staging[slot]
        if staging is None:
            staging = torch.empty(self._bucket_bytes, dtype=torch.uint8, device=self._device)
            self._staging[slot] = staging
        return bucket, bucket.flattened(staging)

    def _connect(self) -> None:
        port = free_port()
        name = fresh_group_name()

        def payload(index: int) -> dict[str, Any]:
            return {
                "master_address": self._master_address,
                "master_port": port,
                "rank_offset": self._rank_offsets[index],
                "world_size": self._world_size,
                "group_name": name,
                "backend": self._backend,
            }

        self._group_name = name  # so a failure from here on destroys it on the servers
        calls = self._start_all("/init_weights_update_group", payload)
        joining = self._pool.submit(
            join_weight_update_group,
            master_address=self._master_address,
            master_port=port,
            rank=0,
            world_size=self._world_size,
            backend=self._backend,
            timeout_s=self._timeout_s,
            group_name=name,
        )
        self._await("/init_weights_update_group", calls, joining, what=name)
        self._group = joining.result()

    def _await(self, route: str, calls: list[Future[httpx.Response]], work: Any, *, what: str):
        """Until every server answered `route` successfully and `work` (a broadcast, or the
        rendezvous) finished; the first refusal, or the deadline, is a WeightSyncError."""
        deadline = time.monotonic() + self._timeout_s
        pending = dict(zip(self._urls, calls, strict=True))
        work_done = False
        while True:
            self._raise_refusal(route, what, pending)
            if not work_done:
                try:
                    work_done = _finished(work, route, what)
                except WeightSyncError as broken:
                    # A server that refuses may drop its end of the group first, so the
                    # broadcast can break before its answer arrives; the refusal is the cause.
                    self._raise_refusal(route, what, pending, grace_s=_REFUSAL_GRACE_S)
                    if pending:  # the servers still inside the call: where to look first
                        raise WeightSyncError(
                            f"{broken}; servers not answering: {', '.join(sorted(pending))}"
                        ) from broken
                    raise broken
            if work_done and not pending:
                return
            if time.monotonic() > deadline:
                silent = sorted(pending) or ["(every server answered)"]
                stage = (
                    "the rendezvous" if route == "/init_weights_update_group" else "the broadcast"
                )
                raise WeightSyncError(
                    f"POST {route} ({what}) did not finish within generation.refit.timeout_s="
                    f"{self._timeout_s} s: servers not answering: {', '.join(silent)}; "
                    f"{stage} {'finished' if work_done else 'did not finish'} (can every "
                    "SGLang server reach the trainer's address?)"
                )
            time.sleep(_POLL_S)

    @staticmethod
    def _raise_refusal(
        route: str, what: str, pending: dict[str, Future[httpx.Response]], grace_s: float = 0.0
    ) -> None:
        """Raise the first refusal among the finished `pending` calls (removing the finished
        ones), waiting up to `grace_s` for one to finish."""
        if grace_s > 0 and pending:
            wait(pending.values(), timeout=grace_s)
        for url, call in list(pending.items()):
            # A call that timed out is a silent server, not a refusal: the deadline names it.
            if call.done() and not isinstance(call.exception(), httpx.TimeoutException):
                del pending[url]
                failure = _failure(call)
                if failure is not None:
                    raise WeightSyncError(
                        f"SGLang server {url} refused POST {route} ({what}): {failure}; "
                        "the refit failed and generation stays paused"
                    )

    def _start_all(
        self, route: str, payload: Callable[[int], dict[str, Any]]
    ) -> list[Future[httpx.Response]]:
        return [
            self._pool.submit(self._post, f"{url}{route}", payload(index))
            for index, url in enumerate(self._urls)
        ]

    def _post(self, url: str, payload: dict[str, Any], timeout_s: float | None = None):
        return self._client.post(
            url,
            content=orjson.dumps(payload),
            headers={"content-type": "application/json"},
            timeout=self._timeout_s if timeout_s is None else timeout_s,
        )

    def _post_session(self, url: str, payload: dict[str, Any]) -> httpx.Response:
        """A session call (begin or end), sent once more on a fresh connection when the
        connection broke before any answer (a server that closed or restarted while the pooled
        connection sat idle: seen on a loaded machine as "Connection reset by peer" on the begin
        after a failed refit). A second begin that the server already took is refused with its
        message, never a hang."""
        try:
            return self._post(url, payload)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            return self._post(url, payload)

    def _call_all(self, route: str, payload: Callable[[int], dict[str, Any]]) -> None:
        calls = [
            self._pool.submit(self._post_session, f"{url}{route}", payload(index))
            for index, url in enumerate(self._urls)
        ]
        self._await(route, calls, None, what="session")

    def _end_session(self, *, quiet: bool) -> None:
        try:
            self._call_all("/end_weight_update", lambda _: {})
        except WeightSyncError:
            if not quiet:
                raise

    def _disconnect(self) -> None:
        """Destroy the group on every server that may hold it and abort the trainer's end."""
        if not self._group_name:
            return
        body = {"group_name": self._group_name}
        calls = [
            self._pool.submit(
                self._post, f"{url}/destroy_weights_update_group", body, _CLEANUP_TIMEOUT_S
            )
            for url in self._urls
        ]
        for call in calls:
            with contextlib.suppress(Exception):  # best effort: a dead server has no group left
                call.result(_CLEANUP_TIMEOUT_S + 1.0)
        if self._group is not None:
            # A broadcast still pending on it ends at the group's own timeout; nothing here
            # waits for it. Best effort: the group is dropped either way.
            with contextlib.suppress(Exception):
                self._group.abort()
        self._group = None
        self._group_name = ""

    def close(self) -> None:
        """Tell every server to leave the group (best effort: a dead server has left it)."""
        if self._group is not None:
            self._disconnect()
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _broadcast_bucket(group: Any, flat: torch.Tensor) -> None:
    """Broadcast one bucket from rank 0 and wait for it (on a pool thread).

    A failure is raised as text only, with the group already let go: a traceback holding this
    frame would keep the group alive for as long as anyone keeps the error (a caller that logs
    or stores it), and a group alive at rank 0 keeps its connections open, so a server still
    inside the broadcast waits on them until the group's timeout instead of failing at once,
    and the next refit's rendezvous waits behind it."""
    failure = _broadcast_and_wait(group, flat)
    del group, flat
    if failure is not None:
        raise RuntimeError(failure)


def _broadcast_and_wait(group: Any, flat: torch.Tensor) -> str | None:
    """None once the broadcast finished; what failed it otherwise."""
    try:
        work = start_broadcast(group, flat)
        work.wait()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _finished(work: Any, route: str, what: str) -> bool:
    """Whether `work` (None, a torch Work, or a Future: the rendezvous, or a bucket's broadcast)
    finished; its failure is raised."""
    if work is None:
        return True
    if isinstance(work, Future):
        if not work.done():
            return False
        error = work.exception()
        if error is None:
            return True
        if route == "/init_weights_update_group":
            raise WeightSyncError(
                f"the weight-update group {what} did not form: {error}; can every SGLang "
                "server reach the trainer's address?"
            ) from error
        raise WeightSyncError(f"the broadcast for POST {route} ({what}) failed: {error}") from error
    if not work.is_completed():
        return False
    try:
        work.wait()  # finished: returns at once, or raises what failed it
    except Exception as error:
        raise WeightSyncError(f"the broadcast for POST {route} ({what}) failed: {error}") from error
    return True


def _failure(call: Future[httpx.Response]) -> str | None:
    """Why a finished HTTP call failed (a transport error, a status, `success: false`), or None."""
    error = call.exception()
    if error is not None:
        return f"{type(error).__name__}: {error}"
    response = call.result()
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = None
    if response.status_code == 200 and isinstance(body, dict) and body.get("success"):
        return None
    message = body.get("message") if isinstance(body, dict) else None
    return f"{response.status_code} {message or response.text[:300]!r}"
