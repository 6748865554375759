"""The paths clients actually use, mapped onto the routes the app declares, before anything
else sees the request (so auth, the Host check and the metrics all see the canonical path).

- A trailing slash is dropped rather than answered with a 307: many clients do not follow a
  redirect on a POST, or follow it with a GET.
- The OpenAI routes answer without the `/v1` prefix too (llama-server serves both), for clients
  configured with a base URL that lacks it.
- `/v1/health` is `/health`.
- llama-server's native routes answer under `/v1` too (llama-server itself does not serve
  them there): Continue's llama.cpp provider posts to `new URL("completion", apiBase)`, which
  is `/v1/completion` for a user who set the base URL to the OpenAI one.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

WITHOUT_V1 = frozenset({"/completions", "/chat/completions", "/models", "/embeddings",
                        "/responses"})
NATIVE = frozenset({"/completion", "/infill", "/apply-template", "/tokenize", "/detokenize"})


def canonical(path: str) -> str:
    if len(path) > 1:
        path = path.rstrip("/") or "/"
    if path == "/v1/health":
        return "/health"
    if path.startswith("/v1/") and path[3:] in NATIVE:
        return path[3:]
    if path in WITHOUT_V1 or path.startswith("/models/"):
        return "/v1" + path
    return path


class PathAliases:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = canonical(scope["path"])
            if path != scope["path"]:
                scope = dict(scope, path=path, raw_path=path.encode())
        await self.app(scope, receive, send)
