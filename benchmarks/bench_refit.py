"""Seconds and bytes per refit of SGLang stand-ins: disk (safetensors) vs broadcast (gloo).

SmolLM2-135M-Instruct's weights (fp32, as the torch trainer holds them) go to `--servers`
loopback stand-ins (`tests/support/sglang_standin/`) either way:

* disk: `SGLangEngine.update_weights` writes one safetensors file, every stand-in reads it back
  (`/update_weights_from_disk`), the previous version is deleted;
* broadcast: `SGLangEngine.begin_refit`, `WeightSender.send` (the 0.5.23 protocol: session,
  buckets of `--bucket-mib` each sent as one flattened gloo broadcast, session end),
  `SGLangEngine.end_refit`; then one refit with the read-back check (`verify_method: read_back`,
  `ReadBackCheck` at the config's defaults: `generation.refit.verify_rows` rows of the first and
  last tensor of each kind from every stand-in), whose extra seconds are its cost. The engine has
  no weights checker (the default method), whose cost is SGLang's GPU work, not the stand-ins'.

Both senders are the trainer's own (`gymrl.generation.sglang.refit.weight_sender`), from a
`RefitConfig` at its defaults but for the bucket size and the check, so the bench measures what
a run sends.

Each refit includes the pause, flush and continue calls. The first broadcast refit forms the
group and is reported apart; broadcast calls, update calls and bytes are counted by the sender.
Servers and trainer share this process and its CPUs.

    PYTHONPATH=. python benchmarks/bench_refit.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gymrl.config.schema.generation import RefitConfig
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.refit import weight_sender
from gymrl.generation.sglang.weight_sync import WeightSender
from gymrl.model.loading import ensure_smollm2_checkpoint, load_pretrained
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin


def _sender(urls: list[str], bucket_bytes: int, *, read_back: bool) -> WeightSender:
    """The trainer's sender over gloo to stand-ins of TP 1, which hold the fp32 weights as sent."""
    refit = RefitConfig(
        bucket_bytes=bucket_bytes, verify_weights=read_back, verify_method="read_back"
    )
    return weight_sender(
        urls,
        [1] * len(urls),
        refit,
        master_address="127.0.0.1",
        backend="gloo",
        served_dtype="float32",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/gym-grpo-recipes/models").expanduser()
    )
    args = parser.parse_args()

    model = load_pretrained(ensure_smollm2_checkpoint(args.cache_dir), torch.float32)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    print(f"{len(weights)} tensors, {size / 2**20:.0f} MiB, {args.servers} servers")

    servers = [serve_in_thread(make_standin()[0]) for _ in range(args.servers)]
    urls = [server.url for server in servers]
    try:
        with tempfile.TemporaryDirectory() as refit_dir:
            engine = SGLangEngine(
                urls, request_timeout_s=60.0, refit_timeout_s=600.0, refit_dir=refit_dir
            )
            disk = []
            for version in range(1, args.repeats + 1):
                start = time.perf_counter()
                engine.update_weights(weights, version)
                disk.append(time.perf_counter() - start)
            unchecked = _sender(urls, args.bucket_mib << 20, read_back=False)
            broadcast = []
            for version in range(args.repeats + 1, 2 * args.repeats + 2):
                start = time.perf_counter()
                engine.begin_refit(version)
                unchecked.send(weights.items(), version)
                engine.end_refit(version)
                broadcast.append(time.perf_counter() - start)
            refits = len(broadcast)
            calls, updates = unchecked.broadcasts / refits, unchecked.update_calls / refits
            unchecked.close()
            checked = _sender(urls, args.bucket_mib << 20, read_back=True)
            version = 2 * args.repeats + 2
            engine.begin_refit(version)
            checked.send(weights.items(), version)  # forms its group, then reads back
            engine.end_refit(version)
            check_s = checked.check_seconds
            checked.close()
            engine.close()
    finally:
        for server in servers:
            server.close()

    print(
        f"disk:      {statistics.median(disk):.2f} s/refit (median of {len(disk)}); bytes "
        f"{size / 2**20:.0f} MiB written + {args.servers} x {size / 2**20:.0f} MiB read"
    )
    print(
        f"broadcast: {statistics.median(broadcast[1:]):.2f} s/refit (median of "
        f"{len(broadcast) - 1}; the first, forming the group: {broadcast[0]:.2f} s); bytes "
        f"{args.servers} x {size / 2**20:.0f} MiB over loopback TCP, nothing on disk; "
        f"{calls:.0f} broadcast calls and {updates:.0f} update calls per refit"
    )
    print(f"read-back check after a refit: {check_s:.3f} s")


if __name__ == "__main__":
    main()
