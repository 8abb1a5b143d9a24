"""A kernel's source as a chapter teaches it: everything the chosen flags switch off, removed.

The package's kernels carry what a chapter has not taught yet (windows, packed sequences, grouped
heads, score modifications): branches ``if WINDOW: ... else: ...`` on ``tl.constexpr`` flags, which
the compiler removes for each specialisation, and the parameters, arguments, set-up lines and
aliases that only those branches use. :func:`pruned_source` removes all of it from the text, given
the values that switch it off (``{"WINDOW": False, "n_group": 1, ...}``):

1. each name (or expression, such as ``"LSE.dtype.element_ty == tl.float64"``) given a value is
   replaced by it and the expressions around it simplified (``head // 1`` is ``head``, ``IS_CAUSAL
   and not False`` is ``IS_CAUSAL``); an ``if`` that is decided keeps the branch it takes, a loop
   over ``range(0, 1)`` becomes its body;
2. a call of a kernel of the same module loses the arguments of the parameters that kernel's own
   view drops (the 14 keyword arguments of an inner loop that only score modifications read);
3. then, until nothing changes: assignments nobody reads are removed (``drop_row0 = ...``), an alias
   ``x = y`` left by a removed branch is replaced by ``y`` (``s_scale = qk_scale``), a factor that
   is a vector of ones is dropped, an ``if`` left empty goes;
4. the parameters nobody reads leave the signature (and ``do_not_specialize``), and the sentences
   of comments and docstrings that name what was removed (an identifier, or one of ``words``) go.

The text comes from the real source every time and keeps its comments and layout; what a learner
reads is what runs with those values, minus what they switch off. tests/test_teaching_view.py runs
the views as kernels in place of the real ones and compares the outputs bit for bit.
"""
import ast
import copy
import inspect
import io
import re
import textwrap
import tokenize
from collections import Counter
from dataclasses import dataclass

from .view_text import BODIES as _BODIES, Text, as_code, span as _span

_IMPURE = re.compile(r"store|atomic|print|debug|barrier")  # calls whose result may be unused


@dataclass(frozen=True)
class View:
    """The teaching view of one function."""
    text: str         # the pruned source
    first: int        # the line the function starts at in its file
    hidden: int       # how many lines of the original it leaves out
    lines: int        # how many lines the original has
    flags: dict       # the keys of ``only`` the function uses, with their values
    params: tuple     # the parameters the view keeps, in order
    names: frozenset  # identifiers of the original that the view no longer has


_CACHE = {}


def pruned_source(obj, only, words=()):
    """The :class:`View` of ``obj`` (a function or a ``@triton.jit`` kernel) with the values of
    ``only`` (a name or an expression's source -> its value) fixed, and what they switch off
    removed. ``words`` name the switched-off features in prose: a comment's sentence holding one
    goes too. A preset such as ``flashattn.course.notebook.LATER`` may name keys a kernel lacks, but
    not only such keys (a typo that matches nothing is refused)."""
    fn = getattr(obj, "fn", obj)
    key = (fn, tuple(sorted((k, repr(v)) for k, v in only.items())), tuple(words))
    if key not in _CACHE:
        _CACHE[key] = _Pruner(fn, only, tuple(words)).view()
    return _CACHE[key]


def _names(tree, ctx=None):
    return Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and (ctx is None or isinstance(n.ctx, ctx)))


def _loads(tree):
    """How often each name is read in ``tree``, ``x += ...`` counting as a read of x."""
    return _names(tree, ast.Load) + Counter(
        s.target.id for s in ast.walk(tree) if isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name))


def _pure(node):
    return not any(isinstance(n, ast.Call) and _IMPURE.search(ast.unparse(n.func)) for n in ast.walk(node))


def _constant(node):
    return isinstance(node, ast.Constant) and not isinstance(node.value, str)


class _Pruner(Text):
    def __init__(self, fn, only, words):
        lines, self.first = inspect.getsourcelines(fn)
        self.source = textwrap.dedent("".join(lines))
        self.lines = self.source.splitlines()
        self.func = ast.parse(self.source).body[0]
        self.original = ast.parse(self.source).body[0]
        names = set(_names(self.func)) | {a.arg for a in ast.walk(self.func) if isinstance(a, ast.arg)}
        exprs = {ast.unparse(n) for n in ast.walk(self.func) if isinstance(n, (ast.Compare, ast.Attribute))}
        self.flags = {k: v for k, v in only.items() if (k in names if k.isidentifier() else k in exprs)}
        if not self.flags:
            raise ValueError(f"only= names flags {sorted(only)}, none of which {fn.__name__} uses")
        self.fn, self.only, self.words = fn, only, words
        self.bindings = dict(self.flags)
        self.comments = {}  # line -> (column, text) of each comment
        for tok in tokenize.generate_tokens(io.StringIO(self.source).readline):
            if tok.type == tokenize.COMMENT:
                self.comments[tok.start[0]] = (tok.start[1], tok.string)
        self.decided = set()  # lines inside branches the values remove
        for node in ast.walk(self.func):  # which ifs are elifs in the source
            if isinstance(node, ast.If) and len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                inner = node.orelse[0]
                inner._elif = self.lines[inner.lineno - 1].lstrip().startswith("elif")

    # --- 1. values in, expressions simplified, decided branches and one-trip loops inlined -------

    def replace(self, old, new):
        if hasattr(new, "lineno") and not hasattr(new, "_span"):
            new = copy.copy(new)
        new._span = _span(old)
        return new

    def expr(self, node, top=True):
        """``node`` with the bindings substituted and simplified (a new node where it changed)."""
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.bindings:
            return self.replace(node, ast.Constant(self.bindings[node.id]))
        if isinstance(node, (ast.Compare, ast.Attribute)) and ast.unparse(node) in self.bindings:
            return self.replace(node, ast.Constant(self.bindings[ast.unparse(node)]))
        for field, value in ast.iter_fields(node):
            child_top = isinstance(node, (ast.Call, ast.keyword, ast.List, ast.Tuple, ast.Subscript))
            if isinstance(value, ast.expr) and not isinstance(value, ast.expr_context):
                setattr(node, field, self.expr(value, child_top))
            elif isinstance(value, list):
                setattr(node, field, [self.expr(v, child_top) if isinstance(v, ast.expr) else
                                      self.expr(v) if isinstance(v, ast.keyword) else v for v in value])
            elif isinstance(value, ast.keyword):
                setattr(node, field, self.expr(value))
        if isinstance(node, ast.keyword):
            return node
        simpler = self.simplify(node)
        if simpler is node:
            return node
        simpler = self.replace(node, simpler)
        simpler._paren = not top and isinstance(simpler, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp))
        return simpler

    @staticmethod
    def simplify(node):
        if isinstance(node, ast.BoolOp):
            is_and, left = isinstance(node.op, ast.And), []
            for part in node.values:
                if not _constant(part):
                    left.append(part)
                elif bool(part.value) is not is_and:  # a False in an `and`, a True in an `or`
                    return ast.Constant(bool(part.value))
            if len(left) == len(node.values):
                return node
            return left[0] if len(left) == 1 else ast.Constant(is_and) if not left else ast.BoolOp(node.op, left)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and _constant(node.operand):
            return ast.Constant(not node.operand.value)
        if isinstance(node, ast.Compare) and _constant(node.left) and all(map(_constant, node.comparators)):
            expression = ast.fix_missing_locations(ast.Expression(copy.deepcopy(node)))
            return ast.Constant(eval(compile(expression, "<view>", "eval")))
        if isinstance(node, ast.BinOp):
            left, right, op = node.left, node.right, type(node.op)
            # ints only: x // 1.0 floors and x * 1.0 changes an int's dtype
            one = lambda n: _constant(n) and type(n.value) is int and n.value == 1  # noqa: E731
            zero = lambda n: _constant(n) and type(n.value) is int and n.value == 0  # noqa: E731
            if (op in (ast.Mult, ast.FloorDiv) and one(right)) or (op in (ast.Add, ast.Sub) and zero(right)):
                return left
            if (op is ast.Mult and one(left)) or (op is ast.Add and zero(left)):
                return right
        return node

    def block(self, stmts):
        """The statements of a block with values substituted and decided branches inlined."""
        out = []
        for stmt in stmts:
            out.extend(self.statement(stmt))
        return out

    def inline(self, node, stmts):
        """Statements that take ``node``'s place: its leading comments go with the first."""
        if stmts:
            stmts[0]._lead = getattr(node, "_lead", []) + [node] + getattr(stmts[0], "_lead", [])
        return stmts

    def statement(self, stmt):
        if isinstance(stmt, ast.If):
            stmt.test = self.expr(stmt.test)
            if _constant(stmt.test):
                taken = stmt.body if stmt.test.value else stmt.orelse
                for other in (stmt.orelse if stmt.test.value else stmt.body):
                    self.decided.update(range(other.lineno, other.end_lineno + 1))
                return self.inline(stmt, self.block(taken))
            stmt.body, stmt.orelse = self.block(stmt.body), self.block(stmt.orelse)
            return [stmt]
        if isinstance(stmt, ast.For):
            stmt.iter = self.expr(stmt.iter)
            trips = self.one_trip(stmt)
            if trips is not None:
                self.bindings[stmt.target.id] = trips
                try:
                    return self.inline(stmt, self.block(stmt.body))
                finally:
                    del self.bindings[stmt.target.id]
            stmt.body = self.block(stmt.body)
            return [stmt]
        for field, value in ast.iter_fields(stmt):
            if isinstance(value, ast.expr) and not (field == "target" or field == "targets"):
                setattr(stmt, field, self.expr(value))
            elif isinstance(value, list) and field not in ("targets",) + _BODIES:
                setattr(stmt, field, [self.expr(v) if isinstance(v, ast.expr) else v for v in value])
            elif isinstance(value, list) and field in _BODIES:
                setattr(stmt, field, self.block(value))
        return [stmt]

    @staticmethod
    def one_trip(loop):
        """The loop variable's one value, if ``loop`` is ``for x in range(...)`` with one trip."""
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                and isinstance(loop.target, ast.Name) and not it.keywords and all(map(_constant, it.args))
                and not loop.orelse):
            return None
        values = range(*(a.value for a in it.args))
        inner = [n for s in loop.body for n in ast.walk(s)]
        if len(values) != 1 or any(isinstance(n, (ast.Break, ast.Continue)) for n in inner) \
                or loop.target.id in _names(ast.Module(loop.body, []), ast.Store):
            return None
        return values[0]

    # --- 2. calls of the module's own kernels lose the arguments their views drop -----------------

    def callees(self):
        """{name: (parameters, parameters kept)} of the kernels of this module the function calls
        whose views drop parameters under the same values."""
        found = {}
        for call in ast.walk(self.func):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                continue
            target = self.fn.__globals__.get(call.func.id)
            inner = getattr(target, "fn", target)
            if not inspect.isfunction(inner) or inner is self.fn or inner.__module__ != self.fn.__module__:
                continue
            try:
                view = pruned_source(target, self.only, self.words)
            except ValueError:  # uses none of the values: unchanged
                continue
            found[call.func.id] = (tuple(inspect.signature(inner).parameters), view.params)
        return found

    def drop_arguments(self, callees):
        for call in ast.walk(self.func):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in callees):
                continue
            params, kept = callees[call.func.id]
            keep_arg = [i >= len(params) or params[i] in kept for i in range(len(call.args))]
            keep_kw = [kw.arg is None or kw.arg in kept for kw in call.keywords]
            call._elements = ([(_span(a), not k) for a, k in zip(call.args, keep_arg)]
                              + [((kw.lineno, kw.col_offset, kw.end_lineno, kw.end_col_offset), not k)
                                 for kw, k in zip(call.keywords, keep_kw)])
            call.args = [a for a, k in zip(call.args, keep_arg) if k]
            call.keywords = [kw for kw, k in zip(call.keywords, keep_kw) if k]

    # --- 3. dead assignments, aliases, factors of one, empty ifs ------------------------------------

    def blocks(self, node=None):
        """Every list of statements in the function, innermost last."""
        node = node or self.func
        for field in _BODIES:
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts
                for stmt in stmts:
                    yield from self.blocks(stmt)

    def remove(self, stmts, stmt):
        i = next(i for i, s in enumerate(stmts) if s is stmt)
        del stmts[i]
        inherited = getattr(stmt, "_lead", [])
        if inherited and i < len(stmts):  # a section's comment moves on to what follows
            stmts[i]._lead = inherited + getattr(stmts[i], "_lead", [])

    def mentioned(self, name):
        """Whether a comment line the view keeps (not in a removed branch, not on the name's own
        assignment, naming no switched-off feature) names ``name`` (as code, if it could be a word)."""
        pattern = as_code(name)
        own = {s.lineno for s in ast.walk(self.func) if isinstance(s, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)}
        switched = [k for k in self.flags if k.isidentifier()]
        return any(re.search(pattern, text) for line, (_, text) in self.comments.items()
                   if line not in self.decided and line not in own
                   and not any(re.search(rf"(?<!\w){re.escape(w)}", text, re.I) for w in self.words)
                   and not any(re.search(rf"(?<!\w){k}(?!\w)", text) for k in switched))

    def sweep(self):
        """One removal (returns True) of a dead assignment, an alias, a factor of one or an empty if."""
        loads = _loads(self.func)
        stores = _names(self.func, ast.Store)
        for stmts in list(self.blocks()):
            for stmt in stmts:
                targets = (stmt.targets if isinstance(stmt, ast.Assign) else
                           [stmt.target] if isinstance(stmt, ast.AugAssign) else None)
                if targets is None:
                    continue
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                if not all(isinstance(n, (ast.Name, ast.Tuple, ast.Store)) for t in targets for n in ast.walk(t)):
                    continue
                own = _names(stmt.value, ast.Load)
                same = isinstance(stmt, ast.Assign) and ast.unparse(stmt.value) == ast.unparse(targets[0])
                if _pure(stmt.value) and (same or all(loads[n] - own[n] == 0 for n in names)):
                    self.remove(stmts, stmt)
                    return True
                if isinstance(stmt, ast.Assign) and len(names) == 1 and stores[names[0]] == 1 \
                        and isinstance(targets[0], ast.Name) and self.alias(stmts, stmt, names[0]):
                    return True
        for stmts in list(self.blocks()):
            for stmt in stmts:
                if isinstance(stmt, (ast.If, ast.For)) and not stmt.body and not stmt.orelse and \
                        _pure(stmt.test if isinstance(stmt, ast.If) else stmt.iter):
                    self.remove(stmts, stmt)
                    return True
        return False

    def alias(self, stmts, stmt, name):
        """Replace an alias ``name = y`` by ``y``, or drop a factor ``name = tl.full(shape, 1.0)``."""
        params = {a.arg for a in self.func.args.args}
        later = stmts[stmts.index(stmt) + 1:]
        uses = [n for s in later for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == name]
        if name in params or self.mentioned(name) or \
                len(uses) != sum(1 for n in ast.walk(self.func) if isinstance(n, ast.Name) and n.id == name) - 1:
            return False  # a parameter, a name the comments use, or read before it is set
        value = stmt.value
        if isinstance(value, ast.Name):
            if value.id in _names(ast.Module(later, []), ast.Store):
                return False
            if len(name) < len(value.id) and value.id not in params and not self.mentioned(value.id) \
                    and _names(self.func, ast.Store)[value.id] == 1:  # keep the shorter name: head, not kv_head
                self.substitute(self.func.body, value.id, lambda old: self.replace(old, ast.Name(name, old.ctx)))
                self.remove(stmts, stmt)  # now `name = name`
                return True
            self.substitute(later, name, lambda old: self.replace(old, ast.Name(value.id, ast.Load())))
        elif (isinstance(value, ast.Call) and ast.unparse(value.func) == "tl.full" and len(value.args) >= 2
              and _constant(value.args[1]) and value.args[1].value == 1):
            factors = self.factor_uses(later, name)
            if factors is None:
                return False
            for binop, other in factors:
                self.substitute(later, binop, lambda old, other=other: self.replace(old, other))
        else:
            return False
        self.remove(stmts, stmt)
        return True

    def factor_uses(self, stmts, name):
        """[(product, its other factor)] for each use of ``name`` as a factor of a product that
        itself multiplies something (``dq *= scale * name[:, None]``), where a factor of ones changes
        nothing but that factor's shape; None if ``name`` is used any other way."""
        found, uses = [], 0
        for node in (n for s in stmts for n in ast.walk(s)):
            uses += isinstance(node, ast.Name) and node.id == name
            products = [node.value] if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mult) else []
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                products += [node.left, node.right]
            for product in products:
                if not (isinstance(product, ast.BinOp) and isinstance(product.op, ast.Mult)):
                    continue
                for this, other in ((product.left, product.right), (product.right, product.left)):
                    base = this.value if isinstance(this, ast.Subscript) else this
                    if isinstance(base, ast.Name) and base.id == name:
                        found.append((product, other))
        return found if len(found) == uses else None

    def substitute(self, stmts, old, make):
        """Replace, in ``stmts``, each Name ``old`` (a string) or the node ``old`` by ``make(node)``."""
        def visit(node):
            for field, value in ast.iter_fields(node):
                if isinstance(value, ast.AST):
                    setattr(node, field, pick(value))
                    visit(getattr(node, field))
                elif isinstance(value, list):
                    setattr(node, field, [pick(v) if isinstance(v, ast.AST) else v for v in value])
                    for v in getattr(node, field):
                        if isinstance(v, ast.AST):
                            visit(v)

        def pick(node):
            if (node is old) or (isinstance(old, str) and isinstance(node, ast.Name) and node.id == old):
                return make(node)
            return node
        for stmt in stmts:
            visit(stmt)

    def drop_parameters(self):
        loads = _loads(self.func)
        args = self.func.args
        first_default = len(args.args) - len(args.defaults)
        elements = []
        for i, a in enumerate(args.args):
            end = args.defaults[i - first_default] if i >= first_default else a
            elements.append(((a.lineno, a.col_offset, end.end_lineno, end.end_col_offset), loads[a.arg] == 0))
        args._elements = elements
        keep = [not removed for _, removed in elements]
        args.defaults = [d for i, d in enumerate(args.defaults) if keep[first_default + i]]
        args.args = [a for a, k in zip(args.args, keep) if k]
        kept = {a.arg for a in args.args}
        for deco in self.func.decorator_list:  # do_not_specialize=[...] names only parameters it keeps
            for kw in getattr(deco, "keywords", []):
                if isinstance(kw.value, ast.List) and all(isinstance(e, ast.Constant) for e in kw.value.elts):
                    kw.value._elements = [(_span(e), e.value not in kept) for e in kw.value.elts]
                    kw.value.elts = [e for e in kw.value.elts if e.value in kept]

    # --- 4. the view ------------------------------------------------------------------------------

    def view(self):
        self.func.body = self.block(self.func.body)
        self.drop_arguments(self.callees())
        while self.sweep():
            pass
        self.drop_parameters()
        before = {a.arg for a in ast.walk(self.original) if isinstance(a, ast.arg)} | set(_names(self.original))
        after = {a.arg for a in ast.walk(self.func) if isinstance(a, ast.arg)} | set(_names(self.func))
        self.gone = {n for n in before - after if len(n) >= 3} | {k for k in self.flags if k.isidentifier()}
        text = self.render()
        lines = len(self.lines)
        return View(text, self.first, lines - len(text.splitlines()), lines, dict(self.flags),
                    tuple(a.arg for a in self.func.args.args), frozenset(self.gone))
