"""SpecConfig travels whole: one mapping from speculative_* keywords and --speculative-* flags."""

import argparse

import pytest

from tandem.cli import build_parser
from tandem.config import SpecConfig
from tandem.launch_server import add_serve_args, configs_from_args
from tandem.llm import LLM


def test_prefixed_values_map_onto_every_field_and_ignore_the_rest():
    spec = SpecConfig.from_prefixed({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 6,
                                     "speculative_policy": "adaptive", "speculative_ngram_max": 5,
                                     "model": "x", "speculative_unknown": 1})
    assert spec == SpecConfig(algorithm="ngram", num_draft_tokens=6, policy="adaptive", ngram_max=5)
    assert SpecConfig.from_prefixed({}) == SpecConfig()
    assert "speculative_eagle_topk" in SpecConfig.prefixed_names()


def test_generate_flags_become_one_spec_config():
    args = build_parser().parse_args(["generate", "--speculative-algorithm", "eagle3", "--speculative-eagle-topk", "4",
                                      "--speculative-num-steps", "3", "--no-speculative-tree-lookup"])
    assert SpecConfig.from_prefixed(vars(args)) == SpecConfig(algorithm="eagle3", eagle_topk=4, num_steps=3,
                                                              lookup=False)


def test_serve_flags_carry_the_policy_and_the_default_drafter():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    engine, _ = configs_from_args(p.parse_args(["--speculative-policy", "fixed", "--speculative-num-draft-tokens", "3"]))
    assert engine.spec.policy == "fixed" and engine.spec.num_draft_tokens == 3
    assert engine.spec.algorithm is not None  # the bundled model's default drafter
    engine, _ = configs_from_args(p.parse_args(["--speculative-algorithm", "none"]))
    assert engine.spec.algorithm is None


def test_dspark_runs_under_the_confidence_scheduler_unless_told_otherwise():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    engine, _ = configs_from_args(p.parse_args(["--speculative-algorithm", "dspark"]))
    assert engine.spec.policy == "confidence"
    engine, _ = configs_from_args(p.parse_args(["--speculative-algorithm", "dspark", "--speculative-policy", "fixed"]))
    assert engine.spec.policy == "fixed"
    engine, _ = configs_from_args(p.parse_args(["--speculative-algorithm", "eagle3"]))
    assert engine.spec.policy == "adaptive"
    from tandem.flags import drafter_policy

    assert drafter_policy("dspark") == "confidence" and drafter_policy("eagle3") is None and drafter_policy(None) is None


def test_llm_refuses_unknown_or_doubled_speculative_settings():
    # both checks run before any model is loaded
    with pytest.raises(TypeError, match="speculative_num_draft_token"):
        LLM(speculative_num_draft_token=4)
    with pytest.raises(ValueError, match="not both"):
        LLM(spec=SpecConfig(algorithm="ngram"), speculative_policy="adaptive")
    with pytest.raises(TypeError, match="not a parameter of LLM"):
        LLM(enable_prefix_cache=False)


def test_llm_takes_the_engine_settings_of_tandem_serve(monkeypatch):
    """enable_prefix_caching, chunked_prefill_size and max_total_tokens reach the EngineConfig."""
    import tandem.llm as llm_module

    class Stop(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(llm_module, "load_model", load_model)
    llm = LLM.__new__(LLM)
    with pytest.raises(Stop):
        llm.__init__(enable_prefix_caching=False, chunked_prefill_size=0, max_total_tokens=4096)
    assert (llm.config.enable_prefix_caching, llm.config.chunked_prefill_size, llm.config.max_total_tokens) == \
        (False, 0, 4096)


@pytest.mark.parametrize("name", ["none", "off", "OFF"])
def test_none_and_off_are_plain_decoding_in_the_library_too(name):
    """`--speculative-algorithm none` works for every command; the library's keyword takes the same names."""
    assert SpecConfig(algorithm=name).algorithm is None
    assert SpecConfig.from_prefixed({"speculative_algorithm": name}) == SpecConfig()


def test_a_tree_reports_and_reserves_its_nodes_not_its_depth():
    """A tree of 10 nodes, 5 deep, verifies and writes up to 10 draft tokens a round: that is what
    /v1/models and the startup line report and what admission reserves past a request's last token."""
    from tandem.engine.admission import Admission

    tree = SpecConfig(algorithm="eagle3", eagle_topk=3, num_draft_tokens=10)
    chain = SpecConfig(algorithm="eagle3", num_draft_tokens=4, num_steps=3)
    assert (tree.max_draft_len, tree.max_round_tokens) == (5, 10)
    assert (chain.max_draft_len, chain.max_round_tokens) == (3, 3)
    assert tree.describe() == "a tree of up to 10 draft tokens, 5 deep" and chain.describe() == "up to 3 draft tokens"

    class Cache:
        def token_budget(self, fraction, total):
            return 10_000

    from tandem.config import EngineConfig

    assert Admission(Cache(), EngineConfig(spec=tree), True).draft_slots == 10
    assert Admission(Cache(), EngineConfig(spec=chain), True).draft_slots == 3


@pytest.mark.parametrize("settings, message", [
    ({"algorithm": ""}, "speculative_algorithm is empty"),
    ({"algorithm": "ngram", "draft_model_path": "/nonexistent"}, "takes no draft model path"),
    ({"algorithm": "ngram", "num_draft_tokens": "4"}, "speculative_num_draft_tokens must be an integer"),
    ({"algorithm": "eagle3", "num_steps": 2.0}, "speculative_num_steps must be an integer"),
    ({"algorithm": "suffix", "lookup": "no"}, "speculative_lookup must be true or false"),
    ({"algorithm": "dspark", "min_survival": "0.5"}, "speculative_min_survival must be a number"),
    ({"algorithm": 7}, "speculative_algorithm must be a name"),
])
def test_settings_of_the_wrong_kind_or_that_a_drafter_cannot_use_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**settings)


def test_a_json_schema_flag_that_is_neither_a_file_nor_json_says_so(tmp_path):
    from tandem.flags import structured_output_from_args

    args = argparse.Namespace(json_object=False, json_schema=str(tmp_path / "missing.json"), regex=None, choice=None,
                              grammar=None)
    with pytest.raises(ValueError, match="no such file"):
        structured_output_from_args(args)
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    args.json_schema = str(tmp_path / "schema.json")
    assert structured_output_from_args(args).json == '{"type": "object"}'
    args.json_schema = ' {"type": "integer"}'
    assert structured_output_from_args(args).json == ' {"type": "integer"}'


def test_serve_refuses_what_it_would_ignore_and_names_its_flags():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(ValueError, match="no drafter runs"):
        configs_from_args(p.parse_args(["--speculative-algorithm", "none", "--speculative-draft-model-path", "/x"]))
    with pytest.raises(ValueError, match="^--max-running-requests must be >= 1"):
        configs_from_args(p.parse_args(["--max-running-requests", "0"]))
    with pytest.raises(ValueError, match="^--drain-timeout"):
        configs_from_args(p.parse_args(["--drain-timeout", "-1"]))


def test_a_kv_budget_past_every_row_full_is_every_row_full():
    from conftest import tiny_loaded
    from tandem.model.kv_cache import KVCache

    _, loaded = tiny_loaded("llama")
    cache = KVCache(loaded.config, 4, 64, loaded.dtype)
    assert cache.token_budget(0.5, 999_999_999) == 4 * 64 and cache.token_budget(0.5, 100) == 100

