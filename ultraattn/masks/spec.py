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

The defaults reproduce UltraAttn's experiment patterns (SC'25 block tables): strided block=S/16,
stride=4, band=2; global_local num_global=window=S/16; star block=S/4; streaming
sink=block=S/8, window=2; sliding_window window=S/8 causal; document 4 equal documents;
prefix_lm prefix=S/4 (fractions of S rounded down, at least 1 token).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ultraattn.masks import factories as F
from ultraattn.masks.factories import MaskKind, MaskMod
from ultraattn.masks.registry import MASKS, ParamKind

__all__ = ["MASK_NAMES", "MaskKind", "parse_mask_spec", "describe_masks"]

#: every registered mask's name (``masks/registry.py``), in registration order
MASK_NAMES: tuple[str, ...] = tuple(kind.value for kind in MaskKind)

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
    if name not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASK_NAMES)}, got {name!r}")
    entry = MASKS[name]
    params = {p.name: p for p in entry.params}
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
                case ParamKind.TOKENS:
                    kwargs[key] = _parse_tokens(key, text, seq_len)
                case ParamKind.COUNT:
                    kwargs[key] = _parse_count(key, text)
                case ParamKind.BOOL:
                    kwargs[key] = _parse_bool(key, text)
                case ParamKind.LENGTHS:
                    kwargs[key] = [_parse_tokens(key, t, seq_len) for t in text.split("+")]
                case _:
                    raise AssertionError(p.kind)
        elif p.default is not None:
            kwargs[key] = p.default(seq_len)
    if entry.resolve is not None:
        kwargs = entry.resolve(kwargs, seq_len, given)
    try:
        return entry.factory(**kwargs)
    except (TypeError, ValueError) as e:  # name the spec the bad value came from
        raise ValueError(f"invalid mask spec {spec!r}: {e}") from e


def describe_masks() -> str:
    """Help text: every mask name with its parameters and defaults (S = sequence length)."""
    lines = ["Masks (--mask NAME[:PARAM=VALUE,...]); S = sequence length:"]
    for name in MASK_NAMES:
        params = MASKS[name].params
        desc = ", ".join(f"{p.name}={p.doc}" for p in params) if params else "no parameters"
        lines.append(f"  {name:<15} {desc}")
    lines += [
        "Token values: 4096, 64k (=65536), 1m (=1048576) or a fraction of S in (0, 1), e.g. 0.25.",
        "Booleans: true/false. document lengths: 1000+3000+2000 (tokens past their sum attend nothing).",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- python -m ultraattn.masks.spec
def _ascii(mask_mod: MaskMod, q_len: int, kv_len: int, b: int = 0) -> str:
    q_Q1 = torch.arange(q_len)[:, None]
    kv_1K = torch.arange(kv_len)[None, :]
    dense = mask_mod(torch.tensor(b), torch.tensor(0), q_Q1, kv_1K).expand(q_len, kv_len)
    return "\n".join("".join("#" if v else "." for v in row.tolist()) for row in dense)


def main() -> None:
    """Print every registered mask at a small size (32 tokens; '#' attends, '.' masked): a few at hand-picked
    sizes, the rest at their spec defaults."""
    s = 32
    masks = [
        F.generate_full(),
        F.generate_causal(),
        F.generate_sliding_window(window=s // 8),
        F.generate_sliding_window(window=s // 8, causal=False),
        F.generate_strided(block=s // 16),
        F.generate_global_local(num_global=s // 16, window=s // 16),
        F.generate_star(block=s // 4),
        F.generate_streaming(sink=s // 8, window=2, block=s // 8),
        F.generate_document([5, 12, 9], causal=True),
        F.generate_prefix_lm(prefix=s // 4),
    ]
    shown = {m.__name__.partition("(")[0] for m in masks}
    masks += [parse_mask_spec(name, s) for name in MASKS if name not in shown]  # every other registered mask
    for m in masks:
        total = int(m.count_pairs(0, s, 0, s))
        print(f"{m.__name__}: {total}/{s * s} pairs ({total / (s * s):.1%})")
        print(_ascii(m, s, s))
        print()


if __name__ == "__main__":
    main()
