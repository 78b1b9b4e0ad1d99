"""Run by every Python that has this folder on its PYTHONPATH, which only the real SGLang servers
the tests start on a CPU have (`real_sglang.kernel_standin_on_path`): the MoE path's CPU
stand-ins (`sglang_moe_on_cpu.py`), each applied when SGLang imports the module it replaces."""

import sglang_moe_on_cpu

sglang_moe_on_cpu.install()
