"""Run by every Python that has this folder on its PYTHONPATH, which only the real SGLang servers
started on a CPU have (`generation=sglang_cpu` puts it in `generation.launch.env`): the MoE path's
CPU stand-ins (`sglang_moe_on_cpu.py`), each applied when SGLang imports the module it replaces."""

import sglang_moe_on_cpu

sglang_moe_on_cpu.install()
