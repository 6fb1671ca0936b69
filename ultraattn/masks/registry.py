"""The mask registry: every factory mask, its CLI parameters and defaults, in one entry.

A new mask is one ``generate_<name>`` factory in ``masks/factories.py`` (with its exact pair counter,
``count_pairs``, attached by ``_attach``), decorated with ``@register_mask(Param(...), ...)``. The spec
parser (``masks/spec.py``: ``parse_mask_spec``, ``describe_masks``, ``MASK_NAMES``), the CLI (``--mask``,
``ultraattn masks``), ``MaskKind`` and the tests read this registry; nothing else lists mask names.

    @register_mask(Param(name="window", kind=ParamKind.TOKENS, default=frac(8), doc="S/8"))
    def generate_sliding_window(window: int, causal: bool = True) -> MaskMod: ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = ["MASKS", "MaskEntry", "Param", "ParamKind", "StrKind", "frac", "mask_kinds", "register_mask"]


class StrKind(str, Enum):
    """A kind named by a string: members equal, hash, print, format and JSON-encode as their value (what
    ``enum.StrEnum`` does from Python 3.11), so code and files that used the bare strings see no change."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class ParamKind(StrKind):
    """How a spec parameter's value is written (``masks/spec.py`` parses each)."""

    TOKENS = "tokens"
    """an int, a k/m suffix (64k = 65536) or a fraction of S in (0, 1)"""
    COUNT = "count"
    """a plain non-negative int"""
    BOOL = "bool"
    """true/false"""
    LENGTHS = "lengths"
    """token values joined by '+'"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """One parameter of a mask spec ``name:param=value``."""

    name: str
    """Parameter name as written in the spec (and passed to the factory)."""
    kind: ParamKind
    """How its value is parsed."""
    default: Callable[[int], object] | None
    """Default as a function of seq_len; None: no default (optional or exclusive parameter)."""
    doc: str
    """Default shown in the help text."""


def frac(div: int) -> Callable[[int], int]:
    """A token default of S/div, rounded down, at least one token."""
    return lambda s: max(1, s // div)


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskEntry:
    """A registered mask: its factory and what the spec parser needs to call it."""

    name: str
    """The spec name (``generate_<name>``'s suffix)."""
    factory: Callable
    """``generate_<name>``: returns a mask_mod carrying ``count_pairs`` and ``num_batch``."""
    params: tuple[Param, ...]
    """Spec parameters, in the order the help text lists them."""
    resolve: Callable[[dict, int, dict], dict] | None = None
    """``resolve(kwargs, seq_len, given)``: the factory's keyword arguments from the parsed ones (defaults filled,
    ``given``: the raw text of each parameter written); for parameters that stand for others (``docs`` for
    ``lengths``). Raises ValueError for a bad combination."""


#: every mask by spec name, in registration order (the order help texts and error messages list them)
MASKS: dict[str, MaskEntry] = {}


def register_mask(*params: Param, name: str | None = None,
                  resolve: Callable[[dict, int, dict], dict] | None = None) -> Callable[[Callable], Callable]:
    """Decorator for a factory ``generate_<name>``: registers it under ``name`` (default: the suffix) with its spec
    ``params`` and optional ``resolve`` hook (``MaskEntry``); returns the factory unchanged."""

    def deco(factory: Callable) -> Callable:
        nm = name or factory.__name__.removeprefix("generate_")
        old = MASKS.get(nm)
        if old is not None and old.factory.__qualname__ != factory.__qualname__:  # (the same one re-run: replaced)
            raise ValueError(f"mask {nm!r} is registered twice: {old.factory.__qualname__}, {factory.__qualname__}")
        MASKS[nm] = MaskEntry(name=nm, factory=factory, params=tuple(params), resolve=resolve)
        return factory

    return deco


def mask_kinds() -> type[StrKind]:
    """``MaskKind``: one member per registered mask (``MaskKind.SLIDING_WINDOW == "sliding_window"``), made once
    every factory is registered (at the end of ``masks/factories.py``)."""
    return StrKind("MaskKind", [(nm.upper(), nm) for nm in MASKS], module="ultraattn.masks.factories",
                   qualname="MaskKind")
