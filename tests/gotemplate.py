"""A renderer for the small subset of Go's text/template that finetune's Ollama TEMPLATEs use, written from the
Go documentation's semantics, so tests can check a TEMPLATE renders what the Jinja chat template renders:
literal text, `{{ range .Messages }}...{{ end }}`, `{{ if eq .Role "x" }}...{{ else if ... }}...{{ else }}...
{{ end }}`, `{{ .Content }}` and `{{ .Role }}`. Anything else is an error, never silently skipped."""
import re

ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)


def _tokens(text):
    pos = 0
    for m in ACTION.finditer(text):
        yield "text", text[pos:m.start()]
        if m[1] or m[3]:
            raise ValueError(f"trim markers are not in this subset: {m[0]!r}")
        yield "action", m[2]
        pos = m.end()
    yield "text", text[pos:]


def _parse(tokens, stop=("end",)):
    """Nodes until an action in `stop`; returns (nodes, the action that stopped it)."""
    nodes = []
    for kind, value in tokens:
        if kind == "text":
            nodes.append(("text", value))
        elif value in stop or (value.startswith("else") and "else" in stop):
            return nodes, value
        elif value == "range .Messages":
            body, _ = _parse(tokens)
            nodes.append(("range", body))
        elif value.startswith("if "):
            nodes.append(_if(value[3:], tokens))
        elif value in (".Content", ".Role"):
            nodes.append(("field", value[1:].lower()))
        else:
            raise ValueError(f"not in this subset: {{{{ {value} }}}}")
    return nodes, None


def _if(cond, tokens):
    branches = []
    while True:
        body, ended = _parse(tokens, ("end", "else"))
        branches.append((cond, body))
        if ended == "end":
            return ("if", branches)
        cond = ended[len("else if "):] if ended.startswith("else if ") else "true"


def _true(cond, msg):
    if cond == "true":
        return True
    m = re.fullmatch(r'eq \.Role "([^"]*)"', cond)
    if not m:
        raise ValueError(f"condition not in this subset: {cond!r}")
    return msg["role"] == m[1]


def _render(nodes, messages, msg=None):
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            out.append(msg[node[1]])
        elif node[0] == "range":
            out += [_render(node[1], messages, m) for m in messages]
        else:
            out += [_render(body, messages, msg) for cond, body in node[1][:] if _true(cond, msg)][:1]
    return "".join(out)


def render(template: str, messages: list[dict]) -> str:
    nodes, ended = _parse(iter(list(_tokens(template))))
    if ended is not None:
        raise ValueError(f"unbalanced {{{{ {ended} }}}}")
    return _render(nodes, messages)
