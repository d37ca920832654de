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

Needs bazel-bin/server/detlogp_server and bazel-bin/client/detlogp_cli
(`bazel build //server:detlogp_server //client:detlogp_cli`, as
tools/test_python.sh does), or $DETLOGP_SERVER and $DETLOGP_CLI.
"""

import dataclasses
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
    "detlogp_client_shared_memory_refusal",
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
