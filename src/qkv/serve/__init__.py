"""`qkv serve`: the attention explorer as a local web page and a JSON API.

    import qkv
    from qkv.serve import Limits, create_app, running

    app = create_app({"minilm": qkv.load("minilm")}, Limits(max_tokens=64))
    with running(app) as url:  # a real server on a free loopback port, in a thread
        ...  # GET url + "/api/models", POST url + "/api/attention", the page at url

FastAPI and uvicorn are imported here, not by `import qkv`: the command line stays fast.

Data flows one way. Each module imports only the ones above it in this list, each at its top:

    limits        what a request may ask (`Limits`), and the errors that say it may not
    jobs          waiting for work, with a time limit: in the app's worker threads, or in a
                  thread of its own (the one way serve waits, refuses or tells "ask again")
    long_texts    a model's queue of long texts, read one at a time, kept within a budget
    long_reading  reading one long text: its forward pass, records and summaries
    held          the models this server holds (`Served`), each with its long texts
    compute       the work behind each short request, run in a worker thread
    long          the work behind /api/long*, on a model's long texts
    schemas       the JSON each request takes, checked where it enters
    answers       the JSON each answer gives, as /docs shows it
    api           the routes: check a request, pick its model, wait for its work
    atlas         an atlas folder served read-only, its files listed at start
    tour          the tour page at /tour and its data at /api/tour
    app           `create_app`: the FastAPI app, its page and its error answers
    server        serving an app with uvicorn, from the command line or a thread
"""

from qkv.serve.app import create_app
from qkv.serve.limits import Limits
from qkv.serve.server import bind, running, serve

__all__ = ["Limits", "bind", "create_app", "running", "serve"]
