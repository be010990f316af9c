"""Unit tests of the twin's template step, parameters and tokenizer files (no Triton)."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parent.parent / "demo"
sys.path.insert(0, str(DEMO))
import fill_template  # noqa: E402
from twin import tokenizer_files, tokens  # noqa: E402
from twin.engine import queue_full_message  # noqa: E402
from twin.params import TwinSettings  # noqa: E402


def test_committed_repo_is_the_filled_templates():
    values = fill_template.repo_values(streaming=True)
    for model in fill_template.MODELS:
        committed = (DEMO / "model_repo" / model / "config.pbtxt").read_text()
        assert committed == fill_template.render(model, values), \
            f"{model}: run demo/fill_template.py --repo demo/model_repo"


def test_top_level_fields_are_always_filled():
    for streaming in (True, False):
        values = fill_template.repo_values(streaming)
        for model in fill_template.MODELS:
            text = fill_template.render(model, values)
            for line in text.splitlines():
                if "${" in line:
                    # Only parameters may stay unset; a top-level field would not parse.
                    assert line.startswith("parameters {"), (model, line)


def test_streaming_switch_sets_decoupled_mode():
    assert "decoupled: true" in fill_template.render("tensorrt_llm", fill_template.repo_values(True))
    assert "decoupled: false" in fill_template.render("tensorrt_llm", fill_template.repo_values(False))


def test_fill_in_place_like_nvidia_cli(tmp_path):
    f = tmp_path / "config.pbtxt"
    f.write_text('max_batch_size: ${triton_max_batch_size}\nx: "${left_alone}"\n')
    assert fill_template.main(["-i", str(f), "triton_max_batch_size:8,unused:1"]) == 0
    assert f.read_text() == 'max_batch_size: 8\nx: "${left_alone}"\n'


def test_write_repo_elsewhere_copies_code_and_tokenizer(tmp_path):
    out = fill_template.write_repo(tmp_path / "repo", streaming=False, overrides={"triton_max_batch_size": "2"})
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        assert (out / model / "1" / "model.py").is_file()
        assert (out / model / "1" / "twin" / "engine.py").is_file()
        assert not (out / model / "1" / "twin").is_symlink()
    assert (out / "tensorrt_llm" / "1" / "vocab.py").is_file()
    cfg = (out / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "max_batch_size: 2" in cfg and "decoupled: false" in cfg
    tok = tmp_path / "repo-tokenizer"
    assert (tok / "tokenizer.json").is_file()
    assert f'"tokenizer_dir" value: {{ string_value: "{tok.resolve()}" }}' in cfg


def test_tokenizer_files_are_generated():
    for name, content in tokenizer_files.files().items():
        assert json.loads((DEMO / "tokenizer" / name).read_text()) == content, name


def _config(params, **top):
    cfg = {"max_batch_size": 4, "model_transaction_policy": {"decoupled": True},
           "dynamic_batching": {"default_queue_policy": {"max_queue_size": "3"}},
           "parameters": {k: {"string_value": v} for k, v in params.items()}}
    cfg.update(top)
    return cfg


def test_params_unset_placeholders_fall_back_to_defaults():
    s = TwinSettings(_config({"gpt_model_type": "inflight_fused_batching",
                              "max_tokens_in_paged_kv_cache": "${max_tokens_in_paged_kv_cache}",
                              "enable_kv_cache_reuse": "${enable_kv_cache_reuse}",
                              "exclude_input_in_output": "true", "twin_decode_ms": "7"}), environ={})
    assert (s.engine.max_batch_size, s.engine.max_queue_size) == (4, 3)
    assert s.engine.enable_kv_cache_reuse is True and s.engine.max_tokens_in_paged_kv_cache == 1 << 20
    assert s.exclude_input_in_output is True and s.decoupled is True and s.engine.decode_ms == 7.0
    assert TwinSettings(_config({"gpt_model_type": "V1", "twin_decode_ms": "7"}),
                        environ={"DEMO_TOKEN_DELAY_MS": "3"}).engine.decode_ms == 3.0


def test_engine_queue_limit_of_its_own_overrides_the_queue_policy():
    base = {"gpt_model_type": "inflight_fused_batching", "twin_engine_max_queue_size": "${twin_engine_max_queue_size}"}
    assert TwinSettings(_config(base), environ={}).engine.max_queue_size == 3
    own = TwinSettings(_config({**base, "twin_engine_max_queue_size": "5"},
                               dynamic_batching={"default_queue_policy": {"max_queue_size": "0"}}), environ={})
    assert own.engine.max_queue_size == 5


def test_invalid_gpt_model_type_fails_the_load():
    with pytest.raises(ValueError, match="Invalid gpt_model_type"):
        TwinSettings(_config({"gpt_model_type": "${batching_strategy}"}), environ={})


def test_queue_full_text():
    assert queue_full_message(5) == "Maximum queue size of 5 has been reached, please try again later"


def test_token_space_round_trip():
    ids = tokens.encode("héllo")
    assert all(0 <= i < 256 for i in ids) and tokens.decode(ids) == "héllo"
    gen = tokens.next_tokens(ids, 4)
    assert tokens.decode(ids + gen) == "héllo" + tokens.generate_text("héllo", 4)
    assert tokens.decode([tokens.END_ID]) == "" and tokens.decode([tokens.END_ID], False) == "</s>"
