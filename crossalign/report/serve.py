"""The run store over HTTP, read-only: what the report links and plots in the Prefect UI open.

Starlette's StaticFiles under uvicorn, both installed with Prefect. StaticFiles answers GET and
HEAD only, normalises the path (``..`` and its percent-encoded forms, which uvicorn decodes first)
and resolves symlinks before it checks that the file lies inside the store, so nothing outside
the store can be read whatever the URL.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def store_url(base_url: str | None, root: Path, path: Path) -> str | None:
    """The URL of ``path`` on the report server publishing ``root`` at ``base_url`` (None: no server, or outside)."""
    if base_url is None:
        return None
    try:
        relative = Path(path).absolute().relative_to(Path(root).expanduser().absolute())
    except ValueError:
        return None
    return base_url.rstrip("/") + "/" + quote(relative.as_posix())


def store_app(root: Path):
    """The ASGI app serving the files under ``root`` (a Starlette app, which turns refusals into 404/405)."""
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: the run store does not exist")
    return Starlette(routes=[Mount("/", app=StaticFiles(directory=root, follow_symlink=False))])


def serve(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (SIGINT or SIGTERM)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
