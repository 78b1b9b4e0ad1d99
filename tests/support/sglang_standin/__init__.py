"""A loopback stand-in for an SGLang 0.5.23 server (`app.py` says what it reproduces)."""

from tests.support.sglang_standin.app import WEIGHT_OFFSET, make_standin

__all__ = ["WEIGHT_OFFSET", "make_standin"]
