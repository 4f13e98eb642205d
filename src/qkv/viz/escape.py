"""How a string reaches HTML in qkv: escaped once, for the place it goes.

A token is data from a tokenizer, and a tokenizer's vocabulary may hold anything: SmolLM2's
own holds `">` and `="`, and a crafted one `x"onmouseover="...`. Every page and notebook view
of qkv writes such strings through one of these three functions, one per place in a page:

- `text`: between tags (`<td>...</td>`, `<title>...</title>`);
- `attribute`: inside a double-quoted attribute value (`title="..."`, `srcdoc="..."`);
- `script_json`: JSON text inside `<script type="application/json">`.

Markup qkv writes itself (tags, numbers, its own words) is not escaped, and what was escaped
is never escaped again: an entity such as `&rarr;` put in a string that is then escaped shows
as the six characters "&rarr;". Write the character itself ("→"); `qkv.viz.notebook` turns
every character beyond ASCII into a character reference at the very end.

The pages' scripts keep to the same rule in the browser: a token's text enters the page with
`textContent` or `setAttribute`, never inside markup given to `innerHTML`.

>>> text('"><img src=x onerror=alert(1)>')
'"&gt;&lt;img src=x onerror=alert(1)&gt;'
>>> attribute('x"onmouseover="alert(1)')
'x&quot;onmouseover=&quot;alert(1)'
>>> script_json('{"token": "</script><!--\\u2028"}')
'{"token": "\\\\u003c/script\\\\u003e\\\\u003c!--\\\\u2028"}'
"""

from __future__ import annotations

import html


def text(value) -> str:
    """`value` as text between tags: &, < and > as character references."""
    return html.escape(str(value), quote=False)


def attribute(value) -> str:
    """`value` inside a double-quoted attribute value: &, <, >, " and ' as references."""
    return html.escape(str(value), quote=True)


def script_json(json_text: str) -> str:
    """JSON text safe inside a <script> element: "<", ">" and "&" as \\u escapes, so that no
    "</script>" or "<!--" can end or change the element, and the line and paragraph
    separators (U+2028, U+2029) as \\u escapes too, as JavaScript before ES2019 read them as
    line ends. JSON.parse reads the same values back."""
    for character, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                               ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        json_text = json_text.replace(character, escaped)
    return json_text
