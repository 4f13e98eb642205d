"""Chat templates: Jinja run the way transformers runs it, within bounds of time and memory.

A chat template is data from a model folder, and Jinja is a language: transformers' sandbox
keeps a template from reaching Python's internals, but not from looping 10^10 times or
building a string of 10^9 characters. Here every render has a budget, and a template that
passes it is refused with a ValueError that names the limit:

- steps: each loop turn, call, filter, attribute or item lookup and operator costs one;
- size: each string or list the template builds (by an operator, call, filter, `~` or by
  writing output, into the result or a macro's or block's buffer) costs its length, and
  numbers that ask for size (`'x' * n`, `center(n)`, `'%*d'`) are checked before the
  work is done, so no single step can allocate past the budget either;
- time: a deadline, checked at every step, for what stays (a slow filter on a long text).

>>> template = compile_chat_template("{% for m in messages %}[{{ m.content }}]{% endfor %}")
>>> render_chat_template(template, messages=[{"role": "user", "content": "hi"}])
'[hi]'
>>> hostile = compile_chat_template("{{ 'x' * 10**9 }}")
>>> render_chat_template(hostile, messages=[])  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: the chat template would build more than 8,388,608 characters (with '*'); ...
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.runtime
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS = 1_000_000  # the largest real templates (tools, many turns) take a few thousand
MAX_SIZE = 8 * 2**20  # characters or list items built, plus 16 for each of the messages'
SIZE_PER_INPUT = 16  # a template may copy and transform its messages many times
MAX_SECONDS = 10.0

_LOOP = "qkv_loop_turns"  # the filter every {% for %} iterable is wrapped in
_DIGITS = re.compile(r"\d+")


class _Refused(Exception):
    """A render past its budget. Not a ValueError, so no filter's own `except ValueError`
    (as in int("x")) can swallow it; render_chat_template turns it into one."""


class _Budget:
    """What one render may still spend."""

    def __init__(self, size: int) -> None:
        self.steps, self.size_left, self.size = 0, size, size
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Refused(
                f"the chat template takes more than {MAX_STEPS:,} steps (loop turns, calls, "
                "lookups, operators) to render; qkv stops templates there"
            )
        if time.monotonic() > self.deadline:
            raise _Refused(f"the chat template takes more than {MAX_SECONDS:g} s to render")

    def spend(self, size: int, what: str) -> None:
        """Take `size` characters (or items) from the budget; refuse before it goes below 0."""
        if size > self.size_left:
            raise _Refused(
                f"the chat template would build more than {self.size:,} characters ({what}); "
                "qkv bounds what a chat template may build"
            )
        self.size_left -= size


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "qkv_chat_template_budget", default=None
)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # compile-time constant folding: leave the work to the render
        raise nodes.Impossible()
    return budget


def _size(value: Any) -> int:
    """How much a value holds once spelled out: characters of strings, items of containers
    (nested ones counted in full, shared or not), bytes of whole numbers; others count 1."""
    memo: dict[int, int] = {}

    def size(v: Any) -> int:
        if isinstance(v, (str, bytes)):
            return len(v)
        if isinstance(v, bool) or not isinstance(v, (int, list, tuple, dict, set, frozenset)):
            return 1
        if isinstance(v, int):
            return v.bit_length() // 8 + 1
        if id(v) not in memo:
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
            memo[id(v)] = len(items) + sum(size(x) for x in items)
        return memo[id(v)]

    return size(value)


def _widths(format_string: str) -> int:
    """The largest number written in a format string ('%9999d', '{:>9999}'): a width."""
    return max((int(d) for d in _DIGITS.findall(format_string)), default=0)


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The size of `left operator right`, known before computing it."""
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequences):
            left, right = right, left
        if isinstance(left, sequences) and isinstance(right, int):
            return _size(left) * max(right, 0)
    if operator in ("*", "+") and isinstance(left, int) and isinstance(right, int):
        return _size(left) + _size(right)
    if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return _size(left) + _size(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return right * abs(left).bit_length() // 8 + 1
    if operator == "%" and isinstance(left, str):
        return len(left) + _size(right) + _widths(left)
    return 0


def _arguments_size(name: str, args: tuple, kwargs: dict, owner: Any = None) -> int:
    """What a call may build, known from its arguments: any whole number passed (a width, a
    count) and, for str methods and filters that join or replace, the text they make."""
    values = [*args, *kwargs.values()]
    needed = max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)),
                 default=0)  # fmt: skip
    if isinstance(owner, str):
        args = (owner, *args)
    text = args[0] if args and isinstance(args[0], str) else None
    if name in ("format", "format_map") and text is not None:
        needed = max(needed, len(text) + _widths(text) + sum(_size(v) for v in values))
    if name == "join" and len(args) >= 1 + isinstance(owner, str):  # "s".join(xs), xs|join(s)
        items, sep = (args[1], args[0]) if isinstance(owner, str) else (args[0], args[1:2])
        if isinstance(items, (list, tuple)):
            sep = sep[0] if isinstance(sep, tuple) and sep else sep
            sep_size = len(sep) if isinstance(sep, str) else 0
            needed = max(needed, sum(_size(x) for x in items) + sep_size * len(items))
    if name == "replace" and text is not None and len(args) >= 3:
        old, new = args[1], args[2]
        if isinstance(old, str) and isinstance(new, str):
            needed = max(needed, len(text) + (text.count(old) + 1) * len(new))
    return needed


class _CountingCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every piece of output and every `~` passing through the
    environment, so that what a template writes (into its result or into a buffer) counts."""

    def _output_const_repr(self, group) -> str:
        return f"environment.qkv_written({super()._output_const_repr(group)})"

    def _output_child_pre(self, node, frame, finalize) -> None:
        self.write("environment.qkv_written(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node, frame, finalize) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.qkv_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, counting each step and each thing built against the budget."""

    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.spend(_binop_size(operator, left, right), f"with {operator!r}")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if (budget := _BUDGET.get()) is not None:
            budget.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if (budget := _BUDGET.get()) is not None:
            budget.step()
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's names: a kwarg may be 'obj'
        budget = _budget()
        budget.step()
        name = getattr(__obj, "__name__", "a call")
        # the sandbox hands out str.format wrapped (to check the fields it reads)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        budget.spend(_arguments_size(name, args, kwargs, owner), f"in {name}()")
        result = super().call(__context, __obj, *args, **kwargs)
        if not isinstance(owner, dict):  # dict.get and .items() return what exists already
            budget.spend(_size(result), f"the result of {name}()")
        return result

    def qkv_written(self, text: str) -> str:
        _budget().spend(len(text), "its output")
        return text

    def qkv_concat(self, parts: tuple) -> str:
        texts = [str(part) for part in parts]
        _budget().spend(sum(map(len, texts)), "with '~'")
        return "".join(texts)


_PASSED = (jinja2.runtime.Context, nodes.EvalContext, jinja2.Environment)  # jinja's own arguments


def _bounded_filter(name: str, function):
    @functools.wraps(function)  # keeps jinja's pass_context/pass_environment marks
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.step()
        plain = tuple(a for a in args if not isinstance(a, _PASSED))
        budget.spend(_arguments_size(name, plain, kwargs), f"in the filter {name}")
        result = function(*args, **kwargs)
        budget.spend(_size(result), f"the result of the filter {name}")
        return result

    return bounded


class _CountedTurns:
    """A loop's iterable, each turn one step; its length is the iterable's own."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __len__(self) -> int:
        return len(self.iterable)

    def __iter__(self):
        budget = _budget()
        for item in self.iterable:
            budget.step()
            yield item


def _loop_turns(iterable: Any) -> _CountedTurns:
    _budget()
    return _CountedTurns(iterable)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox transformers uses, with the same helpers."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_LOOP] = _loop_turns
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the chat template is not valid Jinja: {error}") from error
    for loop in list(tree.find_all(nodes.For)):  # every loop turn is a step
        loop.iter = nodes.Filter(loop.iter, _LOOP, [], [], None, None, lineno=loop.lineno)
    return env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)


def render_chat_template(template: jinja2.Template, **variables: Any) -> str:
    """Render within the budget: a ValueError naming the limit for a template past it, or
    for any other failure of the template (it is data from the model folder, not code)."""
    budget = _Budget(MAX_SIZE + SIZE_PER_INPUT * _size(variables.get("messages", [])))
    token = _BUDGET.set(budget)
    try:
        return template.render(**variables)
    except _Refused as error:
        raise ValueError(str(error)) from None
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template rejected the messages: {error}") from error
    except (MemoryError, RecursionError) as error:
        lack = "memory" if isinstance(error, MemoryError) else "stack (it recurses too deep)"
        raise ValueError(f"the chat template ran out of {lack} while rendering") from None
    except Exception as error:  # the template's own arithmetic or lookups failed
        raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from error
    finally:
        _BUDGET.reset(token)
