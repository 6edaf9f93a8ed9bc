"""Patches to the frameworks' own source trees, described as data and applied idempotently.

A patch is a YAML file under ``patches/<framework>/`` (read them: each says why it exists and
for which versions). It holds edits of two kinds, both matched on content rather than line
numbers, so that one patch fits several releases whose lines moved or were re-indented:

- ``replace``: inside one function (``scope``), each occurrence of the ``find`` lines (compared
  without leading whitespace) becomes the ``replace`` lines, re-indented to where they land.
- ``add_method``: every class whose name matches ``class_pattern`` in the files matching
  ``files`` gets ``method`` (its ``text``) appended to its body unless it already has one.
  ``classes: site`` instead of a pattern targets the classes the site names (the Qwen3.5 model
  classes of a MindFormers fork, ``mindformers.qwen35_class``): public MindFormers has none, so
  no pattern could know them; check and apply then take them as ``classes``.

Every patch in a tree is in one of four states: ``applied`` (nothing left to do),
``applicable`` (every edit finds its place), ``not-needed`` (the framework version is outside
the patch's ``needed`` range) or ``conflict`` (some edit finds neither its target nor its
result: the report names the file and the edit). Applying an applied or not-needed patch
changes nothing; applying a conflicting one raises :class:`PatchError` and writes nothing.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import yaml

from crossalign.versions import version_tuple

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"

Framework = Literal["megatron", "mindformers"]
Status = Literal["applied", "applicable", "not-needed", "conflict"]


class PatchError(ValueError):
    """A patch that cannot be used or applied; the message names the patch, file and edit."""


@dataclass(frozen=True)
class Replace:
    file: str
    scope: str
    find: tuple[str, ...]
    replace: tuple[str, ...]
    occurrences: tuple[int, int]

    def label(self, index: int) -> str:
        return f"{self.file}, edit {index} (in {self.scope})"


@dataclass(frozen=True)
class AddMethod:
    files: str
    class_pattern: str | None  # None: the classes the site names
    method: str
    text: str

    def label(self, index: int) -> str:
        target = f"classes /{self.class_pattern}/" if self.class_pattern else "the site's classes"
        return f"{self.files}, edit {index} (method {self.method} on {target})"


Edit = Replace | AddMethod


@dataclass(frozen=True)
class Patch:
    name: str
    framework: Framework
    summary: str
    edits: tuple[Edit, ...]
    needed_from: tuple[int, ...] | None = None
    needed_before: tuple[int, ...] | None = None
    optional: bool = False
    source: Path | None = None

    def needed_for(self, version: tuple[int, ...]) -> bool:
        if self.needed_from is not None and version < self.needed_from:
            return False
        return not (self.needed_before is not None and version >= self.needed_before)

    @property
    def needed_range(self) -> str:
        low = ".".join(map(str, self.needed_from)) if self.needed_from else "any"
        high = ".".join(map(str, self.needed_before)) if self.needed_before else "any"
        return f">= {low}, < {high}"


@dataclass
class EditReport:
    label: str
    status: Literal["applied", "applicable", "conflict"]
    detail: str
    # file path -> new text, filled only for an applicable edit
    changes: dict[Path, str] = field(default_factory=dict)


@dataclass
class PatchReport:
    patch: Patch
    root: Path
    status: Status
    detail: str
    version: tuple[int, ...] | None
    edits: list[EditReport] = field(default_factory=list)

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "unknown"


# ---- reading the patch files -----------------------------------------------------------------


def _lines(text: str) -> tuple[str, ...]:
    return tuple(textwrap.dedent(text).strip("\n").splitlines())


def _edit_from_dict(raw: dict, where: str) -> Edit:
    kind = raw.get("kind")
    try:
        if kind == "replace":
            low, high = raw.get("occurrences", [1, 1])
            return Replace(file=raw["file"], scope=raw["scope"], find=_lines(raw["find"]),
                           replace=_lines(raw["replace"]), occurrences=(int(low), int(high)))
        if kind == "add_method":
            if raw.get("classes") not in (None, "site"):
                raise PatchError(f"{where}: classes: {raw['classes']!r} (only 'site' is known)")
            pattern = None if raw.get("classes") == "site" else raw["class_pattern"]
            return AddMethod(files=raw["files"], class_pattern=pattern, method=raw["method"],
                             text=textwrap.dedent(raw["text"]).strip("\n"))
    except KeyError as exc:
        raise PatchError(f"{where}: edit of kind {kind!r} lacks the key {exc.args[0]!r}") from None
    raise PatchError(f"{where}: unknown edit kind {kind!r} (known: replace, add_method)")


def read_patch(path: Path) -> Patch:
    """One patch file."""
    try:
        raw = yaml.safe_load(path.read_text())
        needed = raw.get("needed") or {}
        return Patch(
            name=raw["name"],
            framework=raw["framework"],
            summary=raw["summary"],
            edits=tuple(_edit_from_dict(edit, f"{path} edit {i}") for i, edit in enumerate(raw["edits"], 1)),
            needed_from=version_tuple(needed["from"]) if "from" in needed else None,
            needed_before=version_tuple(needed["before"]) if "before" in needed else None,
            optional=bool(raw.get("optional", False)),
            source=path,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise PatchError(f"{path}: not a patch description ({exc})") from None


def load_patches(framework: Framework | None = None, patch_dir: Path = PATCH_DIR) -> list[Patch]:
    """Every shipped patch (of one framework), in name order."""
    patches = [read_patch(path) for path in sorted(patch_dir.glob("*/*.yaml"))]
    return [p for p in patches if framework is None or p.framework == framework]


def load_patch(name: str, patch_dir: Path = PATCH_DIR) -> Patch:
    for patch in load_patches(patch_dir=patch_dir):
        if patch.name == name:
            return patch
    known = ", ".join(p.name for p in load_patches(patch_dir=patch_dir))
    raise PatchError(f"no patch named {name!r} (known: {known})")


# ---- the framework tree ----------------------------------------------------------------------


def megatron_core_version(root: Path) -> tuple[int, ...] | None:
    """The megatron-core version of a Megatron-LM checkout (megatron/core/package_info.py)."""
    info = root / "megatron" / "core" / "package_info.py"
    if not info.exists():
        return None
    text = info.read_text()
    parts = [re.search(rf"^{key}\s*=\s*(\d+)", text, re.MULTILINE) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    return tuple(int(p.group(1)) for p in parts)  # type: ignore[union-attr]


def framework_version(root: Path, framework: Framework) -> tuple[int, ...] | None:
    return megatron_core_version(root) if framework == "megatron" else None


# ---- edits ------------------------------------------------------------------------------------


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _block_positions(lines: list[str], block: tuple[str, ...], start: int, end: int) -> list[int]:
    """Line indices in [start, end) where block begins (lines compared without surrounding whitespace)."""
    wanted = [b.strip() for b in block]
    hits = []
    for i in range(start, end - len(block) + 1):
        if all(lines[i + j].strip() == wanted[j] for j in range(len(block))):
            hits.append(i)
    return hits


def _function_span(source: str, name: str) -> tuple[int, int] | None:
    """0-based [start, end) line span of the first function called name, at any depth."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node.lineno - 1, node.end_lineno or node.lineno
    return None


def _read(path: Path, staged: dict[Path, str]) -> str:
    return staged[path] if path in staged else path.read_text()


def _check_replace(edit: Replace, root: Path, label: str, staged: dict[Path, str]) -> EditReport:
    path = root / edit.file
    if not path.exists():
        return EditReport(label, "conflict", f"{path} does not exist")
    source = _read(path, staged)
    try:
        span = _function_span(source, edit.scope)
    except SyntaxError as exc:
        return EditReport(label, "conflict", f"{path} is not valid Python ({exc.msg}, line {exc.lineno})")
    if span is None:
        return EditReport(label, "conflict", f"{path} has no function {edit.scope}()")
    lines = source.splitlines(keepends=True)
    start, end = span
    done = _block_positions(lines, edit.replace, start, end)
    covered = {i + j for i in done for j in range(len(edit.replace))}
    todo = [i for i in _block_positions(lines, edit.find, start, end) if i not in covered]
    low, high = edit.occurrences
    found = f"{len(todo)} to patch, {len(done)} patched"
    if not todo and not done:
        return EditReport(label, "conflict",
                          f"{path}: neither the line(s) to replace ({edit.find[0].strip()!r}) nor the patched "
                          f"form were found in {edit.scope}()")
    if not low <= len(todo) + len(done) <= high:
        return EditReport(label, "conflict", f"{path}: expected {low}..{high} occurrences in {edit.scope}(), "
                          f"found {found}")
    if not todo:
        return EditReport(label, "applied", found)
    for i in reversed(todo):
        indent = _indent_of(lines[i])
        new = [(indent + line if line.strip() else "") + "\n" for line in edit.replace]
        lines[i: i + len(edit.find)] = new
    return EditReport(label, "applicable", found, {path: "".join(lines)})


def _matching_classes(tree: ast.AST, pattern: re.Pattern[str]) -> list[ast.ClassDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and pattern.search(n.name)]


def _class_regex(edit: AddMethod, classes: Sequence[str]) -> re.Pattern[str]:
    return re.compile(edit.class_pattern or "^(" + "|".join(map(re.escape, classes)) + ")$")


def defined_classes(root: Path, files: str, names: Sequence[str]) -> dict[str, list[str]]:
    """Where each of ``names`` is defined in the files matching ``files`` under root (empty list: nowhere)."""
    found: dict[str, list[str]] = {name: [] for name in names}
    pattern = re.compile("^(" + "|".join(map(re.escape, names)) + ")$")
    for path in sorted(Path(root).glob(files)):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for cls in _matching_classes(tree, pattern):
            found[cls.name].append(str(path.relative_to(root)))
    return found


def _check_add_method(edit: AddMethod, root: Path, label: str, staged: dict[Path, str],
                      classes: Sequence[str]) -> EditReport:
    pattern = _class_regex(edit, classes)
    changes: dict[Path, str] = {}
    having, lacking = [], []
    for path in sorted(root.glob(edit.files)):
        source = _read(path, staged)
        try:
            classes = _matching_classes(ast.parse(source), pattern)
        except SyntaxError as exc:
            return EditReport(label, "conflict", f"{path} is not valid Python ({exc.msg}, line {exc.lineno})")
        missing = []
        for cls in classes:
            has = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == edit.method
                      for n in cls.body)
            (having if has else lacking).append(f"{path.relative_to(root)}:{cls.name}")
            if not has:
                missing.append(cls)
        if missing:
            lines = source.splitlines(keepends=True)
            for cls in sorted(missing, key=lambda c: c.end_lineno or 0, reverse=True):
                indent = " " * cls.body[0].col_offset
                body = ["\n"] + [(indent + line if line.strip() else "") + "\n" for line in edit.text.splitlines()]
                end = cls.end_lineno or cls.lineno
                if end and not lines[end - 1].endswith("\n"):
                    lines[end - 1] += "\n"
                lines[end:end] = body
            changes[path] = "".join(lines)
    if not having and not lacking:
        return EditReport(label, "conflict", f"no class matching /{pattern.pattern}/ in {root / edit.files}")
    detail = "; ".join(filter(None, [f"has it: {', '.join(having)}" if having else "",
                                     f"lacks it: {', '.join(lacking)}" if lacking else ""]))
    return EditReport(label, "applicable" if lacking else "applied", detail, changes)


def _check_edit(edit: Edit, root: Path, index: int, classes: Sequence[str],
                staged: dict[Path, str] | None = None) -> EditReport:
    """One edit against the tree, seen through the texts already staged by earlier edits."""
    label = edit.label(index)
    if isinstance(edit, Replace):
        return _check_replace(edit, root, label, staged or {})
    return _check_add_method(edit, root, label, staged or {}, classes)


# ---- check and apply --------------------------------------------------------------------------


def check_patch(patch: Patch, root: Path, classes: Sequence[str] = ()) -> PatchReport:
    """Where the patch stands in the tree at root; reads only. ``classes``: the site's classes (``classes: site``)."""
    root = Path(root)
    if not root.is_dir():
        raise PatchError(f"{root}: not a directory (expected a {patch.framework} checkout)")
    if not classes and any(isinstance(e, AddMethod) and e.class_pattern is None for e in patch.edits):
        raise PatchError(f"patch {patch.name} targets the Qwen3.5 model classes of your MindFormers fork (public "
                         "MindFormers has none): name them in the site config (mindformers.qwen35_class) "
                         "or with --qwen35-class")
    version = framework_version(root, patch.framework)
    if version is not None and not patch.needed_for(version):
        return PatchReport(patch, root, "not-needed", f"version {'.'.join(map(str, version))} is outside "
                           f"{patch.needed_range}", version)
    edits = [_check_edit(edit, root, i, classes) for i, edit in enumerate(patch.edits, 1)]
    conflicts = [e for e in edits if e.status == "conflict"]
    if conflicts:
        return PatchReport(patch, root, "conflict", "; ".join(f"{e.label}: {e.detail}" for e in conflicts),
                           version, edits)
    if all(e.status == "applied" for e in edits):
        return PatchReport(patch, root, "applied", "every edit is in place", version, edits)
    pending = [f"{e.label}: {e.detail}" for e in edits if e.status == "applicable"]
    return PatchReport(patch, root, "applicable", "to do: " + "; ".join(pending), version, edits)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.crossalign-tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode)
    os.replace(tmp, path)


def apply_patch(patch: Patch, root: Path, classes: Sequence[str] = ()) -> PatchReport:
    """Apply the patch if it is applicable; a no-op when applied or not needed; PatchError on a conflict.

    Each edit is checked against the text the previous edits left (staged in memory), so two edits of
    one file compose; files are written (atomically) only once every edit fits.
    """
    report = check_patch(patch, root, classes)
    if report.status == "conflict":
        raise PatchError(f"patch {patch.name} does not fit {root}: {report.detail}")
    if report.status != "applicable":
        return report
    pending: dict[Path, str] = {}
    for index, edit in enumerate(patch.edits, 1):
        pending.update(_check_edit(edit, Path(root), index, classes, pending).changes)
    for path, text in pending.items():
        _write_atomically(path, text)
    after = check_patch(patch, root, classes)
    if after.status != "applied":
        raise PatchError(f"patch {patch.name}: after applying, the tree reads as {after.status}: {after.detail}")
    return after

