"""The teaching view's text (see :mod:`flashattn.course.teaching_view`): the source lines of what
the view keeps, each statement with its own changes written in (an expression replaced, arguments
removed, a comment's sentences that name something removed left out), moved to its new depth.

Everything is taken from the source text, not printed from the syntax tree, so that the comments
and the layout stay as written; only a paragraph of prose that lost a sentence is wrapped again.
"""
import ast
import io
import re
import textwrap
import tokenize

BODIES = ("body", "orelse", "finalbody")  # the fields that hold statements


def span(node):
    """(first line, first column, last line, end column) of ``node`` in the source, or of the node
    it replaced."""
    return getattr(node, "_span", None) or (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def could_be_word(name):
    """Whether an identifier could be an English word (``Programs``, ``shift``): prose names it as
    code only in double backquotes."""
    return re.fullmatch(r"[A-Z]?[a-z]+", name) is not None


def as_code(name):
    """The pattern of prose that names the identifier ``name`` as code: in double backquotes if it
    could be a word, else the name itself, not part of a longer name or an attribute (``x.name``)."""
    return rf"``{re.escape(name)}``" if could_be_word(name) else rf"(?<![\w.]){re.escape(name)}(?!\w)"


class Text:
    """What :class:`flashattn.course.teaching_view._Pruner` writes with: it sets ``lines`` (the
    source's), ``comments`` (line -> (column, text)), ``func`` (the pruned tree), ``gone`` (the
    identifiers removed) and ``words``."""

    def hides(self, sentence):
        """Whether a sentence of prose names something the view removed."""
        return any(re.search(as_code(n), sentence) for n in self.gone) or \
            any(re.search(rf"(?<![\w]){re.escape(w)}", sentence, re.I) for w in self.words)

    def prose(self, lines, prefix):
        """Paragraph ``lines`` (the text after ``prefix``) with the sentences that name removed things
        left out: the lines as they were if none does, else the rest wrapped as wide as they were."""
        text = " ".join(line.strip() for line in lines)
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"'\[])", text)
        sentences = [re.sub(r"\s*\([^()]*\)", lambda m: "" if self.hides(m.group()) else m.group(), s)
                     for s in sentences]  # a parenthesis that names something removed goes first
        kept = [s for s in sentences if not self.hides(s)]
        if " ".join(kept) == text:
            return [(prefix + line).rstrip() for line in lines]
        if not kept:
            return []
        width = max(len(prefix) + len(line.strip()) for line in lines)
        return textwrap.wrap(" ".join(kept), width=max(width, 60), initial_indent=prefix,
                             subsequent_indent=prefix, break_on_hyphens=False)

    def lead(self, node):
        """The blank and comment lines right above ``node`` in the source."""
        found, line = [], node.lineno - 1
        while line >= 1 and (not self.lines[line - 1].strip() or self.lines[line - 1].lstrip().startswith("#")):
            found.append(line)
            line -= 1
        return found[::-1]

    def comment_lines(self, numbers, indent, out, at_start):
        blank = any(not self.lines[n - 1].strip() for n in numbers)
        if blank and not at_start:
            out.append("")
        block = []
        for n in numbers + [None]:
            if n is not None and self.lines[n - 1].strip():
                text = self.lines[n - 1].strip()[1:]
                block.append(text[1:] if text.startswith(" ") else text)  # the text after "# "
                continue
            if block:
                out.extend(self.prose(block, " " * indent + "# "))
                block = []

    def segment(self, node, start_line, end_line, indent):
        """Source lines ``start_line..end_line`` of ``node`` with the node's own changes applied
        (replaced expressions, removed arguments, comments that name removed things), moved to
        ``indent``."""
        lines = self.lines[start_line - 1:end_line]
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line) + 1)
        offset = lambda ln, col: starts[ln - start_line] + col  # noqa: E731
        edits = []
        own = [v for f, v in ast.iter_fields(node) if f not in BODIES]
        stack = [v for value in own for v in (value if isinstance(value, list) else [value]) if isinstance(v, ast.AST)]
        removed_spans = []
        while stack:
            n = stack.pop()
            if hasattr(n, "_span") and n is not node:
                a, b, c, d = n._span
                text = ast.unparse(n)
                edits.append((offset(a, b), offset(c, d), f"({text})" if getattr(n, "_paren", False) else text))
                continue
            elements = getattr(n, "_elements", None)
            if elements:
                removed_spans += self.runs(elements, offset)
            stack.extend(v for v in ast.iter_child_nodes(n))
        edits = [e for e in edits if not any(s <= e[0] and e[1] <= t for s, t in removed_spans)]
        edits += [(s, t, "") for s, t in removed_spans]
        for ln in range(start_line, end_line + 1):
            if ln in self.comments:
                col, text = self.comments[ln]
                if self.hides(text):
                    code = self.lines[ln - 1][:col].rstrip()
                    if code:
                        edits.append((offset(ln, len(code)), offset(ln, len(self.lines[ln - 1])), ""))
        text = "\n".join(lines)
        for s, t, new in sorted(edits, reverse=True):
            text = text[:s] + new + text[t:]
        shift = indent - (len(lines[0]) - len(lines[0].lstrip()))
        out = []
        for line in text.split("\n"):
            if shift < 0:
                line = line[min(-shift, len(line) - len(line.lstrip(" "))):]
            elif line.strip():
                line = " " * shift + line
            out.append(line.rstrip())
        return out

    def runs(self, elements, offset):
        """Character ranges to delete for the removed elements of a comma-separated list. A run of
        removed elements that starts a line goes up to the next element kept, so that the line
        breaks stay where they were; any other run goes from the end of the element kept before it
        (with its comma) to its own end."""
        out, i = [], 0
        while i < len(elements):
            if not elements[i][1]:
                i += 1
                continue
            j = i
            while j + 1 < len(elements) and elements[j + 1][1]:
                j += 1
            first, last = elements[i][0], elements[j][0]
            starts_line = not self.lines[first[0] - 1][:first[1]].strip()
            if j + 1 < len(elements) and (starts_line or i == 0):
                nxt = elements[j + 1][0]
                out.append((offset(first[0], first[1]), offset(nxt[0], nxt[1])))
            elif i > 0:
                prev = elements[i - 1][0]
                out.append((offset(prev[2], prev[3]), offset(last[2], last[3])))
            else:
                out.append((offset(first[0], first[1]), offset(last[2], last[3])))
            i = j + 1
        return out

    def header_end(self, node):
        """The last line of a def's or compound statement's header (the one with its colon)."""
        if isinstance(node, ast.If):
            return span(node.test)[2]
        if isinstance(node, (ast.For, ast.While)):
            return span(node.iter if isinstance(node, ast.For) else node.test)[2]
        depth = 0
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(self.lines[node.lineno - 1:]) + "\n").readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
                return node.lineno + tok.start[0] - 1
        raise ValueError("no header")

    def render(self):
        out = []
        func = self.func
        for deco in func.decorator_list:
            out += self.segment(ast.Expr(deco), deco.lineno, deco.end_lineno, 0)
        out += self.segment(ast.Expr(func.args), func.lineno, self.header_end(func), 0)
        self.emit_block(func.body, func.body[0].col_offset, out)
        text, cleaned = "\n".join(out), []
        for line in text.split("\n"):  # no blank line twice, none right after a header
            if not line.strip() and (not cleaned or not cleaned[-1].strip() or cleaned[-1].rstrip().endswith(":")):
                continue
            cleaned.append(line)
        return "\n".join(cleaned).rstrip() + "\n"

    def emit_block(self, stmts, indent, out):
        for i, stmt in enumerate(stmts):
            self.emit(stmt, indent, out, at_start=i == 0)

    def emit(self, stmt, indent, out, at_start):
        for node in getattr(stmt, "_lead", []) + [stmt]:
            self.comment_lines(self.lead(node), indent, out, at_start and not out[-1:] == [""])
        if stmt is self.func.body[0] and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str):
            out.extend(self.docstring(stmt, indent))
        elif isinstance(stmt, (ast.If, ast.For, ast.While)):
            head = self.segment(stmt, stmt.lineno, self.header_end(stmt), indent)
            if getattr(stmt, "_elif", False):  # an elif whose if was removed
                head[0] = head[0].replace("elif", "if", 1)
            out.extend(head)
            self.emit_block(stmt.body, indent + 4, out)
            self.emit_else(stmt, indent, out)
        else:
            out.extend(self.segment(stmt, stmt.lineno, stmt.end_lineno, indent))

    def emit_else(self, stmt, indent, out):
        if not stmt.orelse:
            return
        if len(stmt.orelse) == 1 and getattr(stmt.orelse[0], "_elif", False):
            inner = stmt.orelse[0]
            out.extend(self.segment(inner, inner.lineno, self.header_end(inner), indent))
            self.emit_block(inner.body, indent + 4, out)
            self.emit_else(inner, indent, out)
            return
        out.append(" " * indent + "else:")
        self.emit_block(stmt.orelse, indent + 4, out)

    def docstring(self, stmt, indent):
        raw = "\n".join(self.lines[stmt.lineno - 1:stmt.end_lineno])
        quote = raw.lstrip()[:3]
        body = raw.strip()[3:-3]
        closing_alone = raw.rstrip().splitlines()[-1].strip() == quote
        pad, was = " " * indent, len(raw) - len(raw.lstrip())
        paragraphs = [[line[min(was, len(line) - len(line.lstrip())):] for line in p.split("\n")]
                      for p in re.split(r"\n\s*\n", body.strip("\n"))]
        kept = [self.prose(p, pad) for p in paragraphs]
        kept = [p for p in kept if p]
        if not kept:
            return []
        lines = []
        for n, p in enumerate(kept):
            if n:
                lines.append("")
            lines.extend(p)
        lines[0] = pad + quote + lines[0].lstrip()
        if closing_alone:
            lines.append(pad + quote)
        else:
            lines[-1] += quote
        return lines
