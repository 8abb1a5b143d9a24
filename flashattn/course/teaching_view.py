"""A kernel's source with the branches of chosen constexpr flags removed, for reading.

The package's kernels carry branches a chapter has not taught yet (windows, packed sequences,
score modifications): ``if WINDOW: ... else: ...`` on ``tl.constexpr`` flags, which the compiler
removes for each specialisation. :func:`pruned_source` does the same to the text: given
``{"WINDOW": False, "VARLEN": False}`` it keeps the branch each ``if`` would take, dedented, and
drops the other; a condition that still depends on a flag left open is shortened to what remains
(``if IS_CAUSAL and not VARLEN:`` becomes ``if IS_CAUSAL:``). The text comes from the real source
every time, so what a learner reads is what runs, minus what was switched off.

Only ``if`` statements are pruned. Arguments and calls that pass the flags stay as they are: the
signature is still the real one.
"""
import ast
import inspect
import textwrap

_UNKNOWN = object()


def _simplify(node, flags):
    """``(value, node)``: the condition's truth value if ``flags`` decide it, else ``_UNKNOWN``
    and the condition with the decided parts taken out."""
    if isinstance(node, ast.Name) and node.id in flags:
        return bool(flags[node.id]), node
    if isinstance(node, ast.Constant):
        return bool(node.value), node
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        value, inner = _simplify(node.operand, flags)
        return (_UNKNOWN, ast.UnaryOp(ast.Not(), inner)) if value is _UNKNOWN else (not value, node)
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        left = []
        for part in node.values:
            value, inner = _simplify(part, flags)
            if value is _UNKNOWN:
                left.append(inner)
            elif value is not is_and:  # a False in an `and`, a True in an `or`, decides it
                return value, node
        if not left:
            return is_and, node
        return _UNKNOWN, left[0] if len(left) == 1 else ast.BoolOp(node.op, left)
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if names and names <= set(flags):  # a comparison of flags only: WINDOW_LEFT >= 0 and the like
        return bool(eval(compile(ast.Expression(node), "<flags>", "eval"), {}, dict(flags))), node
    return _UNKNOWN, node


def pruned_source(obj, only):
    """The source of ``obj`` (a function or a ``@triton.jit`` kernel) with every ``if`` that the
    values of ``only`` (flag name -> value) decide replaced by the branch it takes.

    Returns ``(text, first_line, hidden, flags)``: the pruned source, the line the function starts
    at in its file, how many lines were removed, and the flags of ``only`` the function uses (a
    preset such as ``flashattn.course.notebook.LATER`` may name flags a kernel lacks; a typo that
    leaves none is refused).
    """
    fn = getattr(obj, "fn", obj)
    lines, first = inspect.getsourcelines(fn)
    lines = textwrap.dedent("".join(lines)).splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    if not set(only) & used:  # a preset may name flags a kernel lacks, but not only such flags
        raise ValueError(f"only= names flags {sorted(only)}, none of which {fn.__name__} uses")
    only = {name: value for name, value in only.items() if name in used}
    deleted, dedent, header = set(), [0] * (len(lines) + 2), {}

    def drop(start, end):  # 1-based, inclusive
        deleted.update(range(start, end + 1))

    def shift(start, end, by):
        for line in range(start, end + 1):
            dedent[line] += by

    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or node.lineno in deleted:
            continue
        value, test = _simplify(node.test, only)
        if value is _UNKNOWN:
            if test is not node.test and node.test.lineno == node.test.end_lineno:
                # the line as an earlier rewrite left it (an `elif` made an `if`, 2 characters shorter)
                line = header.get(node.lineno, lines[node.lineno - 1])
                moved = len(line) - len(lines[node.lineno - 1])
                start, end = node.test.col_offset + moved, node.test.end_col_offset + moved
                header[node.lineno] = line[:start] + ast.unparse(test) + line[end:]
            continue
        body_end = node.body[-1].end_lineno
        if value:
            drop(node.lineno, node.test.end_lineno)
            shift(node.test.end_lineno + 1, body_end, node.body[0].col_offset - node.col_offset)
            drop(body_end + 1, node.end_lineno)  # the else branch
        elif node.orelse:
            elif_ = isinstance(node.orelse[0], ast.If) and lines[node.orelse[0].lineno - 1].lstrip().startswith("elif")
            if elif_:  # `elif c:` becomes `if c:` at the if's place
                drop(node.lineno, node.orelse[0].lineno - 1)
                line = lines[node.orelse[0].lineno - 1]
                header[node.orelse[0].lineno] = line.replace("elif", "if", 1)
            else:  # keep the comments between `else:` and the branch's first statement
                else_line = next(n for n in range(body_end + 1, node.orelse[0].lineno + 1)
                                 if lines[n - 1].strip().startswith("else"))
                drop(node.lineno, else_line)
                shift(else_line + 1, node.end_lineno, node.orelse[0].col_offset - node.col_offset)
        else:
            drop(node.lineno, node.end_lineno)
    out = []
    for number, line in enumerate(lines, start=1):
        if number in deleted:
            continue
        line = header.get(number, line)
        cut = min(dedent[number], len(line) - len(line.lstrip(" ")))
        out.append(line[cut:])
    return "".join(out), first, len(deleted), only
