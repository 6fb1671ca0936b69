"""Mask specs for the command line: ``name[:param=value,...]`` -> mask_mod.

Examples (S = seq_len)::

    strided                                   block=S/16, stride=4, band=2 (UltraAttn's pattern)
    strided:stride=4,band=2
    sliding_window:window=4096,causal=false
    document:lengths=1000+3000+2000,causal=true
    document:docs=8                           8 equal documents
    prefix_lm:prefix=0.25                     a quarter of the sequence
    global_local:num_global=64k,window=64k

Token-valued parameters accept an int (``4096``), a ``k``/``m`` suffix (``64k`` = 65536,
``1m`` = 1048576, binary multiples as sequence lengths are) or a fraction in (0, 1) of S
(rounded down). Count-valued parameters (``stride``, ``band``, streaming ``window``, ``docs``)
take plain ints; booleans take ``true``/``false``.

The defaults reproduce UltraAttn's experiment patterns (REFERENCES.md): strided block=S/16,
stride=4, band=2; global_local num_global=window=S/16; star block=S/4; streaming
sink=block=S/8, window=2; sliding_window window=S/8 causal; document 4 equal documents;
prefix_lm prefix=S/4 (fractions of S rounded down, at least 1 token).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ultraattn.masks import factories as F

__all__ = ["MASK_NAMES", "parse_mask_spec", "describe_masks"]

MASK_NAMES: tuple[str, ...] = (
    "full",
    "causal",
    "sliding_window",
    "strided",
    "global_local",
    "star",
    "streaming",
    "document",
    "prefix_lm",
)

ParamKind = Literal["tokens", "count", "bool", "lengths"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Param:
    name: str
    """Parameter name as written in the spec (and passed to the factory)."""
    kind: ParamKind
    """How its value is parsed: tokens (int, k/m suffix, fraction of S), count, bool or lengths."""
    default: Callable[[int], object] | None
    """Default as a function of seq_len; None: no default (optional or exclusive parameter)."""
    doc: str
    """Default shown in the help text."""


def _frac(div: int) -> Callable[[int], int]:
    return lambda s: max(1, s // div)


_PARAMS: dict[str, tuple[_Param, ...]] = {
    "full": (),
    "causal": (),
    "sliding_window": (
        _Param(name="window", kind="tokens", default=_frac(8), doc="S/8"),
        _Param(name="causal", kind="bool", default=lambda s: True, doc="true"),
    ),
    "strided": (
        _Param(name="block", kind="tokens", default=_frac(16), doc="S/16"),
        _Param(name="stride", kind="count", default=lambda s: 4, doc="4"),
        _Param(name="band", kind="count", default=lambda s: 2, doc="2"),
        _Param(name="causal", kind="bool", default=lambda s: False, doc="false"),
    ),
    "global_local": (
        _Param(name="num_global", kind="tokens", default=_frac(16), doc="S/16"),
        _Param(name="window", kind="tokens", default=_frac(16), doc="S/16"),
    ),
    "star": (_Param(name="block", kind="tokens", default=_frac(4), doc="S/4"),),
    "streaming": (
        _Param(name="sink", kind="tokens", default=_frac(8), doc="S/8"),
        _Param(name="window", kind="count", default=lambda s: 2, doc="2 (blocks)"),
        _Param(name="block", kind="tokens", default=_frac(8), doc="S/8"),
    ),
    "document": (
        _Param(name="lengths", kind="lengths", default=None, doc="a+b+... tokens (exclusive with docs)"),
        _Param(name="docs", kind="count", default=None, doc="4 equal documents"),
        _Param(name="causal", kind="bool", default=lambda s: True, doc="true"),
    ),
    "prefix_lm": (_Param(name="prefix", kind="tokens", default=_frac(4), doc="S/4"),),
}

_SUFFIX = {"k": 1024, "m": 1024 * 1024}
_INT_RE = re.compile(r"^(\d+)([kKmM]?)$")
_FRAC_RE = re.compile(r"^(0?\.\d+)$")


def _parse_tokens(name: str, text: str, seq_len: int) -> int:
    t = text.strip()
    if m := _INT_RE.match(t):
        return int(m.group(1)) * _SUFFIX.get(m.group(2).lower(), 1)
    if _FRAC_RE.match(t) and 0.0 < float(t) < 1.0:
        tokens = int(float(t) * seq_len)
        if tokens <= 0:
            raise ValueError(f"`{name}` must be at least one token, got {text!r} (= {tokens} of seq_len={seq_len})")
        return tokens
    raise ValueError(
        f"`{name}` must be a token count (e.g. 4096, 64k, 1m) or a fraction of seq_len in (0, 1), got {text!r}"
    )


def _parse_count(name: str, text: str) -> int:
    t = text.strip()
    if not t.isdigit():
        raise ValueError(f"`{name}` must be a non-negative integer, got {text!r}")
    return int(t)


def _parse_bool(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes"):
        return True
    if t in ("false", "0", "no"):
        return False
    raise ValueError(f"`{name}` must be true or false, got {text!r}")


def _equal_lengths(docs: int, seq_len: int) -> list[int]:
    if not 1 <= docs <= seq_len:
        raise ValueError(f"`docs` must lie in [1, seq_len={seq_len}], got {docs}")
    base, extra = divmod(seq_len, docs)
    return [base + (1 if i < extra else 0) for i in range(docs)]


def parse_mask_spec(spec: str, seq_len: int) -> Callable:
    """Build a factory mask_mod from a spec ``name[:param=value,...]`` for ``seq_len`` tokens.

    Args:
        spec: e.g. ``"strided"``, ``"sliding_window:window=4096,causal=false"``,
            ``"document:lengths=1000+3000+2000"``, ``"document:docs=8"``, ``"prefix_lm:prefix=0.25"``.
        seq_len: sequence length S that defaults and fractions refer to.

    Returns:
        The mask_mod (with its exact counter ``count_pairs``).

    Raises:
        TypeError: ``spec`` not a str or ``seq_len`` not an int.
        ValueError: unknown mask name, unknown or repeated parameter, malformed or invalid value.
    """
    if not isinstance(spec, str):
        raise TypeError(f"`spec` must be a str like 'strided:stride=4', got {type(spec).__name__}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"`seq_len` must be an int, got {seq_len!r}")
    if seq_len <= 0:
        raise ValueError(f"`seq_len` must be positive, got {seq_len}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in _PARAMS:
        raise ValueError(f"mask must be one of {', '.join(MASK_NAMES)}, got {name!r}")
    params = {p.name: p for p in _PARAMS[name]}
    valid = ", ".join(params) if params else "none"
    given: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise ValueError(f"mask parameters must be written key=value, got {item!r} in {spec!r}")
        if key not in params:
            raise ValueError(f"mask {name!r} has no parameter {key!r}; valid parameters: {valid}")
        if key in given:
            raise ValueError(f"parameter {key!r} of mask {name!r} is given twice in {spec!r}")
        given[key] = value
    kwargs: dict[str, object] = {}
    for key, p in params.items():
        if key in given:
            text = given[key]
            match p.kind:
                case "tokens":
                    kwargs[key] = _parse_tokens(key, text, seq_len)
                case "count":
                    kwargs[key] = _parse_count(key, text)
                case "bool":
                    kwargs[key] = _parse_bool(key, text)
                case "lengths":
                    kwargs[key] = [_parse_tokens(key, t, seq_len) for t in text.split("+")]
                case _:
                    raise AssertionError(p.kind)
        elif p.default is not None:
            kwargs[key] = p.default(seq_len)
    if name == "document":
        if "lengths" in kwargs and "docs" in kwargs:
            raise ValueError("mask 'document' takes `lengths` or `docs`, not both")
        if "lengths" not in kwargs:
            kwargs["lengths"] = _equal_lengths(kwargs.pop("docs", 4), seq_len)
        if sum(kwargs["lengths"]) > seq_len:
            raise ValueError(
                f"`lengths` must sum to at most seq_len={seq_len}, got {given.get('lengths')!r} "
                f"(= {sum(kwargs['lengths'])} tokens)"
            )
    factory = getattr(F, f"generate_{name}")
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as e:  # name the spec the bad value came from
        raise ValueError(f"invalid mask spec {spec!r}: {e}") from e


def describe_masks() -> str:
    """Help text: every mask name with its parameters and defaults (S = sequence length)."""
    lines = ["Masks (--mask NAME[:PARAM=VALUE,...]); S = sequence length:"]
    for name in MASK_NAMES:
        params = _PARAMS[name]
        desc = ", ".join(f"{p.name}={p.doc}" for p in params) if params else "no parameters"
        lines.append(f"  {name:<15} {desc}")
    lines += [
        "Token values: 4096, 64k (=65536), 1m (=1048576) or a fraction of S in (0, 1), e.g. 0.25.",
        "Booleans: true/false. document lengths: 1000+3000+2000 (tokens past their sum attend nothing).",
    ]
    return "\n".join(lines)
