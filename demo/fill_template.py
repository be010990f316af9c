#!/usr/bin/env python3
"""Fill the twin's config.pbtxt templates (demo/templates), as TRT-LLM's own template
step does for its repository.

  fill_template.py -i FILE key:value[,key:value...]     fill ${key} in FILE in place
  fill_template.py --repo OUT [--streaming|--no-streaming] [key:value,...]
                                                         write a whole model repository

--repo fills every template from DEFAULTS (then the given values), copies the model
code (the twin package included, links resolved) and writes the tokenizer directory.
--streaming (the default) sets decoupled_mode:true (generate_stream, gRPC streams);
--no-streaming sets false (plain infer). Placeholders without a value stay as
${...}; in `parameters` that means "unset", as TRT-LLM treats them.
demo/model_repo is `--repo demo/model_repo --streaming` with the defaults;
tests/test_twin_repo.py keeps it so.
"""
import argparse
import shutil
import string
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent
TEMPLATES = DEMO / "templates"
SOURCE_REPO = DEMO / "model_repo"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")

# Values suited to the tests and the demo. The orchestrator's tests rely on
# exclude_input_in_output:true (generate answers only the new text) and on 64 slots.
DEFAULTS = {
    "triton_backend": "python",
    "triton_max_batch_size": "64",
    "decoupled_mode": "true",
    "max_queue_delay_microseconds": "0",
    "max_queue_size": "0",
    "max_beam_width": "1",
    "batching_strategy": "inflight_fused_batching",
    "engine_dir": "twin",
    "max_tokens_in_paged_kv_cache": "65536",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "kv_cache_free_gpu_mem_fraction": "0.9",
    "enable_kv_cache_reuse": "true",
    "exclude_input_in_output": "true",
    "cancellation_check_period_ms": "100",
    "stats_check_period_ms": "100",
    "iter_stats_max_iterations": "1000",
    "request_stats_max_iterations": "0",
    "normalize_log_probs": "true",
    "enable_chunked_context": "false",
    "logits_datatype": "TYPE_FP32",
    "encoder_input_features_data_type": "TYPE_FP16",
    "prompt_embedding_table_data_type": "TYPE_FP16",
    "tokenizer_dir": "demo/tokenizer",
    "add_special_tokens": "false",
    "skip_special_tokens": "true",
    "preprocessing_instance_count": "1",
    "postprocessing_instance_count": "1",
    "bls_instance_count": "1",
    "accumulate_tokens": "false",
    "tensorrt_llm_model_name": "tensorrt_llm",
    "twin_decode_ms": "20",
    "twin_prefill_ms_per_token": "0.05",
    "twin_tokens_per_block": "64",
    "twin_engine_max_batch_size": "${twin_engine_max_batch_size}",
    "twin_engine_load_time_s": "0",
    "twin_engine_max_queue_size": "${twin_engine_max_queue_size}",
}


def parse_pairs(text):
    """'a:1,b:x' -> {'a': '1', 'b': 'x'} (a value may itself contain ':')."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition(":")
        if not sep or not key:
            raise SystemExit(f"fill_template: bad key:value pair {item!r}")
        out[key.strip()] = value
    return out


def fill_text(text, values):
    return string.Template(text).safe_substitute(values)


def fill_file(path, values):
    p = Path(path)
    p.write_text(fill_text(p.read_text(), values))


def render(model, values):
    return fill_text((TEMPLATES / model / "config.pbtxt").read_text(), values)


def repo_values(streaming=True, overrides=None):
    values = dict(DEFAULTS)
    values["decoupled_mode"] = "true" if streaming else "false"
    values.update(overrides or {})
    return values


def write_repo(out, streaming=True, overrides=None):
    out = Path(out)
    separate = out.resolve() != SOURCE_REPO.resolve()
    tokenizer_dir = out.parent / (out.name + "-tokenizer")
    overrides = dict(overrides or {})
    if separate:
        # Beside the repository, not in it: Triton would take any directory in it for a model.
        overrides.setdefault("tokenizer_dir", str(tokenizer_dir.resolve()))
    values = repo_values(streaming, overrides)
    for model in MODELS:
        version = out / model / "1"
        version.mkdir(parents=True, exist_ok=True)
        (out / model / "config.pbtxt").write_text(render(model, values))
        src = SOURCE_REPO / model / "1"
        if not separate:
            continue   # the source repository keeps its code and `twin` links
        for f in src.glob("*.py"):
            shutil.copy2(f, version / f.name)
        if (src / "twin").exists():
            shutil.copytree(DEMO / "twin", version / "twin", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
    if separate:
        sys.path.insert(0, str(DEMO))
        from twin import tokenizer_files
        tokenizer_files.write(tokenizer_dir)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", dest="file", help="template file to fill in place")
    ap.add_argument("--repo", help="write a whole repository here")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--streaming", dest="streaming", action="store_true", default=True)
    mode.add_argument("--no-streaming", dest="streaming", action="store_false")
    ap.add_argument("values", nargs="?", default="", help="key:value[,key:value...]")
    args = ap.parse_args(argv)
    if bool(args.file) == bool(args.repo):
        ap.error("give exactly one of -i FILE or --repo DIR")
    values = parse_pairs(args.values)
    if args.file:
        fill_file(args.file, values)
    else:
        out = write_repo(args.repo, args.streaming, values)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
