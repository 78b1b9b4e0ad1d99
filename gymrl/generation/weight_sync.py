"""Weight sync to SGLang servers over a process group (NCCL on GPUs, gloo in the CPU tests).

A disk refit writes the whole checkpoint once and every server reads it back (about 61 GB per
step for a 30B model). With generation and training on separate GPUs, SGLang can instead join a
process group with the trainer and receive each tensor by broadcast
(`sglang/srt/entrypoints/http_server.py` of 0.5.23):

* `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}`: the server's TP ranks join the group as `rank_offset + tp_rank`;
  the trainer is rank 0. Every member blocks until all have joined, so the trainer creates its
  end while the requests are in flight.
* `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
  weight_version}`: the server allocates each named tensor and receives it by broadcast from
  rank 0, in the order of `names`, then loads the batch into the model; it answers
  `{success, message}` once every tensor arrived.
* `POST /destroy_weights_update_group {group_name}`.

:class:`WeightSender` is the trainer's end: it sends a state dict (Hugging Face names) in
buckets, each one call to every server plus one broadcast per tensor, so no server holds more
than a bucket of new weights besides its model. Pausing and resuming generation around it is the
engine's job (`SGLangEngine.refit_with`), as for a disk refit.

The trainer's end (:func:`join_weight_update_group`) is a TCP store at its address and a backend
process group made directly on it, so it is separate from any default process group the trainer
already has; its store keys carry the prefixes SGLang's end uses. The stand-in server of the
tests joins through the same function.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from gymrl.cluster.ports import free_port

GROUP_NAME = "weight_update_group"
Backend = Literal["nccl", "gloo"]


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

    def payload(self, *, last: bool, version: int) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "dtypes": [dtype_name(tensor.dtype) for tensor in self.tensors],
            "shapes": [list(tensor.shape) for tensor in self.tensors],
            "group_name": GROUP_NAME,
            # The prefix cache was computed by the old weights; emptying it once is enough.
            "flush_cache": last,
            "weight_version": str(version),
        }


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang turns back into a dtype with `getattr(torch, name)` ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[Bucket]:
    """`named_tensors` in their order, cut into buckets of at most `bucket_bytes` of one dtype.

    A tensor is never split (SGLang receives whole parameters); one larger than `bucket_bytes`
    travels alone. A dtype change starts a new bucket, so a server can allocate a bucket's
    tensors in one dtype. Order is the caller's (a state dict's), which both ends see the same.
    Lazy: a bucket is cut as soon as it is full, so a trainer that exports its weights one at a
    time (Megatron) holds at most two buckets of them (the sender looks one ahead).
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
    group_name: str = GROUP_NAME,
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


def broadcast(group: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0 in order (receivers pass buffers), then wait for all."""
    works = []
    for tensor in tensors:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        works.append(group.broadcast([tensor], options))
    for work in works:
        work.wait()


class WeightSender:
    """Rank 0 of the weight-update group: sends state dicts to SGLang servers by broadcast.

    `tp_sizes[i]` is server i's tensor-parallel size: its ranks are `1 + sum(tp_sizes[:i])` on.
    The group is created on the first :meth:`send`; a failed send destroys it, so the next send
    builds a new one (a restarted server has lost its end of the old group). Every HTTP call
    and the group's rendezvous and broadcasts end by `timeout_s`.
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
        self._bucket_bytes = bucket_bytes
        self._timeout_s = timeout_s
        self._group: Any = None
        self._pool = ThreadPoolExecutor(max_workers=len(self._urls), thread_name_prefix="refit")
        self._client = httpx.Client(timeout=timeout_s)
        self.bytes_sent = 0  # tensor bytes broadcast so far, for the benchmark and metrics

    @property
    def rank_offsets(self) -> list[int]:
        return list(self._rank_offsets)

    @property
    def connected(self) -> bool:
        return self._group is not None

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Send `named` (a state dict's items, or `(name, tensor)` pairs produced one at a
        time) to every server as weight version `version`, while generation is paused."""
        try:
            if self._group is None:
                self._group = self._connect()
            plan = buckets(named, self._bucket_bytes)
            bucket = next(plan, None)
            while bucket is not None:
                following = next(plan, None)  # one bucket ahead: the last one flushes the cache
                payload = bucket.payload(last=following is None, version=version)
                self._on_all("/update_weights_from_distributed", payload, bucket)
                self.bytes_sent += bucket.nbytes
                bucket = following
        except BaseException:
            self._drop_group()
            raise

    def _connect(self) -> Any:
        port = free_port()

        def payload(index: int) -> dict[str, Any]:
            return {
                "master_address": self._master_address,
                "master_port": port,
                "rank_offset": self._rank_offsets[index],
                "world_size": self._world_size,
                "group_name": GROUP_NAME,
                "backend": self._backend,
            }

        calls = self._start_all("/init_weights_update_group", payload)
        try:
            group = join_weight_update_group(
                master_address=self._master_address,
                master_port=port,
                rank=0,
                world_size=self._world_size,
                backend=self._backend,
                timeout_s=self._timeout_s,
            )
        except Exception as error:
            self._finish_all("/init_weights_update_group", calls, quiet=True)
            raise WeightSyncError(
                f"the weight-update group at {self._master_address}:{port} did not form within "
                f"{self._timeout_s} s (generation.refit.timeout_s): {error}; can every SGLang "
                "server reach the trainer's address?"
            ) from error
        self._finish_all("/init_weights_update_group", calls)
        return group

    def _on_all(self, route: str, payload: dict[str, Any], bucket: Bucket) -> None:
        """Post `route` to every server and broadcast the bucket while they receive it."""
        calls = self._start_all(route, lambda _: payload)
        assert self._group is not None
        device = "cuda" if self._backend == "nccl" else "cpu"
        try:
            broadcast(
                self._group, [tensor.detach().to(device).contiguous() for tensor in bucket.tensors]
            )
        except Exception as error:
            self._finish_all(route, calls, quiet=True)
            raise WeightSyncError(
                f"broadcasting {len(bucket.names)} tensors ({bucket.names[0]}...) failed: {error}"
            ) from error
        self._finish_all(route, calls)

    def _start_all(self, route: str, payload) -> list[Future[httpx.Response]]:
        return [
            self._pool.submit(self._client.post, f"{url}{route}", json=payload(index))
            for index, url in enumerate(self._urls)
        ]

    def _finish_all(
        self, route: str, calls: list[Future[httpx.Response]], *, quiet: bool = False
    ) -> None:
        failures: list[str] = []
        for url, call in zip(self._urls, calls, strict=True):
            try:
                response = call.result(self._timeout_s)
            except Exception as error:  # a timeout, a refused connection
                failures.append(f"{url}: {type(error).__name__}: {error}")
                continue
            body = (
                response.json()
                if response.headers.get("content-type", "").startswith("application/json")
                else {}
            )
            if response.status_code != 200 or not body.get("success"):
                failures.append(f"{url}: {response.status_code} {response.text[:300]}")
        if failures and not quiet:
            raise WeightSyncError(
                f"POST {route} failed on {len(failures)} of {len(self._urls)} servers: "
                f"{failures[0]}; generation stays paused (a restarted server rejoins the group "
                "at the next refit)"
            )

    def _drop_group(self) -> None:
        self._group = None  # gloo and NCCL members close when the last reference goes

    def close(self) -> None:
        """Tell every server to leave the group (best effort: a dead server has left it)."""
        if self._group is not None:
            calls = self._start_all(
                "/destroy_weights_update_group", lambda _: {"group_name": GROUP_NAME}
            )
            self._finish_all("/destroy_weights_update_group", calls, quiet=True)
            self._drop_group()
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
