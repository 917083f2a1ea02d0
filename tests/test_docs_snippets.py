"""The code and commands of the docs (docs/*.md, MODEL_CARD.md, examples/*/README.md; README.md's
python blocks are tests/test_readme.py's) run as written on the CPU and say what the code does.

Conventions the docs follow and this file honours:

* every ```python block runs as written, each on its own (a reader copies one);
* a block whose first line is ``# file: PATH`` is a file of the reader's package: all of a doc's
  file blocks are written under a temporary directory on sys.path, the block itself is imported;
* ``<!-- not run: REASON -->`` right before a block (sparingly: a GPU, a cluster) leaves it
  unrun: it is compiled and every call whose function its imports name is bound to its signature;
* a block that talks to ``http://127.0.0.1:8000`` gets a live server of the demo model (on a free
  port) in this process;
* ``tinyloop ...`` / ``python -m tinyloop ...`` command lines parse with the CLI's own parser
  (a synopsis with ``[optional]`` parts: its flags and choices exist), ``python tools/...`` and
  ``bench/...`` lines name flags their script defines, and the ones that run on a CPU in a few
  seconds are run (with fewer windows, tiny checkpoints, temporary outputs).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import pathlib
import re
import shlex
import sys
import types

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.cli.main import build_parser, main as cli_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE_READMES = sorted((ROOT / "examples").glob("*/README.md"))
#: the docs whose commands and flags are checked here (docs/BENCHMARKS.md and docs/KERNELS.md record
#: measurements: their commands name GPU probes and benchmarks, not checked here)
DOCS = [ROOT / "docs" / f"{n}.md" for n in ("PLUGINS", "SERVING", "CONVERT", "FORMAT", "ARCHITECTURE", "SCORING")] \
    + [ROOT / "MODEL_CARD.md"] + EXAMPLE_READMES
#: every doc with python blocks but README.md (tests/test_readme.py)
PY_DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "MODEL_CARD.md"] + EXAMPLE_READMES
SERVER_URL = "http://127.0.0.1:8000"
#: flags of programs that are not ours (ray start, huggingface-cli download)
EXTERNAL_FLAGS = {"--head", "--address", "--port", "--local-dir"}


def rel(p: pathlib.Path) -> str:
    return p.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------- parsing
@dataclasses.dataclass
class Block:
    doc: str
    lang: str
    code: str
    not_run: str | None     # the reason of a <!-- not run: ... --> marker
    line: int

    @property
    def file(self) -> str | None:
        m = re.match(r"# file: (\S+)\n", self.code)
        return m.group(1) if m else None


def blocks(path: pathlib.Path):
    out, lines = [], path.read_text(encoding="utf-8").splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = re.match(r"```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = re.fullmatch(r"<!--\s*not run:\s*(.*?)\s*-->", prev)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        out.append(Block(rel(path), m.group(1), "".join(lines[i + 1:j]), marker.group(1) if marker else None, i + 1))
        i = j + 1
    return out


ALL_BLOCKS = [b for p in DOCS for b in blocks(p)]
PY_BLOCKS = [b for p in PY_DOCS for b in blocks(p) if b.lang == "python"]


def _logical_lines(code: str):
    """Lines of a shell block, continuations joined."""
    cur = ""
    for ln in code.splitlines():
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1] + " "
            continue
        yield cur + ln
        cur = ""


@dataclasses.dataclass
class Command:
    doc: str
    argv: list          # after "tinyloop" / "python -m tinyloop" / "python"
    kind: str           # "tinyloop" or "script"
    synopsis: bool      # [optional] parts or a|b alternatives: only flags and choices are checked
    inline: bool        # from a `code span` of the prose
    text: str


def _command(doc: str, text: str, inline: bool):
    try:
        toks = shlex.split(text, comments=True)
    except ValueError:
        return None
    if toks[:3] == ["python", "-m", "tinyloop"]:
        argv, kind = toks[3:], "tinyloop"
    elif toks[:1] == ["tinyloop"]:
        argv, kind = toks[1:], "tinyloop"
    elif toks[:1] == ["python"] and len(toks) > 1 and re.match(r"(tools|bench)/\w+\.py$", toks[1]):
        argv, kind = toks[1:], "script"
    else:
        return None
    if kind == "tinyloop" and (not argv or argv[0] == "..."):
        return None
    synopsis = "[" in text or any("|" in t for t in argv) or "..." in argv
    return Command(doc, argv, kind, synopsis, inline, text.strip())


def commands():
    out = []
    for b in ALL_BLOCKS:
        if b.lang in ("", "bash", "sh", "console", "shell"):
            for ln in _logical_lines(b.code):
                c = _command(b.doc, ln, inline=False)
                if c:
                    out.append(c)
    for p in DOCS:
        prose = re.sub(r"```.*?```", "", p.read_text(encoding="utf-8"), flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            c = _command(rel(p), " ".join(span.split()), inline=True)
            if c:
                out.append(c)
    return out


COMMANDS = commands()


def subparsers():
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


SUB = subparsers()


def script_flags(script: str) -> set:
    """The --flags a tools/ or bench/ script's argparse defines (read from its source: the scripts
    import torch or a GPU stack before parsing)."""
    return set(re.findall(r"""["'](--[\w-]+)["']""", (ROOT / script).read_text(encoding="utf-8")))


def find_command(doc: str, argv0: str, first_flag: str | None = None) -> Command:
    for c in COMMANDS:
        if c.doc == doc and c.argv and c.argv[0] == argv0 and (first_flag is None or first_flag in c.argv):
            return c
    raise AssertionError(f"{doc} documents no `tinyloop {argv0}` command{' with ' + first_flag if first_flag else ''}")


def with_option(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


# ----------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def live_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from test_serve import Live        # the demo model behind uvicorn on a free port, in a thread
    from tinyloop.serve import ServeConfig
    s = Live(ServeConfig(backend="cpu", max_seq_len=512))
    yield s
    s.close()


# -------------------------------------------------------------------------------- python blocks
def test_docs_have_python_blocks():
    n = {d: sum(b.doc == d for b in PY_BLOCKS) for d in ("docs/PLUGINS.md", "docs/SERVING.md")}
    assert n["docs/PLUGINS.md"] >= 7 and n["docs/SERVING.md"] >= 2, n
    assert all(b.not_run for b in PY_BLOCKS if b.not_run is not None), "a not-run marker gives its reason"


def _bind_calls(code: str, where: str):
    """Run only the imports of a block that is not run, then bind every call of a function they
    name to its signature (a renamed or removed keyword is caught)."""
    tree = ast.parse(code)
    ns: dict = {}
    imports = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    exec(compile(imports, where, "exec", dont_inherit=True), ns)
    checked = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ns:
            f = ns[node.func.id]
            sig = inspect.signature(f)
            sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
            checked += 1
    return checked


@pytest.fixture
def doc_package(tmp_path, monkeypatch):
    """Writes a doc's `# file:` blocks under tmp_path (on sys.path); forgets their modules after."""
    written = []

    def write(doc: str):
        for b in PY_BLOCKS:
            if b.doc == doc and b.file:
                path = tmp_path / b.file
                path.parent.mkdir(parents=True, exist_ok=True)
                for parent in path.relative_to(tmp_path).parents:
                    init = tmp_path / parent / "__init__.py"
                    if parent != pathlib.Path(".") and not init.exists():
                        init.write_text("")
                path.write_text(b.code, encoding="utf-8")
                written.append(b.file.split("/")[0].removesuffix(".py"))
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    def forget():
        for top in set(written):
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]

    forget()
    yield write
    forget()


@pytest.mark.parametrize("b", PY_BLOCKS, ids=lambda b: f"{b.doc}:{b.line}")
def test_doc_python_block(b, request, monkeypatch, capsys, doc_package):
    where = f"{b.doc} line {b.line}"
    monkeypatch.chdir(ROOT)
    if b.not_run:
        compile(b.code, where, "exec", dont_inherit=True)
        try:
            _bind_calls(b.code, where)
        except ImportError as exc:      # an optional extra that is not installed here
            pytest.skip(f"{where}: {exc}")
        return
    code = b.code
    if SERVER_URL in code:
        pytest.importorskip("openai")
        code = code.replace(SERVER_URL, request.getfixturevalue("live_server").url)
    doc_package(b.doc)
    if b.file:
        module = b.file.removesuffix(".py").replace("/", ".")
        importlib.import_module(module)
        return
    module = types.ModuleType("__doc_snippet__")         # as a script runs: a module of sys.modules
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, where, "exec", dont_inherit=True), module.__dict__)


# ------------------------------------------------------------------------------------- commands
@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: f"{c.doc}:{' '.join(c.argv)[:60]}")
def test_doc_command_flags(c):
    """Every documented command line names a subcommand / script and flags that exist; a complete
    command parses with the CLI's own parser."""
    if c.kind == "script":
        script, args = c.argv[0], c.argv[1:]
        assert (ROOT / script).is_file(), f"{c.doc}: {script} does not exist"
        unknown = [a for a in args if a.startswith("--") and a not in script_flags(script)]
        assert not unknown, f"{c.doc}: `{c.text}`: {script} has no {unknown}"
        return
    sub = c.argv[0]
    assert sub in SUB, f"{c.doc}: `{c.text}`: no subcommand {sub!r} (have {sorted(SUB)})"
    sp = SUB[sub]
    actions = {o: a for a in sp._actions for o in a.option_strings}
    args = [a.strip("[]") for a in c.argv[1:]]
    unknown = [a for a in args if a.startswith("-") and a not in actions and a != "-"]
    assert not unknown, f"{c.doc}: `{c.text}`: tinyloop {sub} has no {unknown}"
    for flag, value in zip(args, args[1:]):
        choices = actions[flag].choices if flag in actions else None
        if choices and not value.startswith("-") and value.upper() != value:
            bad = [v for v in value.split("|") if v not in choices]
            assert not bad, f"{c.doc}: `{c.text}`: {flag} takes {list(choices)}, not {bad}"
    if not c.synopsis and not c.inline:
        try:
            build_parser().parse_args(c.argv)
        except SystemExit as exc:
            pytest.fail(f"{c.doc}: `{c.text}` does not parse (exit {exc.code})")


def test_docs_inline_flags_exist():
    """A `--flag` anywhere in a doc is one of the CLI's, of a tools/ or bench/ script the doc
    names, or of an outside program the doc runs (ray, huggingface-cli)."""
    cli_flags = {o for sp in SUB.values() for a in sp._actions for o in a.option_strings}
    for p in DOCS:
        text = p.read_text(encoding="utf-8")
        known = cli_flags | EXTERNAL_FLAGS
        for script in set(re.findall(r"\b((?:tools|bench)/\w+\.py)\b", text)):
            if (ROOT / script).is_file():
                known |= script_flags(script)
        unknown = sorted(set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text)) - known)
        assert not unknown, f"{rel(p)} names flags nothing defines: {unknown}"


def test_commands_found():
    docs = {c.doc for c in COMMANDS}
    assert {"docs/SERVING.md", "docs/CONVERT.md", "docs/SCORING.md", "MODEL_CARD.md"} <= docs, docs


# ------------------------------------------------------------------- commands run on the CPU here
def run_cli(capsys, argv):
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, f"tinyloop {' '.join(map(str, argv))}: exit {rc}: {err}"
    return out


def test_model_card_run_command(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    c = find_command("MODEL_CARD.md", "run")
    assert c.argv == ["run", "configs/demo.yaml"]
    assert run_cli(capsys, c.argv).strip()


def test_model_card_ppl_command(monkeypatch, capsys):
    """The perplexity command, on one window at two of its depths (all of them take minutes)."""
    monkeypatch.chdir(ROOT)
    argv = with_option(with_option(find_command("MODEL_CARD.md", "ppl").argv, "--max-windows", "1"), "--loops", "1,4")
    out = run_cli(capsys, argv)
    assert re.search(r"^\s*1\s", out, re.M) and re.search(r"^\s*4\s", out, re.M), out


def test_model_card_loop_gain_command(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    c = find_command("MODEL_CARD.md", "inspect", "--measure")
    assert "--loops-max" in c.argv
    out = run_cli(capsys, with_option(with_option(c.argv, "--max-windows", "1"), "--window", "64"))
    assert "beta" in out.lower(), out


def test_convert_commands_run(tmp_path, monkeypatch, capsys):
    """MODEL_CARD.md's conversion (its flags, a tiny checkpoint of the family's logical names, no
    tokenizer directory), then docs/CONVERT.md's `tinyloop inspect OUT.tinyloop`."""
    st = pytest.importorskip("safetensors.numpy")
    from tinyloop.model.arch import ModelConfig, required_tensors
    from tinyloop.model.presets import PRESETS

    cfg = dict(PRESETS["tiny"].config, tied_embeddings=True, eos_id=0)
    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal(s) * 0.1 + (1.0 if len(s) == 1 else 0.0)).astype(np.float32)
               for n, s in required_tensors(ModelConfig(**cfg)).items()}
    st.save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    c = find_command("MODEL_CARD.md", "convert", "--embed-quant")
    argv = list(c.argv)
    i = argv.index("--tokenizer")
    del argv[i:i + 2]                                # build/demo is the corpus build's output
    argv = with_option(with_option(with_option(argv, "--checkpoint", "model.safetensors"), "--config", "config.json"),
                       "-o", "out.tinyloop")
    run_cli(capsys, argv)
    inspect_cmd = find_command("docs/CONVERT.md", "inspect")
    assert inspect_cmd.argv == ["inspect", "OUT.tinyloop"]
    out = run_cli(capsys, ["inspect", "out.tinyloop"])
    assert "q4" in out


def test_scoring_lens_command(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(ROOT)
    c = find_command("docs/SCORING.md", "lens")
    assert c.argv[:2] == ["lens", "[MODEL]"] and "--text" in c.argv and "-o" in c.argv
    for extra in ([], ["--uncertainty"]):
        out = tmp_path / f"lens{len(extra)}.png"
        run_cli(capsys, ["lens", "--text", "def add(a, b):\n    return a + b\n", "--loops", "4", "-o", out, *extra])
        assert out.stat().st_size > 1000


def test_serving_commands(monkeypatch):
    """`python -m tinyloop serve [--config configs/serve.yaml ...]`: the documented config loads
    (it is not served here: the command blocks)."""
    from tinyloop.serve import ServeConfig, load_serve_config

    monkeypatch.chdir(ROOT)
    c = find_command("docs/SERVING.md", "serve", "--config")
    cfg = load_serve_config(c.argv[c.argv.index("--config") + 1])
    assert isinstance(cfg, ServeConfig) and cfg.port == 8000
    assert ServeConfig().host == "127.0.0.1" and ServeConfig().port == 8000     # "the demo model on 127.0.0.1:8000"


# ---------------------------------------------------------------------------------- prose claims
def test_plugins_hook_table():
    from tinyloop.runtime import hookspecs

    text = (ROOT / "docs/PLUGINS.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(tinyloop_\w+)` \| `(\w+)` subclasses \|", text, re.M)
    hooks = {n for n, f in vars(hookspecs).items() if n.startswith("tinyloop_") and callable(f)}
    assert {h for h, _ in rows} == hooks
    for hook, base in rows:
        assert base in getattr(hookspecs, hook).__doc__, (hook, base)


def test_plugins_named_statistics_and_capabilities():
    from tinyloop.runtime.backend import CAPABILITIES
    from tinyloop.runtime.early_exit import STATISTICS

    plugins = (ROOT / "docs/PLUGINS.md").read_text(encoding="utf-8")
    m = re.search(r"`tinyloop\.runtime\.early_exit\.STATISTICS` \(([^)]*)\)", plugins)
    assert set(re.findall(r"`(\w+)`", m.group(1))) == set(STATISTICS)
    for name in re.findall(r'requires = frozenset\(\{"(\w+)"\}\)', plugins):
        assert name in CAPABILITIES
    arch = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    pairs = re.findall(r'`([A-Z]\w+)` \("(\w+)"', arch)
    assert len(pairs) >= 8
    for cls, name in pairs:
        assert CAPABILITIES[name].__name__ == cls, (cls, name)


def test_serving_routes_fields_and_metrics(live_server):
    import httpx
    from tinyloop.serve import ServeConfig

    text = (ROOT / "docs/SERVING.md").read_text(encoding="utf-8")
    routes = {r.path for r in live_server.app.routes}
    for method, path in re.findall(r"^\| `(GET|POST) ([^`]+)` \|", text, re.M):
        assert path in routes, path
    assert "/openapi.json" in routes and "/docs" in routes
    fields = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    for name in ("max_tokens_default", "queue_size", "retry_after_s", "deadline_s", "scaffolds"):
        assert name in fields, name
    assert fields["max_tokens_default"] == 16                   # "(default `max_tokens_default`, 16)"
    r = httpx.post(live_server.url + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and set(r.json()["choices"][0]["tinyloop"]) >= {
        "stop_reason", "loops_used", "decoder", "reused_tokens", "first_token_ms", "tokens_per_s"}
    health = httpx.get(live_server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and {"queue_depth", "pid"} <= set(health)
    card = httpx.get(live_server.url + "/v1/models", timeout=10).json()["data"][0]
    assert {"id", "max_seq_len", "max_loops", "default_loops", "backend"} <= set(card)
    metrics = httpx.get(live_server.url + "/metrics", timeout=10).text
    row = re.search(r"^\| `GET /metrics` \| (.*) \|$", text, re.M).group(1)
    names = []
    for m in re.findall(r"`(tinyloop_[\w{},]+?)(?:\{[a-z,]+\})?`", row):
        brace = re.search(r"\{([\w,]+)\}", m)
        names += [m.replace(brace.group(0), part) for part in brace.group(1).split(",")] if brace else [m]
    assert len(names) >= 10
    for name in names:
        assert re.search(rf"^{name}[{{ ]", metrics, re.M) or f"{name}_bucket" in metrics, name


def test_scoring_signatures_and_escalation_defaults():
    text = (ROOT / "docs/SCORING.md").read_text(encoding="utf-8")
    heads = re.findall(r"^## `(score_\w+)\((.*)\)`$", text, re.M)
    assert len(heads) == 3
    for name, params in heads:
        sig = inspect.signature(getattr(tl, name))
        documented = [p.strip() for p in params.split(",")]
        assert [p.split("=")[0] for p in documented] == list(sig.parameters), name
        for p in documented:
            if "=" in p:
                key, value = p.split("=")
                assert sig.parameters[key].default == ast.literal_eval(value), (name, key)
    model = tl.load_model(None, backend="cpu")
    try:
        ids = model.tokenizer.encode("def add(a, b):\n    return a + b\n")
        with pytest.raises(tl.ConfigError, match="threshold"):
            tl.score_with_consistency_escalation(model, ids, 2, 8)
        r = tl.score_with_consistency_escalation(model, ids, 2, 8, "entropy", 1.5)     # the doc's example
        f = np.nonzero(r.escalated)[0]
        work = 2 * len(ids) + (6 * (f[-1] + 1) if len(f) else 0)
        assert r.loop_work == work and r.saved == pytest.approx(1 - work / (8 * len(ids)))
        lens = tl.score_logit_lens(model, ids, loops=3)
        assert lens.shape == (3, len(ids), model.cfg.vocab_size)
        assert np.array_equal(lens[1], tl.score(model, ids, loops=2))
        top = tl.score_logit_lens(model, ids, loops=3, top_k=2)
        assert top.ids.shape == top.logprobs.shape == (3, len(ids), 2)
        u = tl.score_with_uncertainty(model, ids, loops=3)
        fields = re.findall(r"^\| `(\w+) \(([^)]*)\)` \|", text, re.M)
        assert [f[0] for f in fields] == ["logits", "entropy", "margin", "argmax", "settled_depth", "kl_to_final"]
        for field in fields:
            assert getattr(u, field[0]).shape == tuple({"T": len(ids), "V": model.cfg.vocab_size, "L": 3}[d.strip()]
                                                       for d in field[1].split(",") if d.strip()), field
    finally:
        tl.free_model(model)


def test_convert_config_json_section():
    from tinyloop.model.arch import ModelConfig

    text = (ROOT / "docs/CONVERT.md").read_text(encoding="utf-8")
    section = text[text.index("## The config JSON"):text.index("## The checkpoint")]
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    required = re.search(r"Required: (.*?)\. Optional", section, re.S).group(1)
    assert re.findall(r"`(\w+)`", required) == [n for n, f in fields.items()
                                                if f.default is dataclasses.MISSING
                                                and f.default_factory is dataclasses.MISSING]
    optional = dict(re.findall(r"`(\w+)`\s+\(([^)]*)\)", section.split("Optional", 1)[1]))
    assert set(optional) | set(re.findall(r"`(\w+)`", required)) == set(fields)
    for name, doc_default in optional.items():
        first = re.split(r"\s*(?:;| = | or )\s*", doc_default.strip())[0]
        default = fields[name].default if fields[name].default is not dataclasses.MISSING else fields[name].default_factory()
        value = json.loads(first)
        assert (list(default) if isinstance(default, tuple) else default) == value, (name, doc_default, default)
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    ModelConfig.from_dict(example)


def test_format_doc_constants_and_example():
    from tinyloop.model import format as fmt
    from tinyloop.model.arch import ModelConfig, required_tensors

    text = (ROOT / "docs/FORMAT.md").read_text(encoding="utf-8")
    assert fmt.MAGIC == b"TINYLOOP" and fmt.VERSION == 1 and fmt.ALIGN == 64
    assert fmt.MAX_HEADER_BYTES == 64 << 20 and "at most 64 MiB" in text
    assert fmt.MAX_NAME_BYTES == 1024 and fmt.MAX_NDIM == 4
    assert fmt.DTYPE_CODES == {0: "f32", 1: "f16", 2: "u8", 3: "i32"}
    assert "0 = f32, 1 = f16, 2 = u8, 3 = i32" in text
    assert tuple(fmt.HEADER_KEYS) == ("config", "quant", "tokenizer", "metadata")
    raw = (ROOT / "tinyloop/models/demo.tinyloop").read_bytes()[:24]
    assert raw[:8] == b"TINYLOOP" and int.from_bytes(raw[8:12], "little") == 1 and raw[12:16] == b"\0" * 4
    header = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    config = json.loads(re.search(r'"config":\s*(\{.*?\}),\n', header, re.S).group(1))
    cfg = ModelConfig.from_dict(config)
    order = [n.split(".")[-1] for n in required_tensors(cfg) if n.startswith("pre.0.")]
    assert order == ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    names = list(required_tensors(cfg))
    assert names[0] == "embed" and names[-2:] == ["final_norm", "head"]


def test_model_card_facts():
    from tinyloop.analysis.memory import parameter_count

    text = (ROOT / "MODEL_CARD.md").read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", text.split("## Architecture")[1].split("## Training")[0], re.M))
    model = tl.load_model(None, backend="cpu")
    try:
        c = model.cfg
        assert int(table["vocab_size"]) == c.vocab_size and int(table["d_model"]) == c.d_model
        assert table["heads / kv heads / head_dim"].startswith(f"{c.n_heads} / {c.n_kv_heads} / {c.head_dim}")
        assert int(table["d_ff (SwiGLU)"]) == c.d_ff
        assert table["blocks"] == f"{c.n_pre} pre + {c.n_loop} shared loop layers x L + {c.n_post} post"
        assert table["default_loops / max_loops"] == f"{c.default_loops} / {c.max_loops}"
        assert table["loop_inject"].split()[0] == c.loop_inject and c.tied_embeddings
        assert int(table["parameters"].replace(",", "")) == parameter_count(c)
        assert c.eos_id == 0                                     # "`<|endoftext|>` = id 0 = EOS"
    finally:
        tl.free_model(model)
    size = (ROOT / "tinyloop/models/demo.tinyloop").stat().st_size
    assert f"File: {size:,} bytes" in text
    assert f"{(ROOT / 'data/heldout_eval.txt').stat().st_size:,} bytes" in text


def test_convert_huginn_group_sizes():
    """docs/CONVERT.md's group sizes for Huginn-0125: those it says fit divide d and d_ff (and are
    multiples of 8), those it says do not, do not."""
    text = " ".join((ROOT / "docs/CONVERT.md").read_text(encoding="utf-8").split())
    m = re.search(r"q4 groups must divide d = (\d+) and d_ff = ([\d ]+?) \(([\d, and]+) do; ([\d, and]+) do(?:es)? not\)", text)
    d, d_ff = int(m.group(1)), int(m.group(2).replace(" ", ""))
    for g in map(int, re.findall(r"\d+", m.group(3))):
        assert g % 8 == 0 and d % g == 0 and d_ff % g == 0, g
    for g in map(int, re.findall(r"\d+", m.group(4))):
        assert d % g or d_ff % g, g
    assert "--group-size 32" in text


# ------------------------------------------------------------------------ names the prose gives
def _prose_spans(p: pathlib.Path):
    prose = re.sub(r"```.*?```", "", p.read_text(encoding="utf-8"), flags=re.S)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]


def test_docs_paths_exist():
    """Every file path in a doc's code spans exists (relative to the repository, the package, a
    backend's folder or the example package)."""
    bases = [ROOT, ROOT / "tinyloop", ROOT / "tinyloop/cpu", ROOT / "tinyloop/cuda", ROOT / "examples/tinyloop-example"]
    for p in DOCS:
        for span in _prose_spans(p):
            for path in re.findall(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|json|md|txt|tinyloop|png|log|html))\b",
                                   span):
                if path.startswith(("build/", "my_package/")) or "{" in path:
                    continue
                assert any((b / path).exists() for b in bases), f"{rel(p)}: `{span}` names {path}, which does not exist"


def test_docs_dotted_names_resolve():
    """`tinyloop.a.b` / `tl.a` names in a doc's code spans import."""
    def resolve(dotted):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for part in parts[i:]:
                obj = getattr(obj, part)
            return obj

    for p in DOCS:
        for span in _prose_spans(p):
            for name in re.findall(r"(?<![\w./-])((?:tinyloop|tl)(?:\.[A-Za-z_]\w*)+)", span):
                if name.endswith(".tinyloop") or name.startswith("tinyloop.configs"):
                    continue
                dotted = "tinyloop" + name[2:] if name.startswith("tl.") else name
                try:
                    resolve(dotted)
                except AttributeError as exc:
                    pytest.fail(f"{rel(p)}: `{span}`: {name} does not resolve ({exc})")


def test_docs_class_attributes_exist():
    """`Class.attr` in a doc's code spans, for a class of tinyloop's runtime / model / analysis / cpu /
    serve / plugins / cli modules, is an attribute, field or instance attribute of it."""
    import pkgutil

    classes = {}
    for pkg in ("runtime", "model", "analysis", "cpu", "serve", "plugins", "cli"):
        root = importlib.import_module(f"tinyloop.{pkg}")
        for info in pkgutil.walk_packages(root.__path__, f"tinyloop.{pkg}."):
            mod = importlib.import_module(info.name)
            for n, o in vars(mod).items():
                if isinstance(o, type) and o.__module__ == mod.__name__:
                    classes.setdefault(n, o)

    def has(cls, attr):
        if hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {}):
            return True
        for k in cls.__mro__:
            try:
                if re.search(rf"self\.{attr}\b", inspect.getsource(k)):
                    return True
            except (OSError, TypeError):
                continue
        return False

    assert {"Backend", "ModelConfig", "Forward", "KVCodec", "LaneView"} <= set(classes)
    for p in DOCS:
        for span in _prose_spans(p):
            for cls, attr in re.findall(r"(?<![\w.])([A-Z]\w+)\.([a-z_]\w*)", span):
                if cls in classes:
                    assert has(classes[cls], attr), f"{rel(p)}: `{span}`: {cls} has no {attr}"
