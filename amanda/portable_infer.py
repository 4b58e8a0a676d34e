"""Recognising portable routines that carry no ``@portable.routine`` mark.

A routine whose body is tensor arithmetic over its arguments and captured
constants (``lambda y: y * 2``, ``def f(w): return w * mask``) means the same
thing natively as hosted, so the graph backends may lower it as if it were
marked. A wrong verdict is the worst failure there is: a counter judged
portable would run once while the graph is built and never again. So the
verdict is conservative and has three stages, each of which can refuse:

1. **the code**: the routine's bytecode (and that of the plain functions it
   calls, recursively) is read instruction by instruction, keeping track of
   what each stack slot holds. It may load its arguments, constants, closure
   cells holding NumPy arrays, NumPy scalars, Python numbers or strings, and
   the ``amanda.portable`` module, its vocabulary functions and ``abs``; apply
   ``+ - * / ** & | ~ -x`` and comparisons; call vocabulary functions; store
   into locals; return. Anything else refuses: attribute stores, other
   attribute reads (``self.count``, ``x.numpy()``), other calls (``print``,
   ``list.append``), jumps (``if``, ``and``, loops), globals other than those
   named (they can be rebound), in-place operators, inner functions,
   generators, ``**kwargs``.
2. **a trial trace** with :func:`amanda.portable.trace`, the arguments as
   traced float32 tensors (then int32, then bool) shaped like the captured
   arrays;
3. **a difference test**: the trace evaluated on random values must equal
   the routine called directly on the same NumPy values (which is safe: the
   code has no side effects, by stage 1).

Verdicts are cached per code object and captured values (by identity; an
array that dies drops its entry), and can be read with :func:`explain`.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import logging
import sys
import types
import weakref
from typing import NamedTuple

import numpy as np

log = logging.getLogger("amanda.portable")

_BINARY = {"+", "-", "*", "/", "**", "&", "|"}
_COMPARE = {"<", "<=", "==", "!=", ">", ">="}
_UNARY = {"UNARY_NEGATIVE", "UNARY_INVERT"}
_NOOPS = {"RESUME", "NOP", "CACHE", "PRECALL", "COPY_FREE_VARS", "EXTENDED_ARG", "KW_NAMES"}
_FLAGS_REFUSED = (inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE
                  | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE)
_MAX_DEPTH = 4
_CACHE_LIMIT = 4096

# kinds of stack slots
VALUE = "value"        # an argument, a constant, or computed from them
VOCAB = "vocab"        # a callable of the vocabulary (or a checked helper)
MODULE = "module"      # amanda.portable
PACKAGE = "package"    # amanda
NULL = "null"          # the NULL a call sequence pushes
OTHER = "other"        # anything else: may be carried, never used


class Verdict(NamedTuple):
    """Which way a routine goes, and why."""

    portable: bool
    how: str       # "marked", "marked hosted", "vocabulary", "inferred", "refused", "off"
    reason: str

    def __str__(self):
        way = "lowered natively" if self.portable else "hosted (Python callback)"
        return f"{way} [{self.how}]: {self.reason}"


class _Refused(Exception):
    pass


def _portable():
    from amanda import portable
    return portable


_VOCAB = {}


def _vocabulary():
    if _VOCAB:
        return _VOCAB
    portable = _portable()
    names = ("abs", "where", "clip", "minimum", "maximum", "cast", "round", "floor", "ceil",
             "sqrt", "exp", "log", "sign", "identity", "quantize", "dequantize", "fake_quant")
    _VOCAB.update((name, getattr(portable, name)) for name in names)
    return _VOCAB


def _is_vocab(value):
    return value is builtins.abs or any(value is f for f in _vocabulary().values())


def _constant_kind(value):
    """The kind of a captured value, or None when it is not accepted."""
    if value is None or type(value) in (bool, int, float, str):
        return VALUE
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return VALUE
    if type(value) is np.ndarray and value.dtype.kind in "biuf":
        return VALUE
    portable = _portable()
    if value is portable:
        return MODULE
    if value is sys.modules["amanda"]:
        return PACKAGE
    if _is_vocab(value):
        return VOCAB
    return None


# ---------------------------------------------------------------------------
# stage 1: the code


def _check_function(func, depth, seen, bound=False):
    """Raise _Refused unless ``func`` (a plain function) is pure arithmetic."""
    if not isinstance(func, types.FunctionType):
        raise _Refused(f"{_name(func)} is not a plain Python function")
    code = func.__code__
    if code in seen:
        raise _Refused(f"{_name(func)} calls itself")
    if depth > _MAX_DEPTH:
        raise _Refused(f"helpers nested deeper than {_MAX_DEPTH}")
    if code.co_flags & _FLAGS_REFUSED:
        raise _Refused(f"{_name(func)} is a generator/coroutine or takes **kwargs")
    if code.co_cellvars:
        raise _Refused(f"{_name(func)} defines an inner function over its locals")
    for default in list(func.__defaults__ or ()) + list((func.__kwdefaults__ or {}).values()):
        if _constant_kind(default) != VALUE:
            raise _Refused(f"a default argument of {_name(func)} is a "
                           f"{type(default).__name__}, not a number or NumPy array")
    cells = {}
    for name, cell in zip(code.co_freevars, func.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            raise _Refused(f"closure variable {name!r} is not bound yet") from None
        cells[name] = _captured_kind(name, value, depth, seen | {code})
    nargs = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    local = {name: VALUE for name in code.co_varnames[:nargs]}
    if bound:
        local[code.co_varnames[0]] = OTHER
    _simulate(func, code, local, cells, depth, seen | {code})


def _captured_kind(name, value, depth, seen):
    kind = _constant_kind(value)
    if kind is not None:
        return kind
    if isinstance(value, types.FunctionType):
        _check_function(value, depth + 1, seen)
        return VOCAB
    raise _Refused(f"captured {name!r} is a {type(value).__module__}.{type(value).__name__} "
                   "(only NumPy arrays, NumPy scalars, Python numbers and strings are baked "
                   "into a graph as constants)")


def _global_kind(func, name, depth, seen):
    if name in func.__globals__:
        value = func.__globals__[name]
    elif hasattr(builtins, name):
        value = getattr(builtins, name)
    else:
        raise _Refused(f"global {name!r} is not defined")
    if value is builtins.abs or value is _portable() or value is sys.modules["amanda"]:
        return _constant_kind(value) or VOCAB
    if _is_vocab(value):
        return VOCAB
    if isinstance(value, types.FunctionType) and value.__module__ != "builtins":
        _check_function(value, depth + 1, seen)
        return VOCAB
    raise _Refused(f"it reads global {name!r} (a {type(value).__name__}; globals can be "
                   "rebound, so only amanda.portable, its functions and checked helper "
                   "functions are read from them)")


_STORES = {"STORE_ATTR": "it sets attribute {}", "DELETE_ATTR": "it deletes attribute {}",
           "STORE_GLOBAL": "it assigns global {}", "DELETE_GLOBAL": "it deletes global {}",
           "STORE_DEREF": "it assigns {} of an enclosing scope",
           "STORE_SUBSCR": "it assigns into a container", "DELETE_SUBSCR": "it deletes an item",
           "IMPORT_NAME": "it imports {}", "RAISE_VARARGS": "it raises",
           "YIELD_VALUE": "it yields"}


def _simulate(func, code, local, cells, depth, seen):
    for ins in dis.get_instructions(code):   # the plainest reasons first
        if ins.opname in _STORES:
            raise _Refused(_STORES[ins.opname].format(repr(ins.argval)))
    stack = []

    def pop(n=1):
        if len(stack) < n:
            raise _Refused("unexpected bytecode")
        taken = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return taken

    def values(kinds, what):
        if any(k != VALUE for k in kinds):
            raise _Refused(f"{what} applied to something that is not a tensor or constant")

    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    for ins in dis.get_instructions(code):
        op = ins.opname
        if ins.opcode in jumps:
            raise _Refused("it branches or loops (if/and/or/for/while/ternary)")
        if op in _NOOPS:
            continue
        if op in ("LOAD_FAST", "LOAD_FAST_CHECK"):
            if ins.argval not in local:
                raise _Refused(f"local {ins.argval!r} read before it is set")
            stack.append(local[ins.argval])
        elif op == "STORE_FAST":
            local[ins.argval] = pop()[0]
        elif op == "LOAD_FAST_LOAD_FAST":            # 3.13
            for name in ins.argval:
                if name not in local:
                    raise _Refused(f"local {name!r} read before it is set")
                stack.append(local[name])
        elif op == "STORE_FAST_STORE_FAST":          # 3.13
            for name in ins.argval:
                local[name] = pop()[0]
        elif op == "STORE_FAST_LOAD_FAST":           # 3.13
            stored, loaded = ins.argval
            local[stored] = pop()[0]
            if loaded not in local:
                raise _Refused(f"local {loaded!r} read before it is set")
            stack.append(local[loaded])
        elif op == "LOAD_CONST":
            stack.append(VALUE if _constant_kind(ins.argval) == VALUE
                         or _const_tuple(ins.argval) else OTHER)
        elif op == "RETURN_CONST":                  # 3.12: as LOAD_CONST + RETURN_VALUE
            raise _Refused("it returns something that is not a tensor")
        elif op == "LOAD_DEREF":
            if ins.argval not in cells:
                raise _Refused(f"it reads {ins.argval!r} from an enclosing scope")
            stack.append(cells[ins.argval])
        elif op == "LOAD_GLOBAL":
            if ins.arg & 1:
                stack.append(NULL)
            stack.append(_global_kind(func, ins.argval, depth, seen))
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            owner = pop()[0]
            if owner == MODULE and ins.argval in _vocabulary():
                result = VOCAB
            elif owner == PACKAGE and ins.argval == "portable":
                result = MODULE
            else:
                raise _Refused(f"it reads attribute {ins.argval!r} (only amanda.portable "
                               "functions may be read; .numpy(), self.x and methods are "
                               "not tensor arithmetic)")
            if op == "LOAD_METHOD" or (op == "LOAD_ATTR" and ins.arg & 1
                                       and _version() >= (3, 12)):
                stack.append(NULL)
            stack.append(result)
        elif op == "PUSH_NULL":
            stack.append(NULL)
        elif op == "BINARY_OP":
            if ins.argrepr not in _BINARY:
                raise _Refused(f"operator {ins.argrepr!r} is not in the portable vocabulary "
                               "(in-place operators could change the runtime's tensors)")
            values(pop(2), f"operator {ins.argrepr}")
            stack.append(VALUE)
        elif op == "COMPARE_OP":
            if ins.argrepr not in _COMPARE:
                raise _Refused(f"comparison {ins.argrepr!r} converts to a Python bool")
            values(pop(2), f"comparison {ins.argrepr}")
            stack.append(VALUE)
        elif op in _UNARY:
            values(pop(), op)
            stack.append(VALUE)
        elif op in ("BUILD_TUPLE", "BUILD_LIST"):
            values(pop(ins.arg), "a tuple or list")
            stack.append(VALUE)
        elif op in ("CALL", "CALL_KW"):
            if op == "CALL_KW":                     # 3.13: the names tuple on top
                pop()
            args = pop(ins.arg)
            first, second = pop(2)
            callee = second if first == NULL else first
            if (first != NULL and second != NULL) or callee != VOCAB:
                raise _Refused("it calls something outside the portable vocabulary")
            values(args, "a call")
            stack.append(VALUE)
        elif op == "SWAP":
            i = ins.arg
            stack[-1], stack[-i] = stack[-i], stack[-1]
        elif op == "POP_TOP":
            pop()
        elif op == "RETURN_VALUE":
            result = pop()[0]
            if result != VALUE:
                raise _Refused("it returns something that is not a tensor")
            return
        else:
            raise _Refused(f"bytecode {op} is outside pure tensor arithmetic")
    raise _Refused("no return")


def _const_tuple(value):
    return type(value) is tuple and all(_constant_kind(v) == VALUE or _const_tuple(v)
                                        for v in value)


def _version():
    import sys
    return sys.version_info[:2]


def _name(func):
    return getattr(func, "__qualname__", None) or type(func).__name__


# ---------------------------------------------------------------------------
# stages 2 and 3: trial trace and difference test


def _captured_arrays(func):
    found = []
    for cell in func.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, np.ndarray):
            found.append(value)
        elif isinstance(value, types.FunctionType):
            found.extend(_captured_arrays(value))
    found.extend(v for v in func.__defaults__ or () if isinstance(v, np.ndarray))
    return found


def _trial(func, plain, bound):
    """Trace ``func`` and compare with a NumPy call; return a description of
    the trial that passed, or raise _Refused."""
    portable = _portable()
    code = plain.__code__
    names = list(code.co_varnames[:code.co_argcount])[int(bound):]
    defaults = len(plain.__defaults__ or ())
    positional = names[:len(names) - defaults]
    kwonly = [n for n in code.co_varnames[code.co_argcount:code.co_argcount
                                          + code.co_kwonlyargcount]
              if n not in (plain.__kwdefaults__ or {})]
    count = len(positional) + len(kwonly)

    def call(*tensors):
        return func(*tensors[:len(positional)], **dict(zip(kwonly, tensors[len(positional):])))

    shapes = sorted({tuple(a.shape) for a in _captured_arrays(plain)}, key=len, reverse=True)
    shapes = shapes + [(2, 3)]
    rng = np.random.default_rng(0)
    failures = []
    for dtype in ("float32", "int32", "bool"):
        for shape in shapes:
            try:
                graph = portable.trace(call, [(dtype, list(shape))] * count, name=_name(func))
            except portable.PortableError as exc:
                failures.append(f"{dtype}{list(shape)}: {exc}")
                continue
            if dtype == "bool":
                inputs = [rng.random(shape, np.float32) > 0.5 for _ in range(count)]
            elif dtype == "int32":
                inputs = [rng.integers(-8, 8, shape, np.int32) for _ in range(count)]
            else:
                inputs = [rng.standard_normal(shape, np.float32) * 4 for _ in range(count)]
            problem = _difference(graph, call, inputs)
            if problem is None:
                return f"traced as {dtype}{list(shape)} and equal to NumPy on random values"
            failures.append(f"{dtype}{list(shape)}: {problem}")
    raise _Refused("the trial failed: " + "; ".join(failures[:2]))


def _difference(graph, call, inputs):
    portable = _portable()
    with np.errstate(all="ignore"):
        try:
            traced = portable.evaluate(graph, [a.copy() for a in inputs])
            direct = call(*[a.copy() for a in inputs])
        except Exception as exc:   # noqa: BLE001 - any failure refuses
            return f"{type(exc).__name__}: {exc}"
    if direct is None:
        direct = []
    elif not isinstance(direct, (list, tuple)):
        direct = [direct]
    if len(direct) != len(traced):
        return f"{len(direct)} results called directly, {len(traced)} traced"
    for i, (want, got) in enumerate(zip(direct, traced)):
        if want is None:
            want = inputs[i]
        want, got = np.asarray(want), np.asarray(got)
        if want.shape != got.shape or (want.dtype.kind == "b") != (got.dtype.kind == "b"):
            return f"result {i}: {want.dtype}{want.shape} directly, {got.dtype}{got.shape} traced"
        if not np.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True):
            return f"result {i} differs between the trace and a direct NumPy call"
    return None


# ---------------------------------------------------------------------------
# the verdict, cached


_cache = {}


def _token(value, refs):
    if value is None or type(value) in (bool, int, float, str):
        return ("=", type(value), value)
    try:
        refs.append(weakref.ref(value))
    except TypeError:
        pass
    return ("id", type(value), id(value))


def _key(plain, bound):
    refs = []
    code = plain.__code__
    parts = [code, bound]
    for cell in plain.__closure__ or ():
        try:
            parts.append(_token(cell.cell_contents, refs))
        except ValueError:
            parts.append(("unbound",))
    for value in list(plain.__defaults__ or ()) + list((plain.__kwdefaults__ or {}).values()):
        parts.append(_token(value, refs))
    for name in code.co_names:
        value = plain.__globals__.get(name, getattr(builtins, name, None))
        parts.append(_token(value, refs) if callable(value) or isinstance(value, types.ModuleType)
                     else ("global", name, type(value)))
    return tuple(parts), refs


def verdict(func):
    """The :class:`Verdict` for an unmarked routine (inference on)."""
    plain = getattr(func, "__func__", func)
    bound = plain is not func
    if _is_vocab(plain):
        return Verdict(True, "vocabulary", "an amanda.portable function")
    if not isinstance(plain, types.FunctionType):
        return Verdict(False, "refused", f"{_name(func)} is not a plain Python function")
    key, refs = _key(plain, bound)
    entry = _cache.get(key)
    if entry is not None and all(r() is not None for r in entry[1]):
        return entry[0]
    try:
        _check_function(plain, 0, frozenset(), bound=bound)
        how = _trial(func, plain, bound)
        result = Verdict(True, "inferred", f"pure tensor arithmetic; {how}")
    except _Refused as why:
        result = Verdict(False, "refused", str(why))
    except RecursionError:
        result = Verdict(False, "refused", "too deeply nested")
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = (result, refs)
    log.debug("routine %s: %s", _name(func), result)
    return result


def clear_cache():
    """Forget every cached verdict."""
    _cache.clear()


def explain(func):
    """A :class:`Verdict` ``(portable, how, reason)``: which way ``func`` goes and why
    (``amanda.portable.explain``)."""
    portable = _portable()
    mark = getattr(getattr(func, "__func__", func), portable._MARK, None)
    if mark is not None:
        return Verdict(bool(mark), "marked" if mark else "marked hosted",
                       "@portable.routine" if mark else "@portable.hosted")
    if not portable.infer:
        return Verdict(False, "off", "amanda.portable.infer is False")
    return verdict(func)


class inference:
    """``with amanda.portable.inference(False):`` turns inference off (or on) in a
    block, restoring ``amanda.portable.infer`` after it."""

    def __init__(self, enabled=True):
        self.enabled = enabled

    def __enter__(self):
        portable = _portable()
        self.saved, portable.infer = portable.infer, self.enabled
        return self

    def __exit__(self, *exc):
        _portable().infer = self.saved
