"""The docs name only what exists: every ``warmstart`` command and option they show, every Python name,
keyword and method their examples use, every file of the repository and every link (with its anchor),
and every ``WARMSTART_*`` variable they mention.

Commands are checked against the real click tree (nothing runs), Python names by importing them and
reading their signatures, variables against the package's source. A doc that shows a call the code
does not have (a method renamed, an option dropped) fails here with the file and line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from warmstart.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "server" / "README.md", *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _blocks(text: str) -> Iterator[tuple[str, str, int]]:
    """(language, body, line of its first body line) of each fenced block."""
    for m in _FENCE.finditer(text):
        yield m.group(1), m.group(2), _line_of(text, m.start(2))


def _prose(text: str) -> str:
    """The text outside fenced blocks (blocks blanked out, so offsets and line numbers stay)."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


# -- commands --------------------------------------------------------------------------------------------


def _commands(inline: bool = True) -> Iterator[tuple[Path, int, str]]:
    """Every ``warmstart NOUN ...`` command line shown: lines of shell blocks (``$ `` lines of console
    blocks) and, with ``inline``, inline code that starts with ``warmstart``."""
    for path in DOCS:
        text = path.read_text()
        for lang, body, first in _blocks(text):
            if lang not in ("bash", "sh", "shell", "console", ""):
                continue
            for n, line in enumerate(body.splitlines()):
                if lang == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                line = re.sub(r"^(\w+=\S*\s+)+", "", line.strip())  # VAR=value warmstart ...
                if line.startswith("warmstart "):
                    yield path, first + n, line
        for m in _INLINE.finditer(_prose(text) if inline else ""):
            if m.group(1).startswith("warmstart ") and not m.group(1).startswith("warmstart: "):
                yield path, _line_of(text, m.start()), m.group(1)


def _options(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help", "-h"}


def _check_command(line: str) -> list[str]:
    words = line.split("#")[0].split()
    root_options = _options(cli)
    while len(words) > 1 and words[1].strip("[]") in root_options:
        words.pop(1)
    if len(words) < 2 or words[1].isupper():  # `warmstart NOUN COMMAND`: a placeholder
        return []
    noun = cli.commands.get(words[1])
    if noun is None:
        return [f"no command `warmstart {words[1]}`"]
    if len(words) < 3 or not isinstance(noun, click.Group):
        return []
    verb = words[2]
    if verb.endswith(":") or verb in ("…", "...") or verb.isupper() or verb.startswith("["):
        return []  # a log line's prefix or a placeholder, not a command
    problems = []
    verbs = re.split(r"[/|]", verb)  # `warmstart server start/status/stop`
    for name in verbs:
        if name not in noun.commands:
            problems.append(f"no command `warmstart {words[1]} {name}`")
    if problems or len(verbs) > 1:
        return problems
    command = noun.commands[verb]
    known = _options(command)
    for word in words[3:]:
        for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", word):
            if option not in known:
                problems.append(f"`warmstart {words[1]} {verb}` has no option {option}")
    return problems


def test_every_command_and_option_in_the_docs_exists():
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {problem} ({text})"
        for path, line, text in _commands()
        for problem in _check_command(text)
    ]
    assert problems == []


def test_the_command_check_can_fail():
    assert _check_command("warmstart ett report RUN_DIR --json") == []
    assert _check_command("warmstart ett report RUN_DIR --jsn") == ["`warmstart ett report` has no option --jsn"]
    assert _check_command("warmstart cache purge") == ["no command `warmstart cache purge`"]
    assert _check_command("warmstart server start/status/halt") == ["no command `warmstart server halt`"]


# -- Python names ----------------------------------------------------------------------------------------


def _resolve(dotted: str) -> object:
    """``warmstart.a.b.C.d`` imported as far as it is a module, then looked up attribute by attribute.

    Raises:
        LookupError: a part of it does not exist.
    """
    parts = dotted.split(".")
    obj: object = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not dotted.startswith(exc.name):
                raise
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[: parts.index(attr)])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module {parts[0]!r}")


def _keyword_problems(target: object, keywords: list[str], what: str) -> list[str]:
    try:
        signature = inspect.signature(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [f"{what} takes no argument {kw!r}" for kw in keywords if kw not in params]


def _returned_classes(target: object) -> list[type]:
    """The classes a call of ``target`` returns: the class itself, or its return annotation's."""
    if inspect.isclass(target):
        return [target]
    try:
        hint = typing.get_type_hints(target).get("return")
    except Exception:
        return []
    options = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    return [c for c in options if inspect.isclass(c) and c is not type(None)]


# What the examples call their objects when they use one without building it.
_CONVENTIONAL = {
    "checkpointer": "warmstart.checkpoint.Checkpointer",
    "ckpt": "warmstart.checkpoint.Checkpointer",
    "rec": "warmstart.metrics.recorder.Recorder",
    "recorder": "warmstart.metrics.recorder.Recorder",
    "store": "warmstart.compile_cache.tiered.TieredStore",
    "exporter": "warmstart.metrics.live.Exporter",
}


class _Example(ast.NodeVisitor):
    """Checks one file's Python examples (its blocks share their imports and variables, as a reader
    reads them): imports, keyword arguments of warmstart's callables, methods of their results."""

    def __init__(self) -> None:
        self.names: dict[str, object] = {}
        self.instances: dict[str, list[type]] = {name: [_resolve(dotted)] for name, dotted in _CONVENTIONAL.items()}
        self.problems: list[tuple[int, str]] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] == "warmstart":
            for alias in node.names:
                try:
                    self.names[alias.asname or alias.name] = _resolve(f"{node.module}.{alias.name}")
                except (LookupError, ImportError) as exc:
                    self.problems.append((node.lineno, f"from {node.module} import {alias.name}: {exc}"))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        if isinstance(node.value, ast.Call):
            target = self._callee(node.value.func)
            classes = _returned_classes(target) if target is not None else []
            for t in node.targets:
                if isinstance(t, ast.Name) and classes:
                    self.instances[t.id] = classes

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        keywords = [k.arg for k in node.keywords if k.arg]
        target = self._callee(node.func)
        if target is not None:
            self.problems += [(node.lineno, p) for p in _keyword_problems(target, keywords, ast.unparse(node.func))]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in self.instances:
            for cls in self.instances[node.value.id]:
                if not hasattr(cls, node.attr):
                    self.problems.append(
                        (node.lineno, f"{node.value.id}.{node.attr}: {cls.__name__} has no attribute {node.attr!r}")
                    )

    def _callee(self, func: ast.expr) -> object | None:
        if isinstance(func, ast.Name):
            return self.names.get(func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in self.names:
                return getattr(self.names[func.value.id], func.attr, None)
            for cls in self.instances.get(func.value.id, []):
                if hasattr(cls, func.attr):
                    return getattr(cls, func.attr)
        return None


def _python_problems(path: Path) -> list[str]:
    example = _Example()
    text = path.read_text()
    for lang, body, first in _blocks(text):
        if lang != "python":
            continue
        before = len(example.problems)
        example.visit(ast.parse(body))
        example.problems[before:] = [(first + line - 1, p) for line, p in example.problems[before:]]
    # Names in the prose: `warmstart.a.b(kw=...)`.
    for m in re.finditer(r"`(warmstart(?:\.\w+)+)(\(([^`]*)\))?`", _prose(text)):
        line = _line_of(text, m.start())
        if (ROOT / m.group(1)).exists():  # a file's name (warmstart.pth), not a Python name
            continue
        try:
            target = _resolve(m.group(1))
        except (LookupError, ImportError) as exc:
            example.problems.append((line, f"{m.group(1)}: {exc}"))
            continue
        keywords = _argument_names(m.group(3) or "")
        example.problems += [(line, p) for p in _keyword_problems(target, keywords, m.group(1))]
    return [f"{path.relative_to(ROOT)}:{line}: {problem}" for line, problem in example.problems]


def _argument_names(arguments: str) -> list[str]:
    """The keywords of a call written as ``(a, b=..., c=...)``, or the parameter names of a signature
    written as ``(a, b=None, *, c=None)`` (nested calls' keywords are theirs, not these)."""
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
    except SyntaxError:
        pass
    else:
        return [k.arg for k in call.keywords if k.arg]  # type: ignore[attr-defined]
    try:
        signature = ast.parse(f"def f({arguments}): pass").body[0].args  # type: ignore[attr-defined]
    except SyntaxError:
        return []
    return [a.arg for a in (*signature.posonlyargs, *signature.args, *signature.kwonlyargs)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_name_keyword_and_method_in_the_docs_exists(path):
    assert _python_problems(path) == []


def test_the_python_check_can_fail(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Call `warmstart.metrics.nothing_here()` or `warmstart.enable(colour=1)`.\n\n```python\n"
        "from warmstart.checkpoint import Checkpointer\n\nckpt = Checkpointer('/ckpt', keep=3)\n"
        "ckpt.save_async(10)\n```\n\n```python\nfuture = checkpointer.save_async(step)\n```\n"
    )
    monkeypatch.setattr(Path, "relative_to", lambda self, other: self)
    problems = _python_problems(doc)
    assert any(":1: warmstart.metrics.nothing_here" in p for p in problems), problems
    assert any(":1: warmstart.enable takes no argument 'colour'" in p for p in problems), problems
    assert any(":7: ckpt.save_async: Checkpointer has no attribute 'save_async'" in p for p in problems), problems
    assert any(":11: checkpointer.save_async: Checkpointer has no" in p for p in problems), problems


# -- files and links -------------------------------------------------------------------------------------

#: The repository's folders: inline code that starts with one of them names a file that must exist (not
#: what a run leaves behind, such as ``warmstart-runs/``).
_TOP_LEVEL = {"warmstart", "docs", "tests", "server", "benchmarks", ".ci"}


def _path_problems(path: Path) -> list[str]:
    """Every repository path in the prose's inline code (``warmstart/compile_cache/tiered.py``,
    ``tests/preload/test_environment.py::test_x``, a glob) and every relative link, with its anchor
    (a heading's, as GitHub makes it, or an ``<a id>``), must exist."""
    text = path.read_text()
    prose = _prose(text)
    problems = []
    for m in _INLINE.finditer(prose):
        name = m.group(1).split("::")[0]
        if "/" not in name or " " in name or name.split("/")[0] not in _TOP_LEVEL:
            continue
        if not any(ROOT.glob(name.rstrip("/"))):
            problems.append((_line_of(text, m.start()), f"no file {name}"))
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
        link = m.group(1)
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            problems.append((_line_of(text, m.start()), f"no file {link}"))
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            problems.append((_line_of(text, m.start()), f"no anchor {link}"))
    return [f"{path.relative_to(ROOT)}:{line}: {problem}" for line, problem in problems]


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file: each heading's (lower case, punctuation dropped,
    spaces as hyphens, ``-1``, ``-2`` after repeats) and each ``<a id="...">``."""
    prose = _prose(path.read_text())
    anchors = set(re.findall(r'<a id="([^"]+)">', prose))
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6} +(.+?) *$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_link_in_the_docs_exists(path):
    assert _path_problems(path) == []


def test_the_file_and_link_check_can_fail(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# A title\n\nSee `warmstart/compile_cache/tiered.py`, `warmstart/compile_cache/nothing.py`,\n"
        "`tests/preload/test_environment.py::test_x`, `~/warmstart-server/writer.url` and `/etc/x/y`.\n\n"
        f"[ok](#a-title), [gone](#no-title), [file]({ROOT}/docs/preload.md#what-must-match), "
        f"[no file]({ROOT}/docs/nothing.md), [bad anchor]({ROOT}/docs/preload.md#nothing), [web](https://x.org/a.md).\n"
    )
    monkeypatch.setattr(Path, "relative_to", lambda self, other: self)
    problems = _path_problems(doc)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "no file warmstart/compile_cache/nothing.py",
        "no anchor #no-title",
        f"no file {ROOT}/docs/nothing.md",
        f"no anchor {ROOT}/docs/preload.md#nothing",
    ], problems


# -- environment variables -------------------------------------------------------------------------------


def test_every_variable_in_the_docs_is_read_by_the_code():
    source = "\n".join(p.read_text() for p in (ROOT / "warmstart").rglob("*.py"))
    # A variable the code builds from a prefix counts too (WARMSTART_METRICS_ + name).
    named = {}
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"\bWARMSTART_[A-Z0-9_]*[A-Z0-9]\b", text):
            named.setdefault(m.group(0), f"{path.relative_to(ROOT)}:{_line_of(text, m.start())}")
    missing = [f"{where}: {name}" for name, where in sorted(named.items()) if name not in source]
    assert missing == []


# -- the ETT commands, run ---------------------------------------------------------------------------------


def _ett_examples() -> list[tuple[str, list[str]]]:
    """Each ``warmstart ett`` command of the docs' shell blocks, as ``where`` and its words."""
    out = []
    for path, line, text in _commands(inline=False):
        words = text.split("#")[0].split()
        if (
            len(words) > 2
            and words[1] == "ett"
            and not any(w.startswith("[") or w.isupper() or "…" in w for w in words[2:])
        ):
            out.append((f"{path.relative_to(ROOT)}:{line}", words[1:]))
    return out


@pytest.mark.parametrize("where, words", _ett_examples(), ids=[where for where, _ in _ett_examples()])
def test_every_ett_command_in_the_docs_runs(tmp_path, where, words):
    """Each command as shown, its run directories replaced by a real run and its files put in a temp dir."""
    from click.testing import CliRunner

    from warmstart.metrics.events import write_events

    run = tmp_path / "run"
    t = 1_714_500_000.0  # 2024-04-30, before the dates the examples name
    events = [{"ts": t, "job": "job-42", "attempt": 0, "rank": 0, "event": "attempt_start", "devices": 8}]
    events += [
        {"ts": t + 10 + i, "job": "job-42", "attempt": 0, "rank": 0, "event": "step", "step": i} for i in range(30)
    ]
    events += [
        {"ts": t + 25, "job": "job-42", "attempt": 0, "rank": 0, "event": "checkpoint_committed", "step": 14},
        {"ts": t + 40, "job": "job-42", "attempt": 0, "rank": 0, "event": "train_end"},
        {"ts": t + 41, "job": "job-42", "attempt": 0, "rank": 0, "event": "attempt_end"},
    ]
    write_events(run / "events-r0-a0.jsonl", events)
    command = cli.commands["ett"].commands[words[1]]
    takes_value = {opt for p in command.params if isinstance(p, click.Option) and not p.is_flag for opt in p.opts}
    args, value_of = [], None
    for word in words[2:]:
        if value_of is not None:
            args.append(str(tmp_path / Path(word).name) if value_of == "--html" else word)
            value_of = None
        elif word.startswith("-"):
            args.append(word)
            value_of = word if word in takes_value else None
        else:
            args.append(str(run))  # a run directory (or a glob of them)
    result = CliRunner().invoke(cli, ["ett", words[1], *args])
    assert result.exit_code == 0, f"{where}: {' '.join(words)}\n{result.output}"
