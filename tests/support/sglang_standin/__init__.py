"""A loopback stand-in for an SGLang 0.5.23 server, for the CPU tests and the routing and refit
benchmarks.

The default test suite runs this small FastAPI server instead of SGLang: it starts in
milliseconds, needs no 6 GB venv, and is made to produce what the real server cannot be made to do
on this CPU or on demand: timed refusals, slow tokens and prefill, flush refusals, a request
landing between a refit's start and its pause, NCCL's refusal, a server that skips a tensor, a
compare that finds a difference (the real one's compare needs CUDA), thousands of requests for the
routing benchmark. What the real server shows here is tested against it
(`tests/gymrl/generation/sglang/test_real_server.py`, marker `sglang_cpu`), where a differential
test sends both the same requests and fails where status, keys or types differ; the stand-in keeps
no behaviour that no test uses. It implements the routes `gymrl.generation.sglang.engine` uses,
with SGLang's field names and rules, one module per concern, each naming the pinned server's
behaviours it reproduces:

* `generation.py`: `/generate`, pause and continue, `/flush_cache`;
* `refit.py`: weights from disk, the weight-update session and its broadcast group;
* `weights_checker.py`: the weights read back (`/get_weights_by_name`, `/weights_checker`);
* `adapters.py`: a LoRA run's adapters loaded from tensors and unloaded, and `/generate`'s
  `lora_path`;
* `wire.py`: the request bodies (SGLang's `GenerateReqInput`, `SamplingParams`, ...) and the
  answers' shapes; `state.py`: what a server holds, its radix cache, and the deterministic rule
  its "model" generates by;
* `app.py`: `make_standin`, the four sets of routes on one app over one state.
"""

from tests.support.sglang_standin.app import make_standin
from tests.support.sglang_standin.state import WEIGHT_OFFSET, StandInState

__all__ = ["WEIGHT_OFFSET", "StandInState", "make_standin"]
