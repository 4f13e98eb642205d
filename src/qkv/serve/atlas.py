"""An atlas folder (`qkv atlas`'s), served read-only: the page at /atlas/, each example's
attention page at /atlas/examples/NAME, the numbers at /api/atlas.

The folder is given when the server starts, and its files are listed then: a request names
one of those files, and anything else is a 404. No path is ever read from a request.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, RedirectResponse

EXAMPLE = re.compile(r"L\d+H\d+-\d+\.html")


def atlas_router(folder: str | Path) -> APIRouter:
    """The routes of one atlas folder, checked and listed now."""
    folder = Path(folder)
    index, numbers = folder / "index.html", folder / "atlas.json"
    if not index.is_file() or not numbers.is_file():
        raise ValueError(f"{folder} has no index.html and atlas.json; give a folder `qkv atlas` "
                         "wrote (and finished)")  # fmt: skip
    examples = folder / "examples"
    pages = {path.name: path for path in sorted(examples.iterdir()) if EXAMPLE.fullmatch(path.name)}
    router = APIRouter()

    @router.get("/atlas", include_in_schema=False)
    async def to_page():
        return RedirectResponse("/atlas/")  # the page's links are relative to /atlas/

    @router.get("/atlas/", include_in_schema=False)
    async def page():
        return FileResponse(str(index), media_type="text/html")

    @router.get("/atlas/examples/{name}", include_in_schema=False)
    async def example(name: str):
        if name not in pages:
            raise HTTPException(404, f"this atlas has no example page {name!r}")
        return FileResponse(str(pages[name]), media_type="text/html")

    @router.get("/api/atlas", summary="The atlas this server was started with (atlas.json)")
    async def numbers_of():
        return FileResponse(str(numbers), media_type="application/json")

    return router
