"""The docs name only what exists: every repo path, flag and metric name they
mention is checked against the tree, the programs' --help and a running
server's /metrics, so the docs cannot drift from the code.

Documents: README.md, CHANGELOG.md, docs/*.md, client/python/README.md,
examples/README.md, deploy/README.md, tests/load/README.md,
tests/reliability/README.md.

Rules (simple on purpose; a failure names the document, the line and the
word):
* Paths. In code spans and fenced code blocks, and in Markdown link targets,
  every word that starts with a top-level entry of the tree followed by "/"
  (`server/...`, `tools/...`), or is a top-level file (`README.md`), must
  exist (a file or a directory; a path without an extension may name a
  .h/.cc pair). A document below the top (client/python/README.md) may also
  name paths relative to its own folder (`tests/test_ops.py`). `//pkg:name`
  Bazel labels must name a target of `pkg/BUILD`. Build outputs (`bazel-*`)
  and words holding a pattern (`*`, `<`, `{`, `…`) are skipped.
* Flags. In a code span, or a line of a fenced block, `--name` words are
  checked against the program the span names: `detlogp_cli` against
  `detlogp_cli --help`; `detlogp_server` or `serve.sh` against
  `detlogp_server --help`; a span that starts with `detlogp ` (the Python
  console) against the console's help. A span that is a bare flag
  (`--max_top_k`) must be a flag of one of the three. Flags in spans naming
  any other program (bench scripts, pip, bazel, examples) are not checked.
  `--noX` stands for the bool flag `--X` of the C++ programs. CHANGELOG.md
  is history: the flags it names may be gone, so they are not checked.
* Sections. Wherever the tree (code, scripts, docs) points at a section as
  `docs/NAME.md, "Title"` (a comment may wrap the title over lines), NAME.md
  must have a heading with that title (a heading's trailing "(...)" may be
  left out).
* Metrics. Every `detlogp_...` word in the text that is not a program or
  library name (NOT_METRICS) must be a metric family of a CPU server's
  /metrics scrape after a scored call and a projection.
* The API reference. docs/api.md has, for every service, message and enum
  of proto/ (nested ones as `Outer.Inner`), a heading naming it in a code
  span, and under it a table row per RPC (`| `Name` | `Request` →
  `stream Response` | ... |`), per field (`| `name` | number | `type` | ...
  |`) or per enum value (`| `NAME` | number | ... |`); rows under such a
  heading must name something the proto has. A new field needs one row.
* Python signatures. In client/python/README.md, an inline code span that
  reads as a Python signature, `name(params)` with `name` a method of
  detlogp.Client or a function of detlogp (detlogp.ops in the trainer-side
  section; `client.`, `detlogp.` and `dtorch.` prefixes are resolved), must
  agree with inspect.signature: the documented positional parameters are
  the function's first ones, keyword-only ones (after `*`) are keyword-only
  there, every required parameter is documented unless a bare `...` stands
  for the rest, and a stated default (other than `...`) is the function's.
  `name()` only says that the name exists.

Needs bazel-bin/server/detlogp_server and bazel-bin/client/detlogp_cli
(`bazel build //server:detlogp_server //client:detlogp_cli`, as
tools/test_python.sh does), or $DETLOGP_SERVER and $DETLOGP_CLI.
"""

import ast
import dataclasses
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import detlogp
import numpy as np
import pytest
from detlogp.testing import LocalServer, TestModel, server_binary_for_tests

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

DOCUMENTS = sorted(
    [
        REPO_ROOT / "README.md",
        REPO_ROOT / "CHANGELOG.md",
        REPO_ROOT / "client/python/README.md",
        REPO_ROOT / "examples/README.md",
        REPO_ROOT / "deploy/README.md",
        REPO_ROOT / "tests/load/README.md",
        REPO_ROOT / "tests/reliability/README.md",
        *(REPO_ROOT / "docs").glob("*.md"),
    ]
)

# detlogp_ words that name programs, libraries and C functions, not metrics.
NOT_METRICS = {
    "detlogp_cli",
    "detlogp_server",
    "detlogp_ops",
    "detlogp_ops_cuda",
    "detlogp_cuda_linear_logp_backward",
    "detlogp_client",
    "detlogp_client_abi_version",
    "detlogp_client_score",
    "detlogp_client_score_async",
    "detlogp_client_shared_memory_refusal",
    "detlogp_client_destroy",
    "detlogp_load",
}

_FENCE = re.compile(r"^\s*```")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)")
_METRIC = re.compile(r"(?<![\w.-])detlogp_[a-z0-9_]+")
_PATTERN_CHARS = set("*<>{}…$")


@dataclasses.dataclass(frozen=True)
class Span:
    """A piece of code in a document: an inline code span, one line of a
    fenced block, or a link target."""

    document: str
    line: int
    text: str
    is_link: bool = False


def spans_of(text, document="<text>"):
    """Every code span, fenced line and link target of a Markdown text."""
    spans = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            spans.append(Span(document, number, line.strip()))
            continue
        spans.extend(Span(document, number, m.group(1)) for m in _INLINE_CODE.finditer(line))
        spans.extend(
            Span(document, number, m.group(1), is_link=True) for m in _LINK_TARGET.finditer(line)
        )
    return spans


def top_level_entries(root):
    return {
        p.name
        for p in root.iterdir()
        if not p.name.startswith(".git") and not p.name.startswith("bazel-")
    }


_LABEL = re.compile(r"^//[\w/.-]*(:[\w.+-]+)?$")


def path_words(span, entries):
    """The words of a span that name repo paths (see the module's rules)."""
    text = span.text.split("#")[0] if span.is_link else span.text
    local_root = (REPO_ROOT / span.document).parent
    words = []
    for word in re.split(r"[\s,;()\[\]\"'=]+", text):
        word = word.strip("`").rstrip(".:")
        if word.startswith("./"):
            word = word[2:]
        if not word or _PATTERN_CHARS & set(word) or "://" in word:
            continue
        if word.startswith("//"):
            if _LABEL.match(word) and len(word) > 2:
                words.append(word)
            continue
        first = word.split("/")[0]
        if not first:
            continue  # an absolute path: the host's, not the tree's
        top_level = first in entries and ("/" in word or (REPO_ROOT / first).is_file())
        local = local_root != REPO_ROOT and "/" in word and (local_root / first).exists()
        if top_level or local:
            words.append(word)
    return words


def _exists(root, word):
    return any((root / (word.rstrip("/") + suffix)).exists() for suffix in ("", ".h", ".cc"))


def missing_paths(spans, root=REPO_ROOT):
    """(span, word) for every path word that exists neither under root nor
    (for documents below the top) under the document's folder."""
    entries = top_level_entries(root)
    missing = []
    for span in spans:
        local_root = (root / span.document).parent
        for word in path_words(span, entries):
            if word.startswith("//"):
                package, _, target = word[2:].partition(":")
                build = root / package / "BUILD"
                target = target or package.split("/")[-1]
                if not build.is_file() or f'name = "{target}"' not in build.read_text():
                    missing.append((span, word))
            elif not _exists(root, word) and not _exists(local_root, word):
                missing.append((span, word))
    return missing


def program_of(span):
    """Which program's flags a span's --flags are, or None (not checked)."""
    text = span.text
    if "detlogp_cli" in text:
        return "cli"
    if "detlogp_server" in text or "serve.sh" in text:
        return "server"
    if re.match(r"(\$ )?detlogp\s", text):
        return "console"
    if text.startswith("--"):
        return "any"
    return None


def flag_known(flag, program, known):
    names = known["any"] if program == "any" else known[program]
    if flag in names:
        return True
    # Bool flags of the C++ programs also read as --noX.
    cpp = known["cli"] | known["server"] if program == "any" else known.get(program, set())
    return program in ("cli", "server", "any") and flag.startswith("no") and flag[2:] in cpp


def unknown_flags(spans, known):
    """(span, flag) for every checked flag its program does not have."""
    unknown = []
    for span in spans:
        if span.is_link or span.document == "CHANGELOG.md":
            continue  # the changelog also names flags that are gone
        program = program_of(span)
        if program is None:
            continue
        for match in _FLAG.finditer(span.text):
            flag = match.group(1)
            if not flag_known(flag, program, known):
                unknown.append((span, flag))
    return unknown


def unknown_metrics(text, document, metric_names):
    """(line, word) for every detlogp_ metric word not in metric_names."""
    unknown = []
    for number, line in enumerate(text.splitlines(), start=1):
        for word in _METRIC.findall(line):
            if word not in NOT_METRICS and word not in metric_names:
                unknown.append((f"{document}:{number}", word))
    return unknown


_SECTION_REF = re.compile(r'(docs/[a-z_]+\.md),\s*"([^"]+)"')
_COMMENT_LEADER = re.compile(r"\n[ \t]*(?://+|#+|\*+|--)?[ \t]*")
_SOURCE_SUFFIXES = {".h", ".cc", ".cu", ".cuh", ".py", ".sh", ".md", ".bzl", ".toml", ".yaml", ""}


def headings(text):
    """Every heading's title, also without a trailing "(...)"."""
    titles = set()
    for m in re.finditer(r"^#+\s+(.+)$", text, re.M):
        title = m.group(1).strip()
        titles.add(title)
        titles.add(re.sub(r"\s*\([^()]*\)$", "", title))
    return titles


def section_refs(text):
    """(doc, title) for every `docs/NAME.md, "Title"` in a text, comment
    leaders of wrapped lines removed."""
    joined = _COMMENT_LEADER.sub(" ", text)
    return [(m.group(1), " ".join(m.group(2).split())) for m in _SECTION_REF.finditer(joined)]


def source_files(root=REPO_ROOT):
    """The tree's text sources, less this file (its examples are made up)."""
    skip = {".git", "node_modules", "__pycache__"}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if d not in skip
            and not d.startswith((".venv", "bazel-", ".device"))
            and not d.endswith(".egg-info")
        ]
        for name in files:
            path = pathlib.Path(folder) / name
            if path == pathlib.Path(__file__).resolve():
                continue
            if path.suffix in _SOURCE_SUFFIXES or name == "BUILD":
                yield path


def missing_sections(files, root=REPO_ROOT):
    """(file, doc, title) for every section reference whose heading is gone."""
    cache = {}
    missing = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for doc, title in section_refs(text):
            if doc not in cache:
                target = root / doc
                cache[doc] = headings(target.read_text()) if target.is_file() else None
            if cache[doc] is None or title not in cache[doc]:
                shown = path.relative_to(root) if path.is_relative_to(root) else path
                missing.append((str(shown), doc, title))
    return missing


# ---------------------------------------------------------------- the API
@dataclasses.dataclass
class ProtoEntity:
    """A service, message or enum of a .proto file: its name (`Outer.Inner`
    when nested) and its rows, {name: what docs/api.md must say of it}: an
    RPC's `Request → stream Response`, a field's number and type, an enum
    value's number."""

    kind: str  # "service", "message" or "enum"
    name: str
    rows: dict = dataclasses.field(default_factory=dict)


_PROTO_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[A-Za-z_][\w.]*|-?\d+|\S')


def _proto_tokens(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return _PROTO_TOKEN.findall(text)


def parse_proto(text):
    """Every service, message and enum of a proto3 file, in file order (a
    parser for what proto/ uses: nested messages and enums, oneofs, maps,
    streams, options and reserved ranges, which it skips)."""
    tokens = _proto_tokens(text)
    entities = []
    position = 0

    def skip_statement():
        nonlocal position
        depth = 0
        while position < len(tokens):
            token = tokens[position]
            position += 1
            if token in "[{(":
                depth += 1
            elif token in "]})":
                depth -= 1
                if depth == 0 and token == "}":
                    return
            elif token == ";" and depth == 0:
                return

    def expect(token):
        nonlocal position
        if tokens[position] != token:
            context = " ".join(tokens[max(0, position - 8) : position + 4])
            raise ValueError(f"proto: expected {token!r} at ... {context} ...")
        position += 1

    def open_block(kind, name):
        entity = ProtoEntity(kind, name)
        entities.append(entity)
        expect("{")
        return entity

    def parse_enum(name):
        nonlocal position
        entity = open_block("enum", name)
        while tokens[position] != "}":
            if tokens[position] in ("option", "reserved"):
                skip_statement()
                continue
            value = tokens[position]
            position += 1
            expect("=")
            entity.rows[value] = tokens[position]
            position += 1
            skip_statement()  # [options] ;
        position += 1

    def parse_message(name):
        nonlocal position
        entity = open_block("message", name)
        while tokens[position] != "}":
            token = tokens[position]
            if token == ";":
                position += 1
            elif token in ("option", "reserved", "extensions"):
                skip_statement()
            elif token in ("message", "enum"):
                nested = f"{name}.{tokens[position + 1]}"
                position += 2
                parse_message(nested) if token == "message" else parse_enum(nested)
            elif token == "oneof":
                position += 2
                expect("{")
                while tokens[position] != "}":
                    if tokens[position] == "option":
                        skip_statement()
                        continue
                    parse_field(entity)
                position += 1
            else:
                parse_field(entity)
        position += 1

    def parse_field(entity):
        nonlocal position
        label = ""
        if tokens[position] in ("repeated", "optional"):
            label = tokens[position] + " "
            position += 1
        if tokens[position] == "map":
            key, value = tokens[position + 2], tokens[position + 4]
            field_type = f"map<{key}, {value}>"
            position += 6
        else:
            field_type = tokens[position]
            position += 1
        field = tokens[position]
        position += 1
        expect("=")
        entity.rows[field] = f"{tokens[position]} | {label}{field_type}"
        position += 1
        skip_statement()

    def parse_service(name):
        nonlocal position
        entity = open_block("service", name)
        while tokens[position] != "}":
            if tokens[position] != "rpc":
                skip_statement()
                continue
            rpc = tokens[position + 1]
            position += 2
            sides = []
            for keyword in (None, "returns"):
                if keyword:
                    expect(keyword)
                expect("(")
                stream = ""
                if tokens[position] == "stream":
                    stream = "stream "
                    position += 1
                sides.append(stream + tokens[position])
                position += 1
                expect(")")
            entity.rows[rpc] = f"{sides[0]} → {sides[1]}"
            if tokens[position] == "{":
                skip_statement()  # { options }
                if position < len(tokens) and tokens[position] == ";":
                    position += 1
            else:
                expect(";")
        position += 1

    while position < len(tokens):
        token = tokens[position]
        if token in ("message", "enum", "service"):
            name = tokens[position + 1]
            position += 2
            {"message": parse_message, "enum": parse_enum, "service": parse_service}[token](name)
        else:
            skip_statement()  # syntax, package, import, option
    return entities


def _cells(line):
    return [" ".join(cell.replace("`", "").split()) for cell in line.strip().strip("|").split("|")]


def api_doc_sections(text):
    """{heading's code-span name: [table rows, each a list of cells]} for
    every heading that is a code span (`### `LogProbRequest``). A table's
    header row (the one above its |---| line) is not a row."""
    sections = {}
    rows = None
    for line in text.splitlines():
        heading = re.match(r"^#+\s+`([\w.]+)`\s*$", line)
        if heading:
            rows = sections.setdefault(heading.group(1), [])
        elif line.startswith("#"):
            rows = None
        elif rows is not None and re.match(r"^\|[\s|:-]+$", line):
            if rows:
                rows.pop()
        elif rows is not None and line.startswith("|"):
            rows.append(_cells(line))
    return sections


def missing_from_api_doc(entities, doc_text):
    """What docs/api.md lacks or gets wrong, one line each: a missing heading,
    a missing or wrong row, a row naming what the proto does not have."""
    sections = api_doc_sections(doc_text)
    problems = []
    for entity in entities:
        rows = sections.get(entity.name)
        if rows is None:
            problems.append(f"{entity.kind} {entity.name}: no heading `{entity.name}`")
            continue
        documented = {row[0]: row for row in rows if row}
        for name, says in entity.rows.items():
            row = documented.get(name)
            cells = [" ".join(c.split()) for c in says.split(" | ")]
            if row is None:
                problems.append(f"{entity.kind} {entity.name}: no row for {name} ({says})")
            elif row[1 : 1 + len(cells)] != cells:
                problems.append(
                    f"{entity.kind} {entity.name}: the row for {name} says "
                    f"{' | '.join(row[1 : 1 + len(cells)])!r}, the proto {says!r}"
                )
        for name in documented.keys() - entity.rows.keys():
            problems.append(f"{entity.kind} {entity.name}: documents {name}, which the proto lacks")
    return problems


def proto_entities(root=REPO_ROOT):
    return [
        e
        for path in sorted((root / "proto").rglob("*.proto"))
        for e in parse_proto(path.read_text())
    ]


# ------------------------------------------------------- Python signatures
_SIGNATURE = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$", re.S)
_ELIDED = "_elided_"


def signature_spans(text):
    """(section heading, span text) for every inline code span of a Markdown
    text, spans wrapped over lines included (fenced blocks are skipped)."""
    section = ""
    prose = []
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            prose.append("")
            continue
        if in_fence:
            continue
        if line.startswith("#"):
            prose.append(f"\x00{line}")
        else:
            prose.append(line)
    spans = []
    for part in "\n".join(prose).split("\x00"):
        heading = part.split("\n", 1)[0] if part.startswith("#") else section
        section = heading
        for paragraph in re.split(r"\n\s*\n", part):
            for m in re.finditer(r"`([^`]+)`", paragraph):
                spans.append((section, " ".join(m.group(1).split())))
    return spans


def _resolve(name, section):
    """The callable a documented name means, or None when the name is not
    the package's (torch.compile, np.zeros); raises LookupError when it is
    the package's and does not exist."""
    import detlogp

    parts = name.split(".")
    if parts[0] == "detlogp":
        obj, parts = detlogp, parts[1:]
    elif parts[0] == "client":
        obj, parts = detlogp.Client, parts[1:]
    elif parts[0] == "dtorch":
        obj, parts = importlib.import_module("detlogp.torch"), parts[1:]
    elif len(parts) == 1:
        scopes = [importlib.import_module("detlogp.ops")] if "ops" in section.lower() else []
        scopes += [detlogp.Client, detlogp]
        obj = next((scope for scope in scopes if hasattr(scope, parts[0])), None)
        if obj is None:
            raise LookupError(f"{name}: neither a detlogp.Client method nor a detlogp function")
    else:
        return None
    for i, part in enumerate(parts):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            except ImportError:
                pass
        if not hasattr(obj, part):
            raise LookupError(f"{name}: {'.'.join(parts[: i + 1])} does not exist")
        obj = getattr(obj, part)
    return obj


def _documented_parameters(params):
    """The parameters of a documented signature as ast arguments, or None
    when the text is a call (arguments that are not names)."""
    elided = re.sub(r"(^|,)\s*(\.\.\.|…)\s*(?=,|$)", rf"\1 {_ELIDED}", params)
    elided = elided.replace("…", "...")
    try:
        tree = ast.parse(f"def f({elided}): pass")
    except SyntaxError:
        return None
    return tree.body[0].args


def signature_mismatches(text):
    """(span, what is wrong) for every documented signature that disagrees
    with the code (the module's rules)."""
    problems = []
    for section, span in signature_spans(text):
        m = _SIGNATURE.match(span)
        if not m:
            continue
        name, params = m.group(1), m.group(2).strip()
        documented = _documented_parameters(params) if params else None
        if params and documented is None:
            continue  # a call with values, not a signature
        try:
            target = _resolve(name, section)
        except LookupError as error:
            problems.append((span, str(error)))
            continue
        if target is None or not params:
            continue
        real = [
            p
            for p in inspect.signature(target).parameters.values()
            if p.name not in ("self", "cls")
        ]
        problems.extend((span, why) for why in _compare_parameters(documented, real))
    return problems


def _compare_parameters(documented, real):
    positional_kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    real_positional = [p for p in real if p.kind in positional_kinds]
    by_name = {p.name: p for p in real}
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in real)
    positional = documented.posonlyargs + documented.args
    defaults = [None] * (len(positional) - len(documented.defaults)) + documented.defaults
    elided = any(a.arg == _ELIDED for a in positional + documented.kwonlyargs)
    why = []
    named = set()
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        if arg.arg == _ELIDED:
            continue
        named.add(arg.arg)
        if index >= len(real_positional) or real_positional[index].name != arg.arg:
            where = "keyword-only" if arg.arg in by_name else "not a parameter"
            if arg.arg in by_name and by_name[arg.arg].kind in positional_kinds:
                where = f"positional parameter {real_positional.index(by_name[arg.arg]) + 1}"
            why.append(
                f"{arg.arg} is documented as positional parameter {index + 1}; it is {where}"
            )
            continue
        why.extend(_compare_default(arg.arg, default, real_positional[index]))
    for arg, default in zip(documented.kwonlyargs, documented.kw_defaults):
        if arg.arg == _ELIDED:
            continue
        named.add(arg.arg)
        parameter = by_name.get(arg.arg)
        if parameter is None:
            if not takes_kwargs:
                why.append(f"{arg.arg} is not a parameter")
            continue
        if parameter.kind != inspect.Parameter.KEYWORD_ONLY:
            why.append(f"{arg.arg} is documented as keyword-only; it is positional")
        why.extend(_compare_default(arg.arg, default, parameter))
    if not elided:
        required = [
            p.name
            for p in real
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        why.extend(f"required parameter {n} is not documented" for n in required if n not in named)
    return why


def _compare_default(name, default, parameter):
    if default is None:  # documented without a default
        if parameter.default is not inspect.Parameter.empty:
            return [f"{name} is documented as required; its default is {parameter.default!r}"]
        return []
    if isinstance(default, ast.Constant) and default.value is Ellipsis:
        return []  # "=...": the default is not stated
    if parameter.default is inspect.Parameter.empty:
        return [f"{name} is documented with a default; it is required"]
    try:  # a constant, or arithmetic on constants (4<<20)
        value = eval(compile(ast.Expression(default), "<doc>", "eval"), {"__builtins__": {}})
    except Exception:
        return []  # a name the doc spells its own way (V)
    if value != parameter.default:
        return [f"{name}'s default is documented as {value!r}; it is {parameter.default!r}"]
    return []


def describe(items):
    return "\n".join(
        f"  {s.document}:{s.line}: {w!r} in `{s.text}`" if isinstance(s, Span) else f"  {s}: {w!r}"
        for s, w in items
    )


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def documents():
    return {str(p.relative_to(REPO_ROOT)): p.read_text() for p in DOCUMENTS}


@pytest.fixture(scope="module")
def all_spans(documents):
    return [span for name, text in documents.items() for span in spans_of(text, name)]


def _binary(env, relative, build_target):
    path = pathlib.Path(os.environ.get(env) or REPO_ROOT / relative)
    if not path.exists():
        pytest.fail(f"no {path}: run `bazel build {build_target}` (or set {env})", pytrace=False)
    return path


def _help_flags(command):
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return set(re.findall(r"^\s+--([a-z0-9_]+) \(", out.stdout + out.stderr, re.M))


def _console_flags():
    console = [sys.executable, "-c", "import sys; from detlogp.cli import main; main()"]
    top = subprocess.run([*console, "--help"], capture_output=True, text=True, timeout=60).stdout
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", top))
    commands = re.search(r"\{([a-z,_-]+)\}", top)
    for command in commands.group(1).split(",") if commands else []:
        sub = subprocess.run([*console, command, "--help"], capture_output=True, text=True)
        flags |= set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", sub.stdout))
    return flags


@pytest.fixture(scope="module")
def known_flags():
    server = server_binary_for_tests(REPO_ROOT)
    cli = _binary("DETLOGP_CLI", "bazel-bin/client/detlogp_cli", "//client:detlogp_cli")
    known = {
        "server": _help_flags([str(server), "--help"]),
        "cli": _help_flags([str(cli), "--help"]),
        "console": _console_flags(),
    }
    for program, names in known.items():
        assert len(names) > 5, f"read no flags from the {program}'s help"
    # absl's --help lists a program's own flags, not the help flags themselves.
    for program in ("server", "cli"):
        known[program] |= {"help", "helpfull"}
    known["any"] = known["server"] | known["cli"] | known["console"]
    return known


@pytest.fixture(scope="module")
def metric_names(tmp_path_factory):
    """Metric families of a CPU server after a scored call (extras too) and a
    projection."""
    model = TestModel(tmp_path_factory.mktemp("docs-model"))
    binary = server_binary_for_tests(REPO_ROOT)
    with LocalServer(binary, model.flags + ["--cpu_threads=1"], metrics=True) as server:
        rng = np.random.default_rng(0)
        with detlogp.Client(server.target, timeout=30.0) as client:
            hidden = rng.standard_normal((4, model.hidden), dtype=np.float32)
            client.logprobs(hidden, [1, 2, 3, 4], return_entropy=True, top_k=3)
            client.project(rng.standard_normal((8, 96), dtype=np.float32))
        assert server.metrics_port, "the server has no --metrics_port"
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    for sample in re.findall(r"^([a-z_][a-z0-9_]*)", text, re.M):
        names.add(sample)
        names.add(re.sub(r"_(bucket|sum|count)$", "", sample))
    assert "detlogp_requests_total" in names, text[:2000]
    return names


# ---------------------------------------------------------------- the checks
def test_every_document_exists_and_is_read():
    for path in DOCUMENTS:
        assert path.is_file(), path
    assert (REPO_ROOT / "docs/api.md") in DOCUMENTS


def test_paths_the_docs_name_exist(all_spans):
    missing = list(missing_paths(all_spans))
    assert not missing, "paths the docs name that are not in the tree:\n" + describe(missing)


def test_flags_the_docs_name_exist(all_spans, known_flags):
    unknown = unknown_flags(all_spans, known_flags)
    assert not unknown, "flags the docs name that --help does not list:\n" + describe(unknown)


def test_sections_the_tree_points_at_exist():
    missing = missing_sections(source_files())
    assert not missing, "sections named in the tree that the docs lack:\n" + "\n".join(
        f"  {f}: {doc}, {title!r}" for f, doc, title in missing
    )


def test_metrics_the_docs_name_exist(documents, metric_names):
    unknown = [
        item
        for name, text in documents.items()
        for item in unknown_metrics(text, name, metric_names)
    ]
    assert not unknown, "metric names the docs use that /metrics lacks:\n" + describe(unknown)


def test_the_docs_name_some_of_each(all_spans, documents):
    """Guards the extraction itself: an empty harvest would pass every check."""
    entries = top_level_entries(REPO_ROOT)
    assert sum(len(path_words(s, entries)) for s in all_spans) > 100
    assert sum(1 for s in all_spans if program_of(s) == "server") > 3
    assert sum(1 for s in all_spans if program_of(s) == "any") > 30
    assert sum(1 for s in all_spans if program_of(s) == "cli") > 3
    assert sum(len(_METRIC.findall(t)) for t in documents.values()) > 20


def test_the_api_reference_covers_the_proto():
    entities = proto_entities()
    missing = missing_from_api_doc(entities, (REPO_ROOT / "docs/api.md").read_text())
    assert not missing, "docs/api.md against proto/:\n" + "\n".join(f"  {m}" for m in missing)


def test_the_readme_signatures_match_the_code():
    text = (REPO_ROOT / "client/python/README.md").read_text()
    wrong = signature_mismatches(text)
    assert not wrong, "client/python/README.md signatures against the code:\n" + "\n".join(
        f"  `{span}`: {why}" for span, why in wrong
    )


# ------------------------------------------------ the checker can fail
MADE_UP = """
See `server/no_such_file.h` and [the guide](docs/no_such_page.md), and
`//client:no_such_target`. Start with `detlogp_server --no_such_flag=1`,
run `detlogp_cli score --random_rowz=4`, set `--max_top_kk`, and scrape
`detlogp_rows_made_up_total`.

```sh
tools/serve.sh --weights=x.safetensors --port=1
tools/no_such_script.sh
```

Not checked: `pip install --no-deps x`, `logp_extras_bench.py --seed 8`.
"""


def test_the_checker_finds_made_up_names(known_flags, metric_names):
    spans = spans_of(MADE_UP, "made-up")
    paths = {w for _, w in missing_paths(spans)}
    assert paths == {
        "server/no_such_file.h",
        "docs/no_such_page.md",
        "//client:no_such_target",
        "tools/no_such_script.sh",
    }
    flags = {f for _, f in unknown_flags(spans, known_flags)}
    assert flags == {"no_such_flag", "random_rowz", "max_top_kk"}
    metrics = {w for _, w in unknown_metrics(MADE_UP, "made-up", metric_names)}
    assert metrics == {"detlogp_rows_made_up_total"}


def test_the_section_check_finds_a_wrapped_made_up_title(tmp_path):
    source = tmp_path / "x.h"
    source.write_text(
        '// see docs/kernels.md, "Top-k\n// floors" and docs/kernels.md, "No such\n// section".\n'
        '# and docs/performance.md, "Serving end to end"\n'
    )
    assert section_refs(source.read_text()) == [
        ("docs/kernels.md", "Top-k floors"),
        ("docs/kernels.md", "No such section"),
        ("docs/performance.md", "Serving end to end"),
    ]
    assert missing_sections([source]) == [(str(source), "docs/kernels.md", "No such section")]


def test_the_checker_accepts_real_names(known_flags, metric_names):
    text = (
        "`tools/serve.sh --port=6000` `detlogp_cli score --random_rows=4` "
        "`detlogp_cli project --nohash_y` `--max_top_k` `server/server.h` "
        "`//server:detlogp_server` `detlogp_queue_rows` `detlogp_batch_rows_bucket`"
    )
    spans = spans_of(text, "real")
    assert not missing_paths(spans)
    assert not unknown_flags(spans, known_flags)
    assert not unknown_metrics(text, "real", metric_names)


def test_the_proto_parser_reads_every_kind_of_entry():
    entities = {e.name: e for e in proto_entities()}
    kinds = {e.kind for e in entities.values()}
    assert kinds == {"service", "message", "enum"}
    assert sum(e.kind == "service" for e in entities.values()) >= 4
    assert entities["LogProbService"].rows["StreamLogProbs"] == (
        "stream LogProbRequest → stream LogProbResponse"
    )
    assert entities["LogProbRequest"].rows["target_ids"] == "3 | repeated int64"
    assert entities["ModelVersionStatus.State"].rows["READY"] == "1"
    assert entities["UploadModelRequest"].rows["chunk"] == "2 | bytes"  # in a oneof
    made_up = parse_proto(
        'syntax = "proto3"; /* a block\n comment */ message A { map<string, int64> m = 1'
        " [deprecated = true]; reserved 2, 3; message B { enum E { X = 0; } } }"
        " service S { rpc R(stream A) returns (A.B) { option deadline = 1; } }"
    )
    assert [(e.kind, e.name, e.rows) for e in made_up] == [
        ("message", "A", {"m": "1 | map<string, int64>"}),
        ("message", "A.B", {}),
        ("enum", "A.B.E", {"X": "0"}),
        ("service", "S", {"R": "stream A → A.B"}),
    ]


def test_the_api_check_finds_what_the_doc_lacks():
    entities = proto_entities()
    doc = (REPO_ROOT / "docs/api.md").read_text()
    assert not missing_from_api_doc(entities, doc)
    # One field's row removed, one number changed, one RPC's row removed, a
    # made-up field, and a whole service's heading gone.
    broken = re.sub(r"^\| `return_timing` \|.*\n", "", doc, count=1, flags=re.M)
    broken = re.sub(r"^(\| `top_k` \| )9( \|)", r"\g<1>19\2", broken, count=1, flags=re.M)
    broken = re.sub(r"^\| `UnloadModel` \|.*\n", "", broken, count=1, flags=re.M)
    broken = broken.replace(
        "| `request_id` | 1 |",
        "| `request_idd` | 11 | `string` | made up |\n| `request_id` | 1 |",
        1,
    )
    broken = broken.replace("`SharedMemoryService`", "`SharedMemoryServices`")
    assert broken.count("\n") < doc.count("\n"), "the edits above no longer match docs/api.md"
    problems = "\n".join(missing_from_api_doc(entities, broken))
    assert "message LogProbRequest: no row for return_timing (10 | bool)" in problems
    assert "message LogProbRequest: the row for top_k says '19 | int64'" in problems
    assert "service ModelRepositoryService: no row for UnloadModel" in problems
    assert "message LogProbRequest: documents request_idd, which the proto lacks" in problems
    assert "service SharedMemoryService: no heading" in problems


def test_the_signature_check_finds_wrong_signatures():
    wrong = signature_mismatches(
        "## Scoring\n\n"
        "`info(timeout=None, *, model=None, version=None)`, "
        "`list_models(timeout=5)`, `unload_model(name)`, `client.no_such_method()`, "
        "`client.project(x, rows_per_chunk=0)`, `stream(items, *, model=None, colour=1)`\n\n"
        "## Trainer-side ops\n\n`h3_projection(x, weight, bias)`\n"
    )
    found = {(span.split("(")[0], why) for span, why in wrong}
    assert found == {
        ("info", "timeout is documented as positional parameter 1; it is keyword-only"),
        ("info", "model is documented as keyword-only; it is positional"),
        ("info", "version is documented as keyword-only; it is positional"),
        ("list_models", "timeout's default is documented as 5; it is None"),
        ("unload_model", "required parameter version is not documented"),
        ("client.no_such_method", "client.no_such_method: no_such_method does not exist"),
        (
            "client.project",
            "rows_per_chunk is documented as positional parameter 2; it is keyword-only",
        ),
        ("stream", "colour is not a parameter"),
        ("h3_projection", "bias is documented as required; its default is None"),
    }
    right = (
        "`info(model=None, version=None, *, timeout=None)` `logprobs(hidden, targets, *, ...,"
        " model=None, version=None)` `upload_model(name, weight, bias=None, vocab_size=None,"
        " chunk_bytes=4<<20, *, version=None)` `torch.compile(fullgraph=True)`"
        " `client.logprobs(hidden, [1, 2], top_k=5)` `Client(targets)`"
    )
    assert signature_mismatches(right) == []


def test_the_readme_has_signatures_to_check():
    """Guards the harvest: a README whose spans stopped parsing would pass."""
    text = (REPO_ROOT / "client/python/README.md").read_text()
    checked = [
        span
        for _, span in signature_spans(text)
        if _SIGNATURE.match(span) and _SIGNATURE.match(span).group(2).strip()
    ]
    assert len(checked) >= 8, checked
