"""The seed documents' public API, parsed, and a check that a compat facade matches it.

The five seed documents (``../shared/seeds/<module>.txt``) are text dumps of Sphinx pages in two
flavours, both handled here:

* rendered HTML: one line per entry, ``[- ][class ]<module>.<name>(<args>)[source]#`` (or no
  parentheses for data, whose value may follow on a later line), with a summary table above;
* sphinx-autoapi source, flattened: ``.. py:function:: name(args) docstring``, ``.. py:class::``,
  ``.. py:method::`` (options such as ``:staticmethod:`` after the signature),
  ``.. py:attribute:: name :type: T :value: V``, ``.. py:data::`` and ``.. autoapisummary::`` lists.

:func:`parse_seed` yields every public name (leading ``_`` skipped, dunders such as ``__call__``
kept) with its parameters in order: name, kind (``inspect.Parameter`` kind names) and default as
normalised source text. :func:`facade_mismatches` compares a facade module against it.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "Param", "Example", "Entry", "SeedModule", "parse_params", "parse_seed", "load_seed", "load_seeds",
    "find_seeds_dir", "require_seed", "default_matches", "signature_mismatches", "facade_mismatches",
    "attribute_mismatches",
]

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
_HEADINGS = {"functions", "classes", "data", "attributes", "exceptions", "api", "documentation", "modules",
             "submodules", "subpackages", "contents", "returns", "parameters", "example", "examples", "note",
             "notes", "return type", "raises", "yields", "warning"}
_FLAGS = ("staticmethod", "classmethod", "abstractmethod", "async", "property", "final")
_DIRECTIVE = re.compile(r"\.\.\s+(py:\w+|autoapisummary)::")
_NAME = re.compile(r"\s*(?:[\w.]+\.)?([A-Za-z_]\w*)")
_CALL = re.compile(r"^([A-Za-z_]\w*)(?:\((.*)\))?#?$")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD, VAR_POSITIONAL, KEYWORD_ONLY, VAR_KEYWORD
    default: str | None = None  # normalised source text; None: no default
    annotation: str | None = None


@dataclass(frozen=True)
class Example:
    source: tuple[str, ...]  # the ``>>>`` lines, prompt removed
    want: tuple[str, ...]  # the output lines that followed


@dataclass(frozen=True)
class Entry:
    name: str  # "fork", "SpawnPolicy", "SpawnPolicy.__call__", "DistributedContext.my_rank"
    kind: str  # function, class, method, data, attribute
    params: tuple[Param, ...] | None = None  # None: the document shows no parameter list
    value: str | None = None  # data/attribute value as source text
    flags: frozenset[str] = frozenset()
    doc: str = ""
    examples: tuple[Example, ...] = ()


@dataclass
class SeedModule:
    module: str
    entries: dict[str, Entry] = field(default_factory=dict)
    summary: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # name -> listed params

    def top(self, *kinds: str) -> dict[str, Entry]:
        """Module-level entries, optionally of the given kinds."""
        return {n: e for n, e in self.entries.items() if "." not in n and (not kinds or e.kind in kinds)}

    def public_names(self) -> set[str]:
        return set(self.top())

    def members(self, cls: str) -> dict[str, Entry]:
        return {n.split(".", 1)[1]: e for n, e in self.entries.items() if n.startswith(cls + ".")}


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _closing(text: str, start: int) -> int | None:
    """Index of the bracket closing ``text[start]``; skips strings. None if it never closes."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _top_level_split(text: str, sep: str) -> list[str]:
    parts, start, i = [], 0, 0
    while i < len(text):
        if text[i] in "([{'\"":
            end = _closing(text, i) if text[i] in "([{" else text.find(text[i], i + 1)
            i = len(text) if end is None or end < 0 else end
        elif text.startswith(sep, i) and (sep != "=" or (text[i - 1:i] not in "=!<>" and text[i + 1:i + 2] != "=")):
            parts.append(text[start:i])
            start = i + len(sep)
        i += 1
    return parts + [text[start:]]


def _src(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def parse_params(text: str) -> tuple[Param, ...]:
    """Parameters of a signature's argument text (``"x, axis_name: str | None = None"``)."""
    text = " ".join(text.translate(_QUOTES).split())
    try:
        args = ast.parse(f"def _f({text}): pass").body[0].args  # type: ignore[attr-defined]
    except SyntaxError:
        return _split_params(text)
    positional = [(a, "POSITIONAL_ONLY") for a in args.posonlyargs]
    positional += [(a, "POSITIONAL_OR_KEYWORD") for a in args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [Param(a.arg, kind, _src(d), _src(a.annotation)) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        params.append(Param(args.vararg.arg, "VAR_POSITIONAL", None, _src(args.vararg.annotation)))
    params += [Param(a.arg, "KEYWORD_ONLY", _src(d), _src(a.annotation))
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(Param(args.kwarg.arg, "VAR_KEYWORD", None, _src(args.kwarg.annotation)))
    return tuple(params)


def _split_params(text: str) -> tuple[Param, ...]:
    """Fallback for argument text that is not Python (``f=<function g>``): split on top-level commas."""
    params, kind = [], "POSITIONAL_OR_KEYWORD"
    for part in (p.strip() for p in _top_level_split(text, ",")):
        if part in ("", "/", "*"):
            kind = "KEYWORD_ONLY" if part == "*" else kind
            continue
        head, *default = _top_level_split(part, "=")
        name, *annotation = _top_level_split(head, ":")
        star = len(name) - len(name.lstrip("*"))
        this = {0: kind, 1: "VAR_POSITIONAL", 2: "VAR_KEYWORD"}[min(star, 2)]
        kind = "KEYWORD_ONLY" if star == 1 else kind
        params.append(Param(name.strip("* "), this, default[0].strip() if default else None,
                            annotation[0].strip() if annotation else None))
    return tuple(params)


def _examples(doc: str) -> tuple[Example, ...]:
    """Doctest-style examples: ``>>>`` lines and the output after them, up to a blank line or heading."""
    found: list[Example] = []
    source: list[str] = []
    want: list[str] = []
    for s in (line.strip() for line in [*doc.splitlines(), ""]):
        if s.startswith(":"):  # a ``:rtype:`` field leaked into the middle of an example
            continue
        if (s.startswith(">>>") and want) or (source and (not s or s.rstrip(":").lower() in _HEADINGS)):
            found.append(Example(tuple(source), tuple(want)))
            source, want = [], []
        if s.startswith(">>>"):
            source.append(s[3:].strip())
        elif source:
            want.append(s)
    return tuple(found)


def _signature(text: str) -> tuple[str, tuple[Param, ...] | None, str, frozenset[str]] | None:
    """``name(args) rest`` -> (name, params, rest, flags); params None when there are no parentheses.

    An argument list that never closes (a truncated dump) is parsed as far as it goes and flagged.
    """
    match = _NAME.match(text)
    if not match:
        return None
    name, rest = match.group(1), text[match.end():]
    if not rest.startswith("("):
        return name, None, rest, frozenset()
    end = _closing(rest, 0)
    if end is None:
        cut = rest[1:].split("\n", 1)[0].rstrip("#] ").rstrip(",")
        return name, parse_params(cut), "", frozenset({"truncated"})
    return name, parse_params(rest[1:end]), rest[end + 1:], frozenset()


def _add(seed: SeedModule, entry: Entry) -> None:
    old = seed.entries.get(entry.name)
    if old is None or (old.params is None and entry.params is not None):
        seed.entries[entry.name] = entry


def _parse_directives(text: str, seed: SeedModule) -> None:
    marks = list(_DIRECTIVE.finditer(text))
    owner: str | None = None
    for mark, nxt in zip(marks, [*marks[1:], None]):
        directive, body = mark.group(1), text[mark.end(): nxt.start() if nxt else len(text)]
        if directive == "autoapisummary":
            prefix = seed.module + "."
            for token in body.split():
                if not token.startswith(prefix):
                    break
                if _public(token[len(prefix):]):
                    seed.summary.setdefault(token[len(prefix):], None)
            continue
        kind, parsed = directive[3:], _signature(body)
        if kind == "module" or parsed is None:
            continue
        name, params, rest, truncated = parsed
        if kind in ("class", "function", "data"):
            owner = name if kind == "class" else None
        if kind in ("method", "attribute", "property") and owner is None:
            kind = "function" if kind == "method" else "data"
        flags = frozenset(f for f in _FLAGS if re.match(rf"\s*(:\w+:\s*)*:{f}:", rest)) | truncated
        value = re.search(r":value:\s*(.*)", rest.split("\n", 1)[0])
        full = f"{owner}.{name}" if kind in ("method", "attribute", "property") else name
        if _public(name) and (owner is None or _public(owner)):
            _add(seed, Entry(full, kind, params, value.group(1).strip().translate(_QUOTES) if value else None,
                             flags, rest.strip(), _examples(rest)))


def _parse_rendered(text: str, seed: SeedModule) -> None:
    line_re = re.compile(rf"^\s*(?:[-*\u2022]\s+)?(?:(class|exception|data|function|method|attribute)\s+)?"
                         rf"{re.escape(seed.module)}\.(?P<path>[A-Za-z_][\w.]*)(?P<rest>.*)$")
    lines = text.splitlines()
    hits = [(i, m) for i, m in ((i, line_re.match(line)) for i, line in enumerate(lines)) if m]
    for line in lines[: hits[0][0] if hits else 0]:  # the summary table above the entries
        call = _CALL.match(line.strip())
        if call and call.group(1).lower() not in _HEADINGS and _public(call.group(1)) \
                and call.group(1) != seed.module.rpartition(".")[2]:  # not the page title
            listed = None if call.group(2) is None else tuple(
                p for p in re.split(r"[\s,\[\]]+", call.group(2)) if p and p != "...")
            seed.summary.setdefault(call.group(1), listed)
    for (i, m), nxt in zip(hits, [*hits[1:], (len(lines), None)]):
        path, rest = m.group("path"), m.group("rest")
        j = i
        while rest.lstrip().startswith("(") and _closing(rest, rest.index("(")) is None and j + 1 < nxt[0]:
            j += 1  # a signature wrapped over several lines
            rest += " " + lines[j].strip()
        doc = "\n".join(lines[j + 1: nxt[0]])
        owner, _, name = path.rpartition(".")
        _, params, after, flags = _signature(name + rest) or (name, None, "", frozenset())
        kind = m.group(1) or ("function" if params is not None else "data")
        if owner:
            kind = {"function": "method", "data": "attribute"}.get(kind, kind)
        value = None
        if params is None:
            assign = re.match(r"\s*(?::[^=]*)?=\s*(.+?)#?$", after)
            first = next((ln.strip() for ln in doc.splitlines() if ln.strip()), "")
            value = assign.group(1) if assign else (first if _is_literal(first.translate(_QUOTES)) else None)
        if _public(name) and all(_public(p) for p in owner.split(".") if p):
            _add(seed, Entry(path, kind, params, value.translate(_QUOTES) if value else None, flags,
                             doc.strip(), _examples(doc)))


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def parse_seed(text: str, module: str) -> SeedModule:
    """Every public function, class, method, data and attribute the document ``text`` lists for ``module``."""
    seed = SeedModule(module)
    _parse_directives(text, seed)
    _parse_rendered(text, seed)
    return seed


def load_seed(path: str | Path) -> SeedModule:
    """Parse one seed document; the module name is the file name without ``.txt``."""
    path = Path(path)
    return parse_seed(path.read_text(encoding="utf-8"), path.name.removesuffix(".txt"))


def find_seeds_dir() -> Path | None:
    """``$POPMESH_SEEDS_DIR`` when set, else ``../shared/seeds`` or ``shared/seeds`` by the repository."""
    repo = Path(__file__).resolve().parents[2]
    env = os.environ.get("POPMESH_SEEDS_DIR")
    for candidate in [Path(env)] if env else [repo.parent / "shared" / "seeds", repo / "shared" / "seeds"]:
        if candidate.is_dir() and any(candidate.glob("*.txt")):
            return candidate
    return None


def require_seed(module: str) -> SeedModule:
    """The parsed seed document for ``module``; skips the calling test when the documents are absent."""
    import pytest

    where = find_seeds_dir()
    if where is None or not (where / f"{module}.txt").is_file():
        pytest.skip(f"seed document {module}.txt not found: set POPMESH_SEEDS_DIR or check out ../shared/seeds")
    return load_seed(where / f"{module}.txt")


def load_seeds(directory: str | Path | None = None) -> dict[str, SeedModule]:
    """Every ``*.txt`` seed document in ``directory`` (default :func:`find_seeds_dir`), by module name."""
    where = Path(directory) if directory is not None else find_seeds_dir()
    if where is None:
        raise FileNotFoundError("no seed documents: set POPMESH_SEEDS_DIR or check out ../shared/seeds")
    return {seed.module: seed for seed in map(load_seed, sorted(where.glob("*.txt")))}


# ---------------------------------------------------------------------------------------- checking

_MISSING = object()
_BINOPS = {ast.Pow: pow, ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
           ast.Sub: lambda a, b: a - b, ast.Div: lambda a, b: a / b}


def _evaluate(node: ast.AST) -> Any:
    """Value of a simple literal expression (constants, tuples, lists, arithmetic, unary minus)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_evaluate(e) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(ast.dump(node))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def default_matches(text: str, actual: Any, namespace: dict[str, Any] | None = None) -> bool:
    """Whether a facade default ``actual`` is the seed default written as ``text``.

    Literals compare by value and type (``2**18`` equals ``262144``, ``0`` is not ``False``); a name
    (``_attach_params_to_agent_state``, ``MPI.COMM_WORLD``) matches the object the facade module
    binds to that dotted name, or else an object whose ``__name__`` is the name's last part.
    """
    try:
        node = ast.parse(text.translate(_QUOTES), mode="eval").body
    except SyntaxError:
        return text == repr(actual)
    try:
        return _same(_evaluate(node), actual)
    except (ValueError, TypeError, ArithmeticError):
        pass
    if isinstance(node, (ast.Name, ast.Attribute)):
        parts, target = ast.unparse(node).split("."), namespace or {}
        resolved: Any = target.get(parts[0], _MISSING)
        for part in parts[1:]:
            resolved = getattr(resolved, part, _MISSING)
        if resolved is not _MISSING:
            return resolved is actual
        return getattr(actual, "__name__", None) == parts[-1]
    return False


def _show(p: Param | inspect.Parameter) -> str:
    if isinstance(p, Param):
        star = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind, "")
        return f"{star}{p.name}" + ("" if p.default is None else f"={p.default}")
    return str(p.replace(annotation=inspect.Parameter.empty))


def signature_mismatches(obj: Any, params: tuple[Param, ...], where: str,
                         namespace: dict[str, Any] | None = None, *, drop_first: bool = False,
                         newer: tuple[str, ...] = ()) -> list[str]:
    """Differences between ``obj``'s signature and the seed's ``params`` (names, order, kinds, defaults).

    ``newer``: parameters the original added after the seed document (each must have a default; it is
    left out of the comparison) or gave a default (a seed parameter without one may then have one)."""
    try:
        actual = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as e:
        return [f"{where}: no signature ({e})"]
    actual = actual[1:] if drop_first else actual
    seed_names = {p.name for p in params}
    added = [p for p in actual if p.name in newer and p.name not in seed_names]
    problems = [f"{where}: {p.name}, added after the seed, has no default" for p in added
                if p.default is inspect.Parameter.empty]
    actual = [p for p in actual if p not in added]
    seed_text = ", ".join(map(_show, params))
    facade_text = ", ".join(map(_show, actual))
    if [(p.name, p.kind) for p in params] != [(p.name, p.kind.name) for p in actual]:
        problems.append(f"{where}: parameters ({facade_text}), seed has ({seed_text})")
    for want, got in zip(params, actual):
        has_default = got.default is not inspect.Parameter.empty
        if want.default is None and has_default and got.name in newer:
            continue  # a default the original gave it after the seed
        if (want.default is None) == has_default or (
            has_default and want.default is not None and not default_matches(want.default, got.default, namespace)
        ):
            problems.append(f"{where}: {got.name} default {_show(got)!r}, seed has {_show(want)!r}")
    return problems


def _method_mismatches(cls: type, name: str, entry: Entry, namespace: dict[str, Any],
                       newer: tuple[str, ...] = ()) -> list[str]:
    where = f"{cls.__name__}.{name}"
    if entry.kind != "method":
        return []
    static = inspect.getattr_static(cls, name, None)
    if static is None:
        return [f"{where}: missing"]
    problems = []
    for flag, wrapper in (("staticmethod", staticmethod), ("classmethod", classmethod)):
        if (flag in entry.flags) != isinstance(static, wrapper):
            problems.append(f"{where}: seed {'says' if flag in entry.flags else 'does not say'} {flag}")
    if "abstractmethod" in entry.flags and not getattr(static, "__isabstractmethod__", False):
        problems.append(f"{where}: seed says abstractmethod")
    if entry.params is not None:
        bound = not isinstance(static, (staticmethod, classmethod))
        problems += signature_mismatches(getattr(cls, name), entry.params, where, namespace, drop_first=bound,
                                         newer=newer)
    return problems


def facade_mismatches(facade: ModuleType, seed: SeedModule) -> list[str]:
    """Everything in which ``facade`` differs from the seed document (an empty list: it matches).

    Checks ``__all__`` against the public names, that every name exists, the signature of every
    function, class constructor and method (``self``/``cls`` excluded), method flags, and data
    values given as literals. Instance attributes are left to :func:`attribute_mismatches`.

    A facade of an original that grew since its seed document declares what it added in ``__newer__``:
    ``{name: (parameter, ...)}``, where a name absent from the seed is a public name added (it must be
    exported), and the parameters of a seed function, class (its constructor) or ``Class.method`` are
    ones added with a default or given a default (see :func:`signature_mismatches`). Anything else
    must match exactly.
    """
    namespace = vars(facade)
    exported = list(getattr(facade, "__all__", []))
    newer: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in getattr(facade, "__newer__", {}).items()}
    added = {name for name in newer if "." not in name and name not in seed.public_names()}
    problems = [f"__newer__: {name} is not exported" for name in sorted(added - set(exported))]
    if len(set(exported)) != len(exported) or set(exported) - added != seed.public_names():
        problems.append(f"__all__: extra {sorted(set(exported) - seed.public_names() - added)}, "
                        f"missing {sorted(seed.public_names() - set(exported))}, {len(exported)} entries")
    for name, entry in sorted(seed.top().items()):
        if name not in namespace:
            problems.append(f"{name}: missing")
            continue
        obj = namespace[name]
        if entry.kind in ("function", "class") and not callable(obj):
            problems.append(f"{name}: not callable")
        elif entry.kind == "class" and not isinstance(obj, type):
            problems.append(f"{name}: not a class")
        elif entry.params is not None:
            problems += signature_mismatches(obj, entry.params, name, namespace, newer=newer.get(name, ()))
        if (entry.kind == "data" and entry.value is not None and _is_literal(entry.value)
                and not _same(ast.literal_eval(entry.value), obj)):
                problems.append(f"{name}: value {obj!r}, seed has {entry.value}")
        if entry.kind == "class" and isinstance(obj, type):
            for member, m in sorted(seed.members(name).items()):
                problems += _method_mismatches(obj, member, m, namespace, newer.get(f"{name}.{member}", ()))
    return problems


def attribute_mismatches(instance: Any, seed: SeedModule, cls: str) -> list[str]:
    """Public attributes the seed lists for class ``cls`` that ``instance`` lacks."""
    return [f"{cls}.{name}: missing" for name, entry in sorted(seed.members(cls).items())
            if entry.kind in ("attribute", "property") and not hasattr(instance, name)]
