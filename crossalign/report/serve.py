"""The run store over HTTP, read-only: what the report links and plots in the Prefect UI open.

Starlette's StaticFiles under uvicorn, both installed with Prefect. StaticFiles answers GET and
HEAD only, normalises the path (``..`` and its percent-encoded forms, which uvicorn decodes first)
and resolves symlinks before it checks that the file lies inside the store, so nothing outside
the store can be read whatever the URL. On top of it: the root lists the runs (newest first,
with their verdicts and reports), a folder lists its entries (those StaticFiles would serve),
and logs, JSON, CSV and markdown are sent as text/plain, which browsers show instead of
downloading.
"""

from __future__ import annotations

import html
import os
import stat
from pathlib import Path
from urllib.parse import quote
from crossalign.store import RunStore, read_json

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


# shown in the browser rather than downloaded (text/markdown and application/json often are)
TEXT_SUFFIXES = (".log", ".json", ".csv", ".md", ".txt", ".yaml", ".yml", ".sh")


def _page(title: str, body: str) -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title><style>"
            "body{font-family:sans-serif;margin:2em}td,th{padding:2px 12px;text-align:left}"
            ".pass{color:#1a7f37}.fail{color:#cf222e}.invalid{color:#9a6700}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{body}</body></html>")


def _link(relative: str, text: str) -> str:
    return f"<a href='/{quote(relative)}'>{html.escape(text)}</a>"


def runs_index(root: Path) -> str:
    """The root page: every run of the store, newest first, with its verdict and a link to its report."""
    rows = []
    for run in RunStore(root).runs():
        try:
            created = run.info.get("created", "")
        except (OSError, ValueError):
            created = ""
        summary = run.path / "06-compare" / "summary.json"
        verdict = ""
        if (run.path / "06-compare" / "manifest.json").exists() and summary.exists():
            try:
                verdict = str(read_json(summary).get("verdict", ""))
            except (OSError, ValueError):
                verdict = "?"
        report = run.path / "06-compare" / "report.html"
        rows.append((created, run.run_id, verdict, report.exists()))
    rows.sort(reverse=True)
    body = "<table><tr><th>run</th><th>started</th><th>verdict</th><th>report</th></tr>" + "".join(
        f"<tr><td>{_link(run_id + '/', run_id)}</td><td>{html.escape(created[:19].replace('T', ' '))}</td>"
        f"<td class='{html.escape(verdict)}'>{html.escape(verdict or 'not compared yet')}</td>"
        f"<td>{_link(f'{run_id}/06-compare/report.html', 'report') if has_report else ''}</td></tr>"
        for created, run_id, verdict, has_report in rows) + "</table>"
    return _page(f"runs in {root}", body if rows else "<p>no runs yet</p>")


def store_app(root: Path):
    """The ASGI app serving ``root`` (a Starlette app, which turns refusals into 404/405)."""
    # the web stack: only `crossalign serve` needs it
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: the run store does not exist")

    class StoreFiles(StaticFiles):
        async def get_response(self, path: str, scope):
            if scope["method"] not in ("GET", "HEAD"):
                raise HTTPException(status_code=405, headers={"Allow": "GET, HEAD"})
            if path == ".":
                return HTMLResponse(runs_index(root))
            full_path, found = self.lookup_path(path)  # the store's own check: nothing outside it
            if found is not None and stat.S_ISDIR(found.st_mode):
                return HTMLResponse(self.listing(path, Path(full_path)))
            return await super().get_response(path, scope)

        def listing(self, path: str, folder: Path) -> str:
            entries = []
            for entry in sorted(folder.iterdir()):
                relative = f"{path}/{entry.name}"
                inside, found = self.lookup_path(relative)
                if found is None:  # a link out of the store: not served, so not listed
                    continue
                name = entry.name + ("/" if stat.S_ISDIR(found.st_mode) else "")
                size = "" if stat.S_ISDIR(found.st_mode) else f"{found.st_size} bytes"
                entries.append(f"<tr><td>{_link(relative + ('/' if name.endswith('/') else ''), name)}</td>"
                               f"<td>{size}</td></tr>")
            parent = os.path.dirname(path)
            up = _link(parent + "/" if parent else "", "..")
            return _page(path, f"<table><tr><td>{up}</td><td></td></tr>{''.join(entries)}</table>")

        def file_response(self, full_path, stat_result, scope, status_code: int = 200):
            response = super().file_response(full_path, stat_result, scope, status_code)
            if str(full_path).endswith(TEXT_SUFFIXES):
                response.headers["content-type"] = "text/plain; charset=utf-8"
            return response

    return Starlette(routes=[Mount("/", app=StoreFiles(directory=root, follow_symlink=False))])


def serve(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (SIGINT or SIGTERM)."""
    # the web stack: only `crossalign serve` needs it
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
