"""`mmferry proxy`: the encode/prefill/decode front in front of vLLM.

`Router` (router.py) is pure and imports nothing else, so an engine's own router or connector
can use it; `create_app` (app.py) is the ASGI app, needing the `server` extra.
"""

from __future__ import annotations

from mmferry.proxy.router import Router

__all__ = ["Router"]
