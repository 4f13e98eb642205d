"""`qkv serve`: the attention explorer as a local web page and a JSON API.

    import qkv
    from qkv.serve import Limits, create_app, running

    app = create_app({"minilm": qkv.load("minilm")}, Limits(max_tokens=64))
    with running(app) as url:  # a real server on a free loopback port, in a thread
        ...  # GET url + "/api/models", POST url + "/api/attention", the page at url

FastAPI and uvicorn are imported here, not by `import qkv`: the command line stays fast.
"""

from qkv.serve.app import create_app
from qkv.serve.limits import Limits
from qkv.serve.server import bind, running, serve

__all__ = ["Limits", "bind", "create_app", "running", "serve"]
