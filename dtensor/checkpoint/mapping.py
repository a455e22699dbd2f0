"""Which checkpoint tensor fills which leaf of a tree, and how: names <-> paths, with transforms.

A :class:`Mapping` is an ordered list of rules, first match wins (as a
:class:`~dtensor.LayoutMap`). A rule pairs a checkpoint-name template with a
tree-path template and the transforms between them::

    ("model.layers.{i}.self_attn.q_proj.weight", "blocks/{i}/attn/query",
     transpose(), split_dim(1, (heads, -1)))

``{name}`` matches one path component (``[^/]+``), ``{name:REGEX}`` matches
``REGEX``; other characters are literal. Rules are looked up by the tree's
paths, so each works both ways (loading and saving). A placeholder of the
checkpoint template that the tree path lacks is *stacked*: one leaf holds all
the tensors it numbers, along a new leading dimension (a scanned model's
``[layers, ...]`` weights, a mixture's ``[experts, ...]``); its values are
``0 .. n-1`` unless the rule's ``stack={"kv": ("k", "v")}`` lists them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as AbcMapping
from typing import Any

from dtensor.checkpoint.transforms import AsType, Transform

__all__ = ["Mapping", "Rule", "Source", "as_mapping"]

_FIELD = re.compile(r"\{(\w+)(?::((?:[^{}]|\{[^{}]*\})+))?\}")


def _parse(template: str, default: str) -> tuple[re.Pattern[str], list[str], dict[str, str]]:
    """A template's regex, placeholder names (in order) and their own regexes."""
    parts, names, regexes, at = [], [], {}, 0
    for m in _FIELD.finditer(template):
        parts.append(re.escape(template[at : m.start()]))
        name, regex = m.group(1), m.group(2) or default
        if name in regexes:
            parts.append(f"(?P={name})")
        else:
            parts.append(f"(?P<{name}>{regex})")
            names.append(name)
            regexes[name] = regex
        at = m.end()
    parts.append(re.escape(template[at:]))
    return re.compile("".join(parts)), names, regexes


def _fill(template: str, values: AbcMapping[str, Any]) -> str:
    return _FIELD.sub(lambda m: str(values[m.group(1)]), template)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one leaf comes from: its checkpoint names (several when stacked: ``names`` in
    row-major order over the stacked ``counts``), the transforms, the cast."""

    path: str
    names: tuple[str, ...]
    stacked: tuple[int, ...]
    transforms: tuple[Transform, ...]
    cast: AsType | None
    rule: str

    def describe(self) -> str:
        steps = ", ".join(repr(t) for t in self.transforms if not isinstance(t, AsType))
        return steps or "no transform"


class Rule:
    """``checkpoint`` template <-> ``target`` template with ``transforms`` (see the module doc).

    ``save=False`` leaves the rule out of saves (e.g. an untied head read from the
    embedding). ``stack`` gives the values of stacked placeholders that are not ``0..n-1``.
    """

    def __init__(
        self,
        checkpoint: str,
        target: str,
        *transforms: Transform,
        stack: AbcMapping[str, Sequence[Any]] | None = None,
        save: bool = True,
    ) -> None:
        self.checkpoint, self.target = checkpoint, target
        self.transforms = tuple(transforms)
        for t in self.transforms:
            if not isinstance(t, Transform):
                raise TypeError(
                    f"mapping rule {checkpoint!r} -> {target!r}: {t!r} is not a transform; use "
                    "dtensor.checkpoint.transpose/split_dim/merge_dims/permute/rope_permute/astype."
                )
        self.save = save
        self.target_re, target_names, _ = _parse(target, "[^/]+")
        self.checkpoint_re, ckpt_names, self.regexes = _parse(checkpoint, "[^.]+")
        missing = [n for n in target_names if n not in ckpt_names]
        if missing:
            raise ValueError(
                f"mapping rule {checkpoint!r} -> {target!r}: the path's placeholder(s) {missing} "
                "are not in the checkpoint name; every path placeholder must appear in both."
            )
        self.stacked = [n for n in ckpt_names if n not in target_names]
        self.stack_values = {k: tuple(v) for k, v in (stack or {}).items()}

    def __repr__(self) -> str:
        return (
            f"Rule({self.checkpoint!r}, {self.target!r}, {', '.join(map(repr, self.transforms))})"
        )


def _rule(item: Any, key: str | None = None) -> Rule:
    if isinstance(item, Rule):
        return item
    if key is not None:  # a dict entry: checkpoint -> target or (target, *transforms)
        target, *transforms = (item,) if isinstance(item, str) else tuple(item)
        return Rule(key, target, *transforms)
    return Rule(*item)


class Mapping:
    """Checkpoint names <-> tree paths, with per-tensor transforms; first matching rule wins.

    Args:
        rules: a dict ``{checkpoint_template: target_template}`` (a value may be a tuple
            ``(target_template, *transforms)``), or a sequence of :class:`Rule` s or
            ``(checkpoint_template, target_template, *transforms)`` tuples.
        ignore: regexes of checkpoint names to leave out when loading (``fullmatch``), e.g.
            ``r"lm_head\\.weight"`` for a model that ties its head to the embedding.
        default: map the paths no rule matches by name, ``a/b/0`` <-> ``a.b.0`` (default
            ``False``: such a path is an error).

    Examples:
        >>> from dtensor.checkpoint import Mapping, transpose
        >>> m = Mapping({"model.layers.{i}.mlp.up_proj.weight": ("blocks/{i}/up", transpose())})
        >>> m.source("blocks/3/up").names, m.checkpoint_names("blocks/3/up", (2,))
        (('model.layers.3.mlp.up_proj.weight',), ['model.layers.3.mlp.up_proj.weight'])
    """

    def __init__(
        self,
        rules: AbcMapping[str, Any] | Iterable[Any] = (),
        *,
        ignore: Sequence[str] = (),
        default: bool = False,
    ) -> None:
        if isinstance(rules, AbcMapping):
            self.rules = [_rule(v, k) for k, v in rules.items()]
        else:
            self.rules = [_rule(r) for r in rules]
        self.ignore = [re.compile(p) for p in ignore]
        self.default = default

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules, ignore={[p.pattern for p in self.ignore]})"

    def ignored(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is left out of loads."""
        return any(p.fullmatch(name) for p in self.ignore)

    def _matches(self, path: str, *, saving: bool) -> list[tuple[Rule, dict[str, str]]]:
        found = []
        for rule in self.rules:
            if saving and not rule.save:
                continue
            m = rule.target_re.fullmatch(path)
            if m:
                found.append((rule, m.groupdict()))
        return found

    def source(
        self,
        path: str,
        available: Iterable[str] = (),
        *,
        saving: bool = False,
        counts: Sequence[int] | None = None,
    ) -> Source | None:
        """Where the leaf at ``path`` comes from (``None``: no rule). Stacked placeholders take
        their values from ``counts`` (the leaf's leading dimensions) or, when loading, from
        the names in ``available`` (the checkpoint's). When loading, the first matching rule
        whose tensors the checkpoint holds wins (a later rule is a fallback: an untied head
        read from a tied checkpoint's embedding); none: the first, so its names are reported."""
        found = self._matches(path, saving=saving)
        if not found:
            if not self.default:
                return None
            return Source(path, (path.replace("/", "."),), (), (), None, "by name")
        sources = [self._source(path, r, v, available, counts) for r, v in found]
        if not saving and len(sources) > 1:
            have = set(available)
            for src in sources:
                if src.names and all(n in have for n in src.names):
                    return src
        return sources[0]

    def _source(
        self,
        path: str,
        rule: Rule,
        values: dict[str, str],
        available: Iterable[str],
        counts: Sequence[int] | None,
    ) -> Source:
        grids: list[tuple[str, ...]] = []
        for i, name in enumerate(rule.stacked):
            if name in rule.stack_values:
                grids.append(tuple(str(v) for v in rule.stack_values[name]))
            elif counts is not None:
                grids.append(tuple(str(v) for v in range(counts[i])))
            else:
                grids.append(_present(rule, name, values, available))
        names = [dict(values)]
        for name, grid in zip(rule.stacked, grids, strict=True):
            names = [{**n, name: v} for n in names for v in grid]
        casts = [t for t in rule.transforms if isinstance(t, AsType)]
        return Source(
            path=path,
            names=tuple(_fill(rule.checkpoint, n) for n in names),
            stacked=tuple(len(g) for g in grids),
            transforms=tuple(t for t in rule.transforms if not isinstance(t, AsType)),
            cast=casts[-1] if casts else None,
            rule=f"{rule.checkpoint!r} -> {rule.target!r}",
        )

    def checkpoint_names(self, path: str, shape: Sequence[int]) -> list[str]:
        """The checkpoint names a save writes for the leaf at ``path`` of shape ``shape``."""
        src = self.source(path, saving=True, counts=tuple(shape))
        return [] if src is None else list(src.names)


def _present(rule: Rule, name: str, values: dict[str, str], available: Iterable[str]) -> tuple:
    """The values of a stacked placeholder that the checkpoint's names hold (ints in order)."""
    found = set()
    for n in available:
        m = rule.checkpoint_re.fullmatch(n)
        if m and all(m.group(k) == v for k, v in values.items()):
            found.add(m.group(name))
    if all(v.isdigit() for v in found):
        return tuple(str(v) for v in sorted(int(v) for v in found))
    return tuple(sorted(found))


def as_mapping(mapping: Any) -> Mapping:
    """``mapping`` as a :class:`Mapping`: ``None`` maps every path by name (``a/b`` <-> ``a.b``)."""
    if mapping is None:
        return Mapping(default=True)
    if isinstance(mapping, Mapping):
        return mapping
    if isinstance(mapping, AbcMapping | list | tuple):
        return Mapping(mapping)
    raise TypeError(
        f"mapping={mapping!r} is not a mapping: pass a dict of checkpoint name -> tree path "
        "templates, a list of rules, a dtensor.checkpoint.Mapping, or None (names as paths)."
    )
