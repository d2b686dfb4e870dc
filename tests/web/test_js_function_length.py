"""No JS function of the page (web/static/*.js) or the Node runner (web/*.mjs) runs over MAX_LINES lines, as
tests/core/test_function_length.py holds the Python ones: from the line a function starts on (`function name(`, a
method `name(`, an arrow's parameters) to the line of its closing brace. Read with a small tokenizer here (strings,
template literals, comments and regular expressions skipped, brackets matched); nothing is run and no JS parser is
needed (web/node_modules has none, and the tests fetch nothing)."""
from __future__ import annotations

import re
from pathlib import Path

MAX_LINES = 100
WEB = Path(__file__).resolve().parents[2] / "web"

KEYWORDS_BEFORE_PARENS = {"if", "for", "while", "switch", "catch", "with", "return", "typeof", "await", "new", "in", "of",
                          "function", "super", "import", "delete", "void", "yield", "throw", "else", "do", "case"}
# after these words, and after any punctuator but a closing bracket, a `/` starts a regular expression; elsewhere it divides
REGEX_AFTER_WORDS = {"return", "typeof", "case", "do", "else", "in", "of", "new", "delete", "void", "throw", "instanceof",
                     "yield", "await"}
PUNCT = re.compile(r"=>|\.\.\.|\?\?=|\?\?|\?\.|===|!==|\*\*=|<<=|>>>=|>>=|&&=|\|\|=|==|!=|<=|>=|&&|\|\||\+\+|--|[-+*/%&|^]=|<<|>>>|>>|\*\*|[{}()\[\];,.<>+\-*/%&|^!~?:=@#]")
WORD = re.compile(r"[A-Za-z_$\u0080-\uffff][\w$\u0080-\uffff]*|\d[\w.]*")


class ScanError(Exception):
    pass


def _regex_may_follow(tok) -> bool:
    return tok is None or tok in REGEX_AFTER_WORDS or not (WORD.fullmatch(tok) or tok in (")", "]", "}"))


def tokens(src: str) -> list[tuple[str, int]]:
    """(token, line) of the code: identifiers, numbers, punctuators; every string, template text, comment and
    regular expression is left out (a template's ${...} expressions are code)."""
    out: list[tuple[str, int]] = []
    i, line, n = 0, 1, len(src)
    modes: list[int] = []  # per open template expression, the brace depth it opened at
    depth = 0

    def prev():
        return out[-1][0] if out else None

    def skip_template(i: int, line: int) -> tuple[int, int, bool]:
        """From inside a template's text to its end (False) or to a `${` (True)."""
        while i < n:
            c = src[i]
            if c == "\\":
                i += 2
                continue
            if c == "\n":
                line += 1
            if c == "`":
                return i + 1, line, False
            if c == "$" and src.startswith("${", i):
                return i + 2, line, True
            i += 1
        raise ScanError(f"unterminated template literal at line {line}")

    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif c in " \t\r\ufeff":
            i += 1
        elif src.startswith("//", i) or (src.startswith("#!", i) and i == 0):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            if j < 0:
                raise ScanError(f"unterminated comment at line {line}")
            line += src.count("\n", i, j)
            i = j + 2
        elif c in "'\"":
            j = i + 1
            while j < n and src[j] != c:
                if src[j] == "\n":
                    raise ScanError(f"unterminated string at line {line}")
                j += 2 if src[j] == "\\" else 1
            if j >= n:
                raise ScanError(f"unterminated string at line {line}")
            i = j + 1
        elif c == "`":
            i, line, expr = skip_template(i + 1, line)
            if expr:
                modes.append(depth)
                depth += 1
        elif c == "}" and modes and depth - 1 == modes[-1]:  # the end of a template's ${...}
            depth -= 1
            modes.pop()
            i, line, expr = skip_template(i + 1, line)
            if expr:
                modes.append(depth)
                depth += 1
        elif c == "/" and _regex_may_follow(prev()):
            j, klass = i + 1, False
            while j < n and (klass or src[j] != "/"):
                if src[j] == "\n":
                    raise ScanError(f"unterminated regular expression at line {line}")
                klass = (klass or src[j] == "[") and src[j] != "]"
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            while i < n and src[i].isalpha():  # flags
                i += 1
        else:
            m = WORD.match(src, i) or PUNCT.match(src, i)
            if not m:
                raise ScanError(f"unexpected {c!r} at line {line}")
            tok = m.group(0)
            depth += tok in "{([" and len(tok) == 1
            depth -= tok in "})]" and len(tok) == 1
            out.append((tok, line))
            i = m.end()
    if modes:
        raise ScanError("unterminated template expression at the end")
    return out


def _matching(toks: list[tuple[str, int]]) -> dict[int, int]:
    pairs, stack = {}, []
    for k, (t, line) in enumerate(toks):
        if t in ("{", "(", "["):
            stack.append(k)
        elif t in ("}", ")", "]"):
            if not stack or toks[stack[-1]][0] + t not in ("{}", "()", "[]"):
                raise ScanError(f"unbalanced {t!r} at line {line}")
            pairs[stack.pop()] = k
    if stack:
        raise ScanError(f"unclosed {toks[stack[-1]][0]!r} from line {toks[stack[-1]][1]}")
    return pairs


def functions(src: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every function: declarations and expressions, methods (of classes and object
    literals), arrows (a block body, or a parenthesised / bracketed expression)."""
    toks = tokens(src)
    pairs = _matching(toks)
    openers = {c: o for o, c in pairs.items()}
    found = []
    for k, (t, line) in enumerate(toks):
        if t == "(" and k in pairs and pairs[k] + 1 < len(toks) and toks[pairs[k] + 1][0] == "{":
            before = toks[k - 1][0] if k else None
            if before == "function" or (before and WORD.fullmatch(before) and before not in KEYWORDS_BEFORE_PARENS and not before[0].isdigit()):
                name = "<function>" if before == "function" else before
                start = toks[k - 2][1] if before != "function" and k >= 2 and toks[k - 2][0] == "function" else toks[k - 1][1]
                found.append((name, start, toks[pairs[pairs[k] + 1]][1]))
        elif t == "=>" and k + 1 < len(toks) and toks[k + 1][0] in ("{", "(", "["):
            params = toks[k - 1]
            if params[0] == ")":
                start = toks[openers[k - 1]][1]
            else:
                start = params[1]
            found.append(("<arrow>", start, toks[pairs[k + 1]][1]))
    return found


def long_functions(limit: int = MAX_LINES) -> list[str]:
    files = sorted([*WEB.glob("static/*.js"), *WEB.glob("*.mjs")])
    assert len(files) > 10, files  # the page's modules and the Node runner are really read
    over = []
    for path in files:
        for name, start, end in functions(path.read_text(encoding="utf-8")):
            if end - start + 1 > limit:
                over.append(f"{path.relative_to(WEB.parent).as_posix()}:{start}: {name} has {end - start + 1} lines (max {limit}); split it into named steps")
    return over


def test_no_js_function_is_over_the_limit():
    over = long_functions()
    assert not over, "\n".join(over)


def test_the_scanner_sees_every_kind_of_function_and_skips_strings_comments_and_regexes():
    code = "\n".join([
        "// a comment with { and function f() {",
        "export async function outer(a, b = { x: 1 }) {",  # 2
        "  const s = '}' + \"{\" + `${a ? `${b}}` : '{'} }`;",
        "  const r = /[}{]\\/(/g.test(s) ? 1 : 2 / 3;",
        "  /* { block",
        "  comment } */",
        "  const inner = (x) => {",  # 7
        "    return x;",
        "  };",  # 9
        "  const obj = { async open() {", "    return 1;", "  }, close: function () {", "    return 2;", "  } };",  # 10-14
        "  return [1].map((v) => ({", "    v,", "  }));",  # 15-17
        "}",  # 18
        "class Chunk {", "  constructor(n) {", "    this.n = n;", "  }", "  get name() { return this.n; }", "}",  # 19-24
        "const single = v => { return v; };",  # 25
        "if (single(1)) { outer(1); }",  # 26: not a function
    ])
    got = functions(code)
    assert sorted(got) == sorted([("outer", 2, 18), ("<arrow>", 7, 9), ("open", 10, 12), ("<function>", 12, 14),
                                  ("<arrow>", 15, 17), ("constructor", 20, 22), ("name", 23, 23), ("<arrow>", 25, 25)]), got
    assert [t for t, _ in tokens("const a = `x${'}'}y`; // }")] == ["const", "a", "=", ";"]
    for bad in ("function f() {", "const s = 'open", "let t = `a${b"):
        try:
            functions(bad)
        except ScanError:
            continue
        raise AssertionError(f"no ScanError for {bad!r}")
