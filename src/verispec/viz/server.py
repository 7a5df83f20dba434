"""The `verispec viz` server: static pages (shipped in verispec/viz/static, no internet assets) and a
JSON API over the library.

    GET  /, /live, /lossless, /speedup   the pages
    GET  /api/info                       models, drafters, defaults
    POST /api/live/start                 start decoding a prompt (one live decoding at a time), as a chain
                                         of K drafts or a tree ({"tree": {"shape": "3,2,1"}} or
                                         {"tree": {"budget": 12, "top_k": 4}}, see `live_tree_config`)
    POST /api/live/step                  run one draft / verify step; returns its trace record
    POST /api/lossless                   a chunk of the losslessness demo (verispec.viz.lossless)
    GET  /api/speedup                    the speedup table (verispec.analyze)
    POST /api/speedup/bench              alpha and c measured in an uploaded `verispec bench` JSON

Bad input answers 400 with {"error": message}.

Like the server, the visualizer is guarded before any handler runs (`serve.gate.Gate`): with an API key
(`verispec viz --api-key`, or $VERISPEC_API_KEY) every /api call needs it (the pages send the key their URL's
fragment holds: `http://host:port/#key=KEY`); without one, a request's Host and Origin must name this machine, so a
web page elsewhere cannot drive it. Bodies are limited to MAX_BODY_BYTES; a live decoding's session id is random
(`secrets`), so one client cannot step or follow another's; its constraint is measured against the same bounds as
the server's before it is compiled (`verispec.constraint_bounds`).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import webbrowser
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Body, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from verispec.analyze import AnalyzeConfig, measured_from_bench, speedup_table
from verispec.api import SpeculativeDecoder
from verispec.config import MAX_TEMPERATURE, TREE_CHILDREN, Constraint, SamplingConfig, SpecConfig, TreeConfig
from verispec.serve.config import ServeConfig
from verispec.drafters.registry import NGRAM
from verispec.errors import VerispecError
from verispec.render import StreamPrinter
from verispec.trace import Tracer, tracing
from verispec.serve.gate import Gate
from verispec.serve.tenants import Keys
from verispec.viz.lossless import demo_chunk

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20  # the largest request body (a live prompt and constraint are 100,000 characters at most)
PAGES = {"/": "index.html", "/live": "live.html", "/lossless": "lossless.html", "/speedup": "speedup.html"}


TREE_FIELDS = ("shape", "budget", "top_k", "children")
# The live view's trees stay small enough to read, with the limits `verispec serve` applies by default.
MAX_LIVE_TREE_NODES = ServeConfig().max_tree_nodes
MAX_LIVE_TREE_DEPTH = ServeConfig().max_draft_tokens


MAX_LIVE_TOKENS = 4096  # a live decoding's max_new_tokens (each step is one request, but the text is kept)


class LiveConstraint(BaseModel):
    """Structured output for a live decoding: a `config.Constraint`'s kind and source."""

    kind: str
    source: str = Field("", max_length=100_000)


class LiveRequest(BaseModel):
    prompt: str = Field(max_length=100_000)
    drafter: str
    k: int = Field(SpecConfig().num_draft_tokens, ge=1, le=MAX_LIVE_TREE_DEPTH)
    temperature: float = Field(SamplingConfig().temperature, ge=0.0, le=MAX_TEMPERATURE)
    seed: int = Field(0, ge=0, lt=2**63)
    max_new_tokens: int = Field(64, ge=1, le=MAX_LIVE_TOKENS)
    chat: bool | None = None
    tree: Any = None  # None: a chain of K drafts; else read by `live_tree_config`
    constraint: LiveConstraint | None = None  # structured output



def live_tree_config(value: Any, k: int) -> TreeConfig | None:
    """The live request's `tree` as a TreeConfig (None or false: a chain).

    value: {"shape": "3,2,1" or [3, 2, 1]} (static) or {"budget": 12} (dynamic, depth K), optionally
    with "top_k" and "children" (see `TreeConfig`). Anything else, or a tree over MAX_LIVE_TREE_NODES
    nodes or MAX_LIVE_TREE_DEPTH deep, is a VerispecError naming the problem (HTTP 400).
    """
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise VerispecError('tree takes an object like {"shape": "3,2,1"} or {"budget": 12, "top_k": 4}')
    unknown = sorted(set(value) - set(TREE_FIELDS))
    if unknown:
        raise VerispecError(f"unknown tree option '{unknown[0]}' (known: {', '.join(TREE_FIELDS)})")
    values = {name: v for name, v in value.items() if v is not None}
    if isinstance(values.get("shape"), str):
        try:
            values["shape"] = tuple(int(b) for b in values["shape"].split(","))
        except ValueError:
            raise VerispecError(f"a tree shape is branching factors per depth like 3,2,1, got '{value['shape']}'") from None
    try:
        tree = TreeConfig(**values)
    except TypeError:
        raise VerispecError(f"a tree shape is branching factors per depth like 3,2,1, got {value.get('shape')!r}") from None
    depth = tree.depth(k)
    if depth > MAX_LIVE_TREE_DEPTH or tree.size_upper_bound(depth) > MAX_LIVE_TREE_NODES:
        raise VerispecError(f"the live view shows trees of at most {MAX_LIVE_TREE_NODES} nodes and depth "
                            f"{MAX_LIVE_TREE_DEPTH}; this one has {tree.size_upper_bound(depth)} nodes and depth {depth}")
    return tree


class StepRequest(BaseModel):
    session: str = Field(max_length=64)


class LosslessRequest(BaseModel):
    p: list[float]
    q: list[float]
    samples: int = 500
    seed: int = 0
    counts: list[int] | None = None
    accepted: int = 0


class LiveDecoding:
    """One prompt being decoded step by step, with a Tracer recording each verification."""

    def __init__(self, session: str, decoder: SpeculativeDecoder, request: LiveRequest) -> None:
        self.session = session
        self.decoder = decoder
        constraint = request.constraint
        sampling = SamplingConfig(temperature=request.temperature,
                                  constraint=None if constraint is None else Constraint(constraint.kind, constraint.source))
        tree = live_tree_config(request.tree, request.k)
        spec = SpecConfig(num_draft_tokens=request.k, max_new_tokens=request.max_new_tokens, tree=tree)
        if tree is not None:
            decoder.engine.check_tree_request(tree)  # now, not at the first step
        if sampling.constraint is not None:
            decoder.engine.grammars().start(sampling.constraint)  # a bad constraint answers 400 now
        self.tree = tree
        self.prompt_ids = decoder.encode(request.prompt, request.chat)
        tokenizer = decoder.target.tokenizer
        self.tracer = Tracer(top=8, token_text=lambda t: tokenizer.decode([t]))
        self.printer = StreamPrinter(None, decoder.decode, plain_decoding=decoder.drafter.traits.plain)
        self.stream = decoder.stream(self.prompt_ids, sampling, spec, request.seed)
        self.done = False

    def step(self) -> dict | None:
        """The next step's trace record, or None when the sequence has ended."""
        if self.done:
            return None
        with tracing(self.decoder.engine, self.tracer):
            try:
                event, seq = next(self.stream)
            except StopIteration:
                self.done = True
                return None
        n_acc = min(len(event.accepted), len(event.committed))
        pieces = self.printer.pieces(seq.generated, n_acc, event.bonus, len(event.committed), seq.text_end,
                                     event.forced)
        record = self.tracer.step(event, seq, pieces)
        self.done = event.finish_reason is not None
        return record


class VizState:
    """The decoders the live view can use (all sharing the loaded target) and the current live decoding.

    Args:
        decoder: the decoder built from --target / --draft; "ngram" and "none" are offered besides it.
    """

    def __init__(self, decoder: SpeculativeDecoder) -> None:
        self.target_name = decoder.target.name
        self.decoders: dict[str, SpeculativeDecoder] = {decoder.draft_name: decoder}
        for name in (NGRAM, "none"):
            if name not in self.decoders:
                self.decoders[name] = SpeculativeDecoder(decoder.target, name)
        self.lock = threading.Lock()
        self.live: LiveDecoding | None = None

    def start(self, request: LiveRequest) -> dict:
        if request.drafter not in self.decoders:
            raise VerispecError(f"unknown drafter '{request.drafter}'; choose from {', '.join(self.decoders)}")
        with self.lock:  # drafters keep per-batch state: one live decoding at a time
            self.live = LiveDecoding(secrets.token_urlsafe(16), self.decoders[request.drafter], request)
            tokenizer = self.live.decoder.target.tokenizer
            tree = self.live.tree
            return {"session": self.live.session, "prompt_token_ids": self.live.prompt_ids,
                    "prompt_text": tokenizer.decode(self.live.prompt_ids),
                    "tree": None if tree is None else dataclasses.asdict(tree)}

    def step(self, session: str) -> dict:
        with self.lock:
            if self.live is None or not secrets.compare_digest(self.live.session, session):
                raise VerispecError("this decoding was replaced by a newer one; press start again")
            record = self.live.step()
            return {"done": self.live.done, "record": record}


def create_app(decoder: SpeculativeDecoder, api_key: str | None = None, allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving the pages and the API for `decoder` (see the module docstring); `api_key` guards the
    API, and without one `allowed_hosts` names the host names besides IP addresses and localhost it answers."""
    state = VizState(decoder)
    app = FastAPI(title="verispec viz", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, keys=Keys((api_key,) if api_key else ()), max_body_bytes=MAX_BODY_BYTES, metrics=None,
                       allowed_hosts=allowed_hosts, public=(*PAGES, "/static/"))

    @app.exception_handler(VerispecError)
    async def bad_input(_: Request, err: VerispecError) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=400)

    for route, filename in PAGES.items():
        app.add_api_route(route, lambda filename=filename: FileResponse(STATIC / filename), methods=["GET"],
                          include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/info")
    def info() -> dict:
        return {"target": state.target_name, "drafters": list(state.decoders),
                "defaults": {"k": SpecConfig().num_draft_tokens, "temperature": SamplingConfig().temperature,
                             "max_new_tokens": LiveRequest.model_fields["max_new_tokens"].default, "seed": 0,
                             "tree_top_k": TreeConfig.__dataclass_fields__["top_k"].default,
                             "tree_children": TreeConfig.__dataclass_fields__["children"].default},
                "tree": {"children": list(TREE_CHILDREN), "max_nodes": MAX_LIVE_TREE_NODES,
                         "max_depth": MAX_LIVE_TREE_DEPTH},
                "analyze": dataclasses.asdict(AnalyzeConfig())}

    @app.post("/api/live/start")
    def live_start(request: LiveRequest) -> dict:
        return state.start(request)

    @app.post("/api/live/step")
    def live_step(request: StepRequest) -> dict:
        return state.step(request.session)

    @app.post("/api/lossless")
    def lossless(r: LosslessRequest) -> dict:
        return demo_chunk(r.p, r.q, r.samples, r.seed, r.counts, r.accepted)

    @app.get("/api/speedup")
    def speedup(alphas: str | None = None, k_max: int | None = None, c: float | None = None) -> dict:
        values: dict = {}
        if alphas is not None:
            try:
                values["alphas"] = tuple(float(a) for a in alphas.split(",") if a.strip())
            except ValueError:
                raise VerispecError(f"alphas must be comma-separated numbers, got '{alphas}'") from None
        if k_max is not None:
            values["k_max"] = k_max
        if c is not None:
            values["c"] = c
        return speedup_table(AnalyzeConfig(**values))

    @app.post("/api/speedup/bench")
    def speedup_bench(report: dict = Body(...), system: str | None = None) -> dict:
        return measured_from_bench(report, system)

    return app


def serve(decoder: SpeculativeDecoder, host: str, port: int, open_browser: bool = True,
          api_key: str | None = None) -> None:
    """Serve the visualizer until interrupted; open the default browser at it unless told not to."""
    import uvicorn

    app = create_app(decoder, api_key)
    url = f"http://{host}:{port}/" + (f"#key={quote(api_key)}" if api_key else "")
    print(f"verispec viz: {url}  (Ctrl+C to stop)")
    if open_browser:
        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    uvicorn.run(app, host=host, port=port, log_level="warning")
