"""The YAML loader: every rule, every position, every problem at once, no secrets echoed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from llmdeploy.spec.loader import SpecFileError, SpecIssue, load_spec_file, load_spec_text
from llmdeploy.spec.reference import field_rows
from tests.helpers.safetensors_files import write_safetensors

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "llmdeploy.yaml.example"
HASH = "sha256:" + "ab" * 32


def load(text: str, env: dict | None = None, base_dir: Path | None = None):
    return load_spec_text(textwrap.dedent(text), "t.yaml", base_dir=base_dir, env=env or {})


def only_error(text: str, env: dict | None = None) -> SpecIssue:
    r = load(text, env)
    assert r.spec is None
    assert len(r.errors) == 1, [e.format() for e in r.errors]
    return r.errors[0]


def test_example_is_valid_and_quiet_when_its_key_is_set():
    r = load_spec_file(EXAMPLE, env={"LLMDEPLOY_API_KEY": "k" * 32})
    assert r.errors == [] and r.warnings == []
    s = r.spec
    assert s.model.path == "builtin:smollm2-135m-instruct" and s.model.served_alias == "chat-model-v1"
    assert (
        s.listen == "127.0.0.1:8000"
        and s.auth.api_key_required
        and s.auth.keys[0].key_env == "LLMDEPLOY_API_KEY"
    )
    assert not s.cloud.enabled
    assert (s.cloud.provider, s.cloud.base_url, s.cloud.api_key_env, s.cloud.model) == (
        "qianfan",
        "https://qianfan.baidubce.com/v2",
        "QIANFAN_API_KEY",
        "ernie-4.5-turbo-128k",
    )


def test_example_warns_that_apply_generates_the_missing_key():
    r = load_spec_file(EXAMPLE, env={})
    assert r.errors == []
    (w,) = r.warnings
    assert w.path == "auth.keys[0].key_env" and "LLMDEPLOY_API_KEY" in w.message and "sha256" in w.message
    assert EXAMPLE.read_text().splitlines()[w.line - 1].strip().startswith("key_env:")


def test_example_sets_and_comments_every_key():
    data = yaml.safe_load(EXAMPLE.read_text())

    def present(path: str) -> bool:
        node = data
        for part in path.replace("[]", ".0").split("."):
            if isinstance(node, list):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return False
        return True

    # key and key_env exclude each other, and so do a replica count and a range: the example shows the second
    # of each as a comment
    ranged = "parallel.replicas."
    missing = [
        k for k, *_ in field_rows() if not present(k) and k != "auth.keys[].key" and not k.startswith(ranged)
    ]
    assert missing == []
    assert "# key: sha256:" in EXAMPLE.read_text()
    assert "# replicas: {min: 1, max: 4, scale_up_after_s: 30, cool_down_s: 300}" in EXAMPLE.read_text()
    for n, line in enumerate(EXAMPLE.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.strip() and ":" in code:
            assert "#" in line, f"line {n} has no comment: {line}"


@pytest.mark.parametrize(
    "text, path, fragment",
    [
        (
            "listen: 0.0.0.0:8000\nauth: {api_key_required: false}\n",
            "listen",
            "reachable from other machines",
        ),
        (
            "listen: 10.1.2.3:80\nauth:\n  api_key_required: false\n",
            "listen",
            "anyone there could use the model",
        ),
        ("model: {served_alias: ''}\n", "model.served_alias", "must not be empty"),
        ("model: {served_alias: 'chat model/v1'}\n", "model.served_alias", "URL-safe"),
        (
            "engine: {block_size: 32, max_num_batched_tokens: 16}\n",
            "engine.max_num_batched_tokens",
            ">= block_size (32)",
        ),
        ("sla: {ttft_p99_ms: 0}\n", "sla.ttft_p99_ms", "greater than 0"),
        ("sla: {tpot_p99_ms: -5}\n", "sla.tpot_p99_ms", "greater than 0"),
        ("sla: {tpot_p99_ms: .inf}\n", "sla.tpot_p99_ms", "finite number"),
        ("cloud: {enabled: true}\n", "cloud.enabled", "requires base_url and api_key_env"),
        ("cloud: {enabled: true, base_url: 'https://x.test/v1'}\n", "cloud.enabled", "requires api_key_env"),
        ("cloud: {enabled: true, api_key_env: K}\n", "cloud.enabled", "requires base_url"),
        ("cloud: {base_url: 'ftp://x'}\n", "cloud.base_url", "http:// or https://"),
        ("cloud: {api_key_env: 'sk-123'}\n", "cloud.api_key_env", "never goes in the YAML"),
        ("rollout: {canary_percent: 101}\n", "rollout.canary_percent", "less than or equal to 100"),
        ("rollout: {canary_percent: -1}\n", "rollout.canary_percent", "greater than or equal to 0"),
        ("parallel: {replicas: 0}\n", "parallel.replicas", "greater than or equal to 1"),
        ("parallel:\n  replicas: {min: 3, max: 2}\n", "parallel.replicas.min", "min (3) must be <= max (2)"),
        ("parallel:\n  replicas: {min: 2}\n", "parallel.replicas.max", "required key 'max' is missing"),
        ("parallel:\n  replicas: {max: 2, min: 0}\n", "parallel.replicas.min", "greater than or equal to 1"),
        (
            "parallel:\n  replicas: {max: 2, cool_down_s: 0}\n",
            "parallel.replicas.cool_down_s",
            "greater than 0",
        ),
        (
            "parallel:\n  replicas: {max: 2, scale_up_after: 5}\n",
            "parallel.replicas.scale_up_after",
            "did you mean 'scale_up_after_s'?",
        ),
        ("parallel: {replicas: many}\n", "parallel.replicas", "must be an integer or a mapping {min, max,"),
        ("auth:\n  keys:\n    - {name: app, key: abc123}\n", "auth.keys[0].key", "must be hashed as sha256:"),
        (
            "auth:\n  keys:\n    - {name: app, key_env: K, key: '" + HASH + "'}\n",
            "auth.keys[0].key",
            "exactly one of",
        ),
        ("auth:\n  keys:\n    - {name: app}\n", "auth.keys[0]", "exactly one of key_env or key"),
        ("auth:\n  keys:\n    - {key_env: K}\n", "auth.keys[0].name", "required key 'name' is missing"),
        ("auth:\n  keys: [{name: a, key_env: K}, {name: a, key_env: J}]\n", "auth.keys", "must be unique: a"),
        ("tls: {cert_file: /etc/c.pem}\n", "tls.cert_file", "must be given together"),
        ("name: 'Chat Service'\n", "name", "a-z, 0-9"),
        ("listen: localhost\n", "listen", "must be host:port"),
        ("engine: {block_size: 24}\n", "engine.block_size", "power of two"),
        ("model: {dtype: bf16}\n", "model.dtype", "did you mean 'bfloat16'?"),
        ("model: {max_model_len: lots}\n", "model.max_model_len", "valid integer"),
        ("model: builtin:smollm2-135m-instruct\n", "model", "must be a mapping"),
    ],
)
def test_each_rule_rejects_its_bad_case(text, path, fragment):
    e = only_error(text)
    assert e.path == path and fragment in e.message, e.format()
    assert e.file == "t.yaml" and e.line >= 1 and e.col >= 1


def test_exposed_listen_is_fine_with_auth_and_warns_without_tls():
    r = load("listen: 0.0.0.0:8000\nauth:\n  keys: [{name: app, key_env: K}]\n", env={"K": "x" * 20})
    assert r.errors == [] and r.spec.listen_host == "0.0.0.0"
    (w,) = r.warnings
    assert (w.path, w.line, w.col) == ("listen", 1, 1) and "tls.cert_file" in w.message


def test_hashed_inline_key_is_accepted():
    r = load(f"auth:\n  keys:\n    - {{name: app, key: '{HASH}'}}\n")
    assert r.errors == [] and r.spec.auth.keys[0].key == HASH and r.warnings == []


def test_inline_secret_is_never_echoed():
    r = load("auth:\n  keys:\n    - name: app\n      key: sk-live-SUPERSECRET\n")
    assert r.errors and not any("SUPERSECRET" in e.format() for e in r.errors)
    e = only_error("auth:\n  keys:\n    - name: app\n      key: !!int sk-live-SUPERSECRET\n")
    assert e.message == "cannot read this value as int"
    r = load("auth:\n  keys:\n    - {name: app, key: '${MY_KEY}'}\n", env={"MY_KEY": "sk-live-SUPERSECRET"})
    assert r.errors and not any("SUPERSECRET" in e.format() for e in r.errors)


def test_misspelled_keys_point_at_their_line_and_suggest():
    r = load(
        """\
        name: chat
        modle:
          path: builtin:smollm2-135m-instruct
        engine:
          block_size: 16
          max_num_batched_tokns: 4096
        """
    )
    assert [(e.line, e.col, e.path, e.message) for e in r.errors] == [
        (2, 1, "modle", "unknown key 'modle'; did you mean 'model'?"),
        (
            6,
            3,
            "engine.max_num_batched_tokns",
            "unknown key 'max_num_batched_tokns'; did you mean 'max_num_batched_tokens'?",
        ),
    ]
    assert r.errors[1].format() == (
        "t.yaml:6:3: engine.max_num_batched_tokns: unknown key 'max_num_batched_tokns'; "
        "did you mean 'max_num_batched_tokens'?"
    )


def test_unknown_key_without_a_near_miss_lists_the_known_ones():
    e = only_error("sla: {zzz: 1}\n")
    assert e.message == "unknown key 'zzz'; known keys: tpot_p99_ms, ttft_p99_ms"


def test_unknown_key_inside_a_list_item():
    e = only_error("auth:\n  keys:\n    - name: a\n      key_env: K\n      rmp: 5\n")
    assert (e.path, e.line, e.col) == ("auth.keys[0].rmp", 5, 7) and "did you mean 'rpm'?" in e.message


def test_every_problem_is_reported_at_once():
    r = load(
        """\
        listen: 0.0.0.0:9000
        auth:
          api_key_required: false
        model:
          served_alias: ""
        engine:
          blok_size: 8
        sla:
          ttft_p99_ms: 0
        parallel:
          replicas: 0
        cloud:
          enabled: true
        rollout:
          canary_percent: 150
        """
    )
    assert [(e.line, e.path) for e in r.errors] == [
        (1, "listen"),  # a root rule pydantic only checks once everything else is valid
        (5, "model.served_alias"),
        (7, "engine.blok_size"),
        (9, "sla.ttft_p99_ms"),
        (11, "parallel.replicas"),
        (13, "cloud.enabled"),
        (15, "rollout.canary_percent"),
    ]


def test_errors_in_several_list_items_are_all_reported():
    r = load(
        "auth:\n  keys:\n    - {name: a, key: plain}\n    - {key_env: K}\n    - {name: c, key_env: J, rpm: 0}\n"
    )
    assert [(e.line, e.path) for e in r.errors] == [
        (3, "auth.keys[0].key"),
        (4, "auth.keys[1].name"),
        (5, "auth.keys[2].rpm"),
    ]


def test_rules_fed_by_a_reported_value_stay_quiet():
    # base_url is wrong already: "enabled requires base_url" would only repeat it
    r = load("cloud:\n  enabled: true\n  base_url: ${NO_SUCH_URL}\n  api_key_env: K\n")
    assert [e.path for e in r.errors] == ["cloud.base_url"]
    r = load("engine:\n  block_size: 24\n  max_num_batched_tokens: 8\n")
    assert [e.path for e in r.errors] == ["engine.block_size"]


def test_unset_variable_is_named_with_its_line():
    r = load("name: chat\nmodel:\n  served_alias: ${ALIAS_NAME}\ncloud:\n  model: ${CLOUD_MODEL}\n")
    assert [e.format() for e in r.errors] == [
        "t.yaml:3:17: model.served_alias: environment variable ALIAS_NAME is not set (set it, or write ${ALIAS_NAME:-default})",
        "t.yaml:5:10: cloud.model: environment variable CLOUD_MODEL is not set (set it, or write ${CLOUD_MODEL:-default})",
    ]


def test_variables_expand_with_defaults_and_types():
    text = """\
    name: ${NAME:-chat}
    model:
      served_alias: "${ALIAS}-v${VERSION}"
      max_model_len: ${LEN}
    parallel:
      replicas: ${REPLICAS:-2}
    engine:
      prefix_caching: ${PREFIX:-false}
    cloud:
      model: '$${literal}'
    """
    r = load(text, env={"ALIAS": "chat", "VERSION": "2", "LEN": "4096", "PREFIX": ""})
    assert r.errors == [], [e.format() for e in r.errors]
    s = r.spec
    assert (s.name, s.model.served_alias, s.model.max_model_len) == ("chat", "chat-v2", 4096)
    assert s.parallel.replicas == 2 and s.engine.prefix_caching is False  # empty + :- takes the default
    assert s.cloud.model == "${literal}"


def test_quoted_variable_stays_text_and_plain_one_is_read_as_written():
    r = load('model:\n  served_alias: "${V}"\n', env={"V": "123"})
    assert r.errors == [] and r.spec.model.served_alias == "123"
    e = only_error("model:\n  served_alias: ${V}\n", env={"V": "123"})  # as if `served_alias: 123`
    assert e.path == "model.served_alias" and "valid string" in e.message


def test_malformed_variable_reference():
    e = only_error("model:\n  served_alias: ${bad-name}\n")
    assert (e.path, e.line) == ("model.served_alias", 2) and "malformed variable reference" in e.message


@pytest.mark.parametrize(
    "text, line, col, fragment",
    [
        ("name: chat\nmodel:\n  path: [a, b\nlisten: x\n", 4, 7, "expected ',' or ']'"),
        ("name: chat\nmodel:\n\tpath: x\n", 3, 1, "found character '\\t'"),
        ("name: chat\n  listen: 127.0.0.1:8000\n", 2, 9, "mapping values are not allowed here"),
        ("name: 'chat\n", 2, 1, "found unexpected end of stream"),
        ("name: chat\n---\nname: other\n", 2, 1, "expected a single document"),
    ],
)
def test_yaml_syntax_errors_carry_line_and_column(text, line, col, fragment):
    e = only_error(text)
    assert (
        (e.line, e.col, e.path) == (line, col, "")
        and e.message.startswith("YAML syntax error")
        and fragment in e.message
    )


def test_duplicate_keys_are_errors():
    r = load("name: a\nengine:\n  block_size: 16\n  block_size: 32\nname: b\n")
    assert [(e.line, e.col, e.path) for e in r.errors] == [(4, 3, "engine.block_size"), (5, 1, "name")]
    assert r.errors[0].message == "duplicate key 'block_size' (first at line 3, column 3)"


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(SpecFileError, match="nope.yaml: no such file"):
        load_spec_file(tmp_path / "nope.yaml")
    with pytest.raises(SpecFileError, match="is a directory"):
        load_spec_file(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(SpecFileError, match="not UTF-8"):
        load_spec_file(tmp_path / "bin.yaml")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("- name: chat\n", "must be a mapping of settings"),
        ("name: !!python/object:os.system {}\n", "not supported"),
        ("name: !!python/name:os.system ''\n", "could not determine a constructor"),
        ("1: chat\n", "must be text"),
        ("a: &a [*a]\n", "recursive alias"),
    ],
)
def test_odd_documents_get_a_clear_error(text, fragment):
    r = load(text)
    assert r.spec is None and r.errors and fragment in r.errors[0].message, [e.format() for e in r.errors]


def test_alias_bomb_ends_with_an_error():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    r = load("\n".join(lines) + "\n")
    assert r.spec is None and "after expanding aliases" in r.errors[0].message


def test_merge_keys_and_anchors_work():
    r = load("x-defaults: &d {ttft_p99_ms: 500}\nsla:\n  <<: *d\n  tpot_p99_ms: 50\n")
    assert [e.path for e in r.errors] == ["x-defaults"]  # unknown top-level key, but the merge itself is read
    r = load("sla: &s {ttft_p99_ms: 500}\nrollout:\n  auto_rollback: {max_ttft_p99_ms: 900}\n")
    assert r.errors == [] and r.spec.sla.ttft_p99_ms == 500


def make_hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    write_safetensors(path / "model.safetensors", {})
    return path


def test_relative_model_path_is_resolved_against_the_yaml_folder(tmp_path, monkeypatch):
    make_hf_folder(tmp_path / "models" / "tiny")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "d.yaml").write_text("model:\n  path: ../models/tiny\n")
    monkeypatch.chdir(REPO)  # not the YAML's folder
    r = load_spec_file(tmp_path / "cfg" / "d.yaml", env={})
    assert r.errors == []
    assert r.spec.model.path == str((tmp_path / "models" / "tiny").resolve())


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("./no/such/folder", "does not exist"),
        ("builtin:gpt-17", "unknown builtin model builtin:gpt-17"),
        ("weights.bin", "is not a .gguf file"),
    ],
)
def test_unusable_model_paths_are_errors_at_model_path(tmp_path, path, fragment):
    (tmp_path / "weights.bin").write_bytes(b"x")
    r = load(f"name: chat\nmodel:\n  path: {path}\n", base_dir=tmp_path)
    (e,) = r.errors
    assert (e.path, e.line, e.col) == ("model.path", 3, 3) and fragment in e.message


def test_tls_files_are_checked_and_made_absolute(tmp_path):
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    r = load("tls: {cert_file: c.pem, key_file: k.pem}\n", base_dir=tmp_path)
    assert r.errors == [] and r.spec.tls.cert_file == str(tmp_path / "c.pem")
    r = load("tls:\n  cert_file: c.pem\n  key_file: gone.pem\n", base_dir=tmp_path)
    assert [(e.path, e.line) for e in r.errors] == [("tls.key_file", 3)]


def test_warnings_name_variables_never_values():
    text = """\
    listen: 0.0.0.0:8443
    auth:
      keys:
        - {name: a, key_env: KEY_A}
        - {name: b, key_env: KEY_B}
    cloud:
      enabled: true
      base_url: https://qianfan.baidubce.com/v2
      api_key_env: QIANFAN_KEY_FOR_TEST
    """
    r = load(text, env={"KEY_A": "value-of-key-a-123"})
    assert r.errors == []
    got = {w.path: w.message for w in r.warnings}
    assert set(got) == {"listen", "auth.keys[1].key_env", "cloud.api_key_env"}
    assert "KEY_B" in got["auth.keys[1].key_env"] and "generate a key" in got["auth.keys[1].key_env"]
    assert "QIANFAN_KEY_FOR_TEST is not set" in got["cloud.api_key_env"]
    assert not any("value-of-key-a-123" in w.format() for w in r.warnings)


def test_auth_without_keys_warns_at_api_key_required():
    r = load("auth:\n  api_key_required: true\n")
    (w,) = r.warnings
    assert (w.path, w.line) == ("auth.api_key_required", 2) and "no keys are configured" in w.message
    assert load("auth:\n  api_key_required: false\n").warnings == []


def test_warnings_are_kept_alongside_errors():
    r = load(
        "listen: 0.0.0.0:80\nauth:\n  keys: [{name: a, key_env: UNSET_KEY_X}]\nparallel: {replicas: 0}\n"
    )
    assert [e.path for e in r.errors] == ["parallel.replicas"]
    assert {w.path for w in r.warnings} == {"listen", "auth.keys[0].key_env"}


def test_issue_format():
    i = SpecIssue("a.yaml", 3, 5, "engine.block_size", "must be a power of two")
    assert i.format() == "a.yaml:3:5: engine.block_size: must be a power of two"
    assert i.format("warning") == "a.yaml:3:5: warning: engine.block_size: must be a power of two"
    assert SpecIssue("a.yaml", 1, 1, "", "the file is empty").format() == "a.yaml:1:1: the file is empty"


def test_values_this_release_cannot_run_are_warned_at_their_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # backend ray without Ray installed
    text = "name: r\nparallel:\n  backend: ray\n  ray_address: ray://h:1\n"
    result = load_spec_text(text, "r.yaml", env={})
    assert result.spec is not None and not result.errors
    (warning,) = [w for w in result.warnings if w.path == "parallel.backend"]
    assert (warning.line, warning.col) == (3, 3) and "apply refuses it" in warning.message


def test_replicas_take_a_range_and_a_count_stays_the_plain_integer_it_was():
    text = "parallel:\n  replicas:\n    min: 1\n    max: 4\n    cool_down_s: 5\n"
    ranged = load(text).spec
    assert ranged is not None and str(ranged.parallel.replicas) == "1-4 (autoscaled)"
    assert (ranged.parallel.initial_replicas, ranged.parallel.max_replicas) == (1, 4)
    assert ranged.parallel.autoscale.scale_up_after_s == 30.0 and ranged.parallel.autoscale.cool_down_s == 5.0
    fixed = load("parallel: {replicas: 3}\n").spec
    assert fixed.parallel.autoscale is None and (
        fixed.parallel.initial_replicas,
        fixed.parallel.max_replicas,
    ) == (3, 3)
    assert fixed.model_dump(mode="json")["parallel"]["replicas"] == 3  # revision hashes of old specs hold


def test_range_errors_point_at_their_line():
    e = only_error("name: x\nparallel:\n  replicas:\n    min: 5\n    max: 2\n")
    assert (e.path, e.line, e.col) == ("parallel.replicas.min", 4, 5)
