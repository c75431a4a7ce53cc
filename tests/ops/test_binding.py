"""The dispatch binder equals ``inspect``'s binding (defaults applied, signature order), and a
call that does not fit raises ``inspect``'s own ``TypeError``."""

from __future__ import annotations

import inspect

import pytest

from drifttool.ops.binding import Binder


def plain(x, w, b=None, *, text_len=None, scale=1.0):
    return x


def required_kw(q, k, *, key_mask):
    return q


def var_args(x, *rest, **kw):
    return x


def pos_only(x, /, y=2):
    return x


CALLS = [
    (plain, (1, 2), {}),
    (plain, (1, 2, 3), {}),
    (plain, (1,), {"w": 2}),
    (plain, (), {"w": 2, "x": 1, "scale": 3.0}),
    (plain, (1, 2), {"text_len": 5}),
    (plain, (1, 2, 3), {"scale": 0.5, "text_len": 0}),
    (required_kw, (1, 2), {"key_mask": None}),
    (var_args, (1, 2, 3), {"a": 4}),
    (pos_only, (1,), {}),
    (pos_only, (1, 5), {}),
]

BAD = [
    (plain, (1, 2, 3, 4), {}),            # too many positional
    (plain, (1,), {}),                     # w missing
    (plain, (1, 2), {"x": 1}),             # x twice
    (plain, (1, 2), {"nope": 1}),          # unknown keyword
    (required_kw, (1, 2), {}),             # keyword-only missing
    (required_kw, (1, 2, 3), {}),          # keyword-only given positionally
    (pos_only, (), {"x": 1}),              # positional-only given by keyword
]


def _inspect(fn, args, kwargs):
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@pytest.mark.parametrize("fn,args,kwargs", CALLS)
def test_binds_as_inspect_does(fn, args, kwargs):
    got = Binder(inspect.signature(fn)).bind(args, kwargs)
    want = _inspect(fn, args, kwargs)
    assert list(got.items()) == list(want.items())


@pytest.mark.parametrize("fn,args,kwargs", BAD)
def test_misfit_raises_inspects_error(fn, args, kwargs):
    with pytest.raises(TypeError) as want:
        _inspect(fn, args, kwargs)
    with pytest.raises(TypeError) as got:
        Binder(inspect.signature(fn)).bind(args, kwargs)
    assert str(got.value) == str(want.value)


def test_every_registered_implementation_binds_its_model_call_as_inspect_does():
    """The real signatures: each implementation's parameters bound from its own defaults and
    placeholder values, positionally and by keyword."""
    from drifttool.ops.registry import _IMPLS

    seen = 0
    for impls in _IMPLS.values():
        for impl in impls:
            sig = impl.signature or inspect.signature(impl.fn)
            req = [p for p in sig.parameters.values() if p.default is inspect.Parameter.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
            args = tuple(object() for _ in req)
            kw = {p.name: object() for p in sig.parameters.values()
                  if p.kind is p.KEYWORD_ONLY and p.default is inspect.Parameter.empty}
            assert list(impl.binder.bind(args, kw).items()) == list(_inspect(impl.fn, args, kw).items())
            seen += 1
    assert seen > 40
