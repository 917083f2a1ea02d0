"""YAML run configs: parsing errors name the key or value; every mode runs through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import tinyloop as tl
from tinyloop.cli.main import main
from tinyloop.runtime.config import load_run_config
from tinyloop.models import demo_model_path
from tinyloop.model.tokenizer import resolve_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


@pytest.mark.parametrize("data,match", [
    ({"prompts": ["x"], "bogus": 1}, "unknown key 'bogus' in run config"),
    ({"prompts": ["x"], "generate": {"temprature": 0.5}}, "unknown key 'temprature' in generate"),
    ({"prompts": ["x"], "generate": {"top_p": 2.0}}, r"top_p=2.0 is outside the allowed range \(0, 1\]"),
    ({"prompts": ["x"], "mode": "beam"}, "mode='beam' is not one of generate, batch, speculative, tree_speculative"),
    ({"prompts": ["x"], "mode": "tree_speculative", "speculative": {"K_branch": 2}}, "unknown key 'K_branch'"),
    ({"prompts": ["x"], "mode": "speculative", "speculative": {"K_branches": 2}}, "unknown key 'K_branches'"),
    ({"prompts": ["x"], "mode": "speculative"}, "needs a `speculative:` section"),
    ({"prompts": ["x"], "speculative": {"draft_loops": 1}}, "only used with mode: speculative"),
    ({"prompts": ["x"], "mode": "speculative", "speculative": {"draft_ahed": 3}}, "unknown key 'draft_ahed'"),
    ({"prompts": ["x"], "mode": "speculative", "speculative": {"draft_loops": 1}, "generate": {"temperature": 0.7}},
     r"`generate:` section would be ignored \(it sets temperature\)"),
    ({"prompts": ["x"], "generate": {"decoder": "speculative", "options": [1]}}, "options must be a mapping"),
    ({"prompts": "x"}, "prompts must be a list of strings"),
    ({"prompts": ["x"], "backend": "tpu"}, "backend='tpu'"),
])
def test_run_config_errors(tmp_path, data, match):
    with pytest.raises(tl.ConfigError, match=match):
        load_run_config(write(tmp_path, data))


def test_shipped_configs_parse():
    from tinyloop.serve import load_serve_config
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        if p.name == "serve.yaml":
            load_serve_config(str(p))          # the server's config, not a run config
        elif p.name != "compat.yaml":
            load_run_config(str(p))


SPEC = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 3}


@pytest.mark.parametrize("section", [
    {"mode": "speculative", "speculative": {"max_tokens": 24, **SPEC}},
    {"mode": "tree_speculative", "speculative": {"max_tokens": 24, "K_branches": 3, **SPEC}},
    # the same decoders as a generate section with the decoder's options
    {"generate": {"max_tokens": 24, "decoder": "speculative", "options": SPEC}},
    {"generate": {"max_tokens": 24, "decoder": "tree_speculative", "options": {"K_branches": 3, **SPEC}}},
])
def test_speculative_mode_equals_greedy(tmp_path, section):
    out = tmp_path / "o.jsonl"
    path = write(tmp_path, {"backend": "cpu", "max_seq_len": 256, "prompts": ["def fibonacci(n):"],
                            "stream": False, "output_jsonl": str(out), **section})
    if "generate" in section:
        assert dict(load_run_config(path).generate.options) == section["generate"]["options"]
    assert main(["run", path]) == 0
    rec = json.loads(out.read_text().splitlines()[0])
    m = tl.load_model(demo_model_path(), max_seq_len=256, backend="cpu")
    try:
        ids = resolve_tokenizer(m.header.tokenizer, None, m.vocab_size).encode("def fibonacci(n):")
        assert rec["prompt_ids"] == ids
        assert rec["output_ids"] == tl.generate(m, ids, tl.GenerateConfig(max_tokens=24, loops=6))[len(ids):]
        assert rec["stats"]["verify_forwards"] >= 1
    finally:
        tl.free_model(m)


def test_batch_mode(tmp_path):
    out = tmp_path / "o.jsonl"
    path = write(tmp_path, {"backend": "cpu", "max_seq_len": 128, "prompts": ["import os", "x = 1"],
                            "mode": "batch", "output_jsonl": str(out), "generate": {"max_tokens": 5}})
    assert main(["run", path]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == ["import os", "x = 1"]
    assert all(1 <= len(r["output_ids"]) <= 5 for r in recs)
