"""`mmferry proxy`: the encode/prefill/decode front in front of vLLM.

`Router` (defined in `mmferry.routing`, below both the proxy and vLLM's connector) is pure and
imports nothing else, so an engine's own router or connector can use it; `create_app` (app.py) is
the ASGI app, needing the `server` extra.
"""

from __future__ import annotations

from mmferry.routing import Router

__all__ = ["Router"]
