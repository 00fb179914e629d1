"""Chat templates: every filter and operator is held to the render's budget.

The review found single filters that escaped the 2 s / 2^24-character budget: ``sort`` took
52.9 s and 2.8 GB, ``wordwrap`` over 200 s, and ``~`` made a 536,870,912-character value.
Each template here is refused within the budget; the ``sort`` and ``wordwrap`` bombs are also
measured in a fresh interpreter, for time and memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from stagerun.model._chat import ChatTemplateError, render_chat

BIG = "{% set big = 'ab' * 2**23 %}"  # 2^24 characters: one value at the limit, allowed

BOMBS = {
    "sort": "{{ ('ba' * 2**23) | sort | join | length }}",
    "sort case-sensitive": "{{ ('ba' * 2**23) | sort(case_sensitive=true) | length }}",
    "wordwrap one long word": "{{ ('a' * 2**22) | wordwrap(1) | length }}",
    "wordwrap many words": "{{ ('a ' * 2**23) | wordwrap(3) | length }}",
    "~ to 2^29 characters": BIG + "{{ (big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big"
    " ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big ~ big"
    " ~ big ~ big ~ big ~ big ~ big ~ big ~ big) | length }}",
    "a list of one big string, printed": BIG + "{% set l = [big] * 1000 %}{{ l }}",
    "a list of one big string, tojson": BIG + "{{ ([big] * 1000) | tojson | length }}",
    "a list of one big string, string": BIG + "{{ ([big] * 1000) | string | length }}",
    "a list of one big string, pprint": BIG + "{{ ([big] * 1000) | pprint | length }}",
    "%s many times": BIG + "{{ ('%s' * 32) % (" + ", ".join(["big"] * 32) + ") }}",
    "%(a)s many times": BIG + "{{ ('%(a)s' * 1000) % {'a': big} }}",
    "{0} many times": BIG + "{{ ('{0}' * 1000).format(big) | length }}",
    "format filter": BIG + "{{ ('%s' * 1000) | format(*([big] * 1000)) | length }}",
    "a long list": "{{ ([1] * 2**24) | length }}",
    "list of a long string": "{{ ('ab' * 2**23) | list | length }}",
    "unique": "{{ ('ab' * 2**23) | unique | list | length }}",
    "batch with a fill": "{{ [1] | batch(2**24, 'x') | list | length }}",
    "slice into many": "{{ [1] | slice(2**24, 'x') | list | length }}",
    "sum of lists": "{{ ([[1]] * 200000) | sum(start=[]) | length }}",
    "join of a long string": "{{ ('ab' * 2**23) | join(',') | length }}",
    "striptags": "{{ ('<>' * 2**23) | striptags | length }}",
    "title": "{{ ('a ' * 2**23) | title | length }}",
    "urlencode": "{{ ('a ' * 2**23) | urlencode | length }}",
    "wordcount": "{{ ('ab ' * 5000000) | wordcount }}",
    "tojson indent": "{{ ([[[[1]]]] * 1000) | tojson(indent=2**24) | length }}",
    "expandtabs": "{{ ('\\t' * 2**20).expandtabs(2**24) | length }}",
    "groupby": "{{ ((range(100000) | list) * 10) | groupby('real') | length }}",
    "wordwrap quadratic": "{{ ('a' * 2**18) | wordwrap(1) | length }}",
    "a macro writing a big value": BIG + "{% macro f() %}{% for i in range(100000) %}{{ big }}"
    "{% endfor %}{% endmacro %}{{ f() | length }}",
    "a block writing text": "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "0123456789abcdef{% endfor %}{% endfor %}{% endset %}{{ x | length }}",
    "lipsum": "{{ lipsum(2**24) | length }}",
    "min of a long string": "{{ ('ab' * 2**23) | min }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_filter_bomb_is_refused_within_the_budget(name: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError):
        render_chat(
            BOMBS[name], [{"role": "user", "content": "hi"}], bos_token="", eos_token="", timeout=1
        )
    assert time.perf_counter() - started < 1.5, name


# Renders one template in a fresh interpreter; reports its time and the growth of peak RSS.
_MEASURE = """
import json, sys, time
from stagerun.model._chat import ChatTemplateError, render_chat
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
start = time.perf_counter()
try:
    render_chat(sys.argv[1], [{"role": "user", "content": "hi"}], bos_token="", eos_token="")
    error = None
except ChatTemplateError as exc:
    error = str(exc)
print(json.dumps({"seconds": time.perf_counter() - start, "error": error,
                  "rss_growth_mib": status("VmHWM:") - before}))
"""


@pytest.mark.parametrize("name", ["sort", "wordwrap one long word", "wordwrap many words"])
def test_sort_and_wordwrap_bombs_stop_within_the_budget_and_100_mb(name: str) -> None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, BOMBS[name]],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {name} bomb ran for more than 20 s")
    figures = json.loads(out.stdout.splitlines()[-1])
    print(name, figures)
    assert figures["error"] is not None
    assert figures["seconds"] < 2.0  # the default budget (RENDER_TIMEOUT)
    assert figures["rss_growth_mib"] < 100


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ 'a' | center(9) }}", "    a    "),
        ("{{ ['b', 'A', 'c'] | sort | join(',') }}", "A,b,c"),
        ("{{ 'a b c' | wordwrap(3) }}", "a b\nc"),
        ("{{ 'x' ~ 1 ~ [2] }}", "x1[2]"),
        ("{{ '%s-%d' % ('a', 3) }}", "a-3"),
        ("{{ '{0}{1}'.format('a', 'b') }}", "ab"),
        ("{{ [1, 2, 3] | batch(2, 0) | list }}", "[[1, 2], [3, 0]]"),
        ("{{ [3, 1, 2] | unique | sort | list }}", "[1, 2, 3]"),
        ("{{ {'b': 1, 'a': 2} | dictsort }}", "[('a', 2), ('b', 1)]"),
        ("{{ [[1], [2]] | sum(start=[]) }}", "[1, 2]"),
        ("{{ {'a': [1, 2]} | tojson(indent=2) }}", '{\n  "a": [\n    1,\n    2\n  ]\n}'),
    ],
)
def test_ordinary_uses_of_the_bounded_filters_render_as_before(
    template: str, expected: str
) -> None:
    assert render_chat(template, [], bos_token="", eos_token="") == expected


def test_a_large_chat_still_renders_with_tojson_and_concatenation() -> None:
    """A chat near the request size (4 MiB) goes through ``~``, ``tojson`` and ``join``."""
    content = "word " * 800_000
    template = (
        "{% for m in messages %}{{ '<|' ~ m.role ~ '|>' ~ m.content ~ '\\n' }}{% endfor %}"
        "{{ messages | map(attribute='role') | join(',') }}{{ messages | tojson | length }}"
    )
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
    text = render_chat(template, messages, bos_token="", eos_token="")
    assert text.startswith("<|user|>word ") and text.endswith("user,assistant4000073")
