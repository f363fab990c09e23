"""`tandem bench spec`: the core on tiny random models (report structure, Spec-Bench ratio definitions,
greedy identity, draft accounting), method parsing, and the whole command end to end on tiny model
directories (valid JSON and PNG plots)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from conftest import build_tiny, tiny_hf_config, tiny_loaded
from tandem.bench.draft_profile import DraftProfile
from tandem.bench.spec import OVERALL, Method, SpecCase, machine_line, parse_methods, run_spec_bench
from tandem.bench.spec_hf import Baselines
from tandem.bench.spec_report import print_identity, print_table

pytestmark = pytest.mark.usefixtures("one_thread")

# Repetitive prompts so n-gram / suffix drafts get matched (and sometimes accepted) on a random model.
CASES = [
    SpecCase("summarization", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 1),
    SpecCase("summarization", [10, 11, 12, 10, 11, 12, 10, 11], 2),
    SpecCase("qa", [30, 31, 30, 31, 30, 31], 3),
]
METHODS = [Method("ngram"), Method("suffix")]
LABELS = [m.label for m in METHODS]


@pytest.fixture(scope="module")
def report():
    hf, loaded = tiny_loaded("llama")
    assistant, _ = tiny_loaded("qwen2", 1)  # same vocabulary, unrelated weights
    baselines = Baselines(hf, pld_tokens=4, assistant=assistant, assistant_name="tiny-qwen2")
    return run_spec_bench(loaded, CASES, methods=METHODS, num_draft_tokens=3, max_new_tokens=16,
                          baselines=baselines, warmup_ids=[40, 41, 42], progress=False)


def test_report_structure(report):
    assert list(report["categories"]) == ["summarization", "qa", OVERALL]
    assert report["categories"][OVERALL]["num_prompts"] == len(CASES)
    assert [m["label"] for m in report["methods"]] == LABELS and len(report["prompts"]) == len(CASES)
    assert set(report["categories"][OVERALL]["transformers"]) == {"plain", "prompt_lookup", "assisted"}
    assert report["transformers"]["assisted"]["applicable"] is True
    assert "tau" in report["definitions"] and "acceptance_rate" in report["definitions"]
    json.loads(json.dumps(report))  # the --json file


def test_tokens_per_second_is_the_mean_of_per_prompt_rates(report):
    """Spec-Bench's definition: mean over prompts of tokens/seconds, speedup = ratio of those means."""
    prompts = report["prompts"]
    for cat, row in report["categories"].items():
        idx = [i for i, p in enumerate(prompts) if cat == OVERALL or p["category"] == cat]
        for engine, rows in (("tandem", row["tandem"]), ("transformers", row["transformers"])):
            for name, r in rows.items():
                key = f"{engine} {name}"
                rates = [prompts[i]["generated"][key] / prompts[i]["seconds"][key] for i in idx]
                assert r["tokens_per_second"] == pytest.approx(statistics.fmean(rates), rel=1e-2)
        plain = row["tandem"]["plain"]
        for name in LABELS:
            assert row["tandem"][name]["speedup"] == pytest.approx(row["tandem"][name]["tokens_per_second"] / plain["tokens_per_second"])
        hf = row["transformers"]
        for name in ("prompt_lookup", "assisted"):
            assert hf[name]["speedup"] == pytest.approx(hf[name]["tokens_per_second"] / hf["plain"]["tokens_per_second"])


def test_spec_stats(report):
    for row in report["categories"].values():
        plain = row["tandem"]["plain"]
        assert plain["tau"] == pytest.approx(1.0)  # plain decoding commits one token per forward
        for m in LABELS:
            r = row["tandem"][m]
            assert r["tau"] >= 1.0 and 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["tokens"] == plain["tokens"]  # identical greedy output -> identical counts
            assert all(0.0 <= a <= 1.0 for a in r["acceptance_per_position"] + r["drafted_acceptance"])
    # The overall row aggregates the subtasks' counters, not their ratios.
    for m in LABELS:
        for key in ("num_draft_tokens", "num_accepted_tokens"):
            total = sum(report["categories"][c]["tandem"][m]["spec"][key] for c in ("summarization", "qa"))
            assert report["categories"][OVERALL]["tandem"][m]["spec"][key] == total
    assert any(report["categories"][OVERALL]["tandem"][m]["spec"]["num_accepted_tokens"] > 0 for m in LABELS)


def test_draft_accounting_matches_the_engine_counters(report):
    """The probe around the drafter sees the same accepted tokens as SpecStats, and each position's
    drafted acceptance is passed / reached with passed[i] = reached[i + 1] (worked chain rule)."""
    for m in LABELS:
        r = report["categories"][OVERALL]["tandem"][m]
        d = r["draft"]
        assert sum(d["passed_per_position"]) == r["spec"]["num_accepted_tokens"]
        assert sum(n * c for n, c in enumerate(d["drafted_lengths"])) == r["spec"]["num_draft_tokens"]
        reached, passed = d["reached_per_position"], d["passed_per_position"]
        assert all(p <= q for p, q in zip(passed, reached))
        assert all(passed[i] >= reached[i + 1] for i in range(len(reached) - 1))
        assert r["draft_seconds"] > 0


def test_draft_profile_record_and_merge():
    a = DraftProfile()
    a.record(budget=4, drafted=4, accepted=2)  # positions 0, 1, 2 reached; 0, 1 passed
    a.record(budget=2, drafted=2, accepted=2)  # both reached and passed (the bonus token is not a position)
    a.record(budget=3, drafted=0, accepted=0)  # only position 0 reached (an empty draft fails there)
    assert a.reached == [3, 2, 1, 0] and a.passed == [2, 2, 0, 0] and a.lengths == [1, 0, 1, 0, 1]
    assert a.acceptance() == pytest.approx([2 / 3, 1.0, 0.0, 0.0])
    assert a.acceptance(6)[4:] == [0.0, 0.0]
    b = DraftProfile()
    b.record(budget=1, drafted=1, accepted=1)
    b.seconds = 0.5
    a.merge(b)
    assert a.reached == [4, 2, 1, 0] and a.passed == [3, 2, 0, 0] and a.rounds == 4 and a.requested == 10
    assert a.lengths == [1, 1, 1, 0, 1]
    assert a.seconds_per_position == pytest.approx(0.05)


def test_greedy_identity(report):
    for m in LABELS:
        assert report["identity"][m]["mismatches"] == 0, report["identity"][m]["details"]
    for name, v in report["identity_transformers"].items():
        assert v["mismatches"] == 0, (name, v["details"])


def test_sampling_run_is_seeded_and_skips_identity():
    _, loaded = tiny_loaded("llama")
    runs = [run_spec_bench(loaded, CASES[:2], methods=METHODS[:1], num_draft_tokens=3, max_new_tokens=12,
                           temperature=0.9, seed=seed, warmup_ids=[40, 41, 42], progress=False) for seed in (7, 7, 8)]
    assert runs[0]["identity"] is None and runs[0]["temperature"] == 0.9
    stats = [r["categories"][OVERALL]["tandem"]["ngram"]["spec"] for r in runs]
    assert stats[0] == stats[1]  # same seed: same draws, same acceptance counters
    assert [p["generated"] for p in runs[0]["prompts"]] == [p["generated"] for p in runs[1]["prompts"]]


def test_printing(report, capsys):
    print_table(report)
    print_identity(report)
    out = capsys.readouterr().out
    assert "summarization" in out and OVERALL in out and "ngram 0/3" in out and "hf assisted" in out


def split_by_subtask(report: dict) -> list[dict]:
    """The report as the per-subtask runs `--categories` would have written (a one-subtask run's
    overall row is its subtask row)."""
    parts = []
    for cat in (c for c in report["categories"] if c != OVERALL):
        idx = [i for i, p in enumerate(report["prompts"]) if p["category"] == cat]
        part = {k: v for k, v in report.items() if k not in ("categories", "prompts", "identity", "identity_transformers")}
        part.update(num_prompts=len(idx), categories={cat: report["categories"][cat], OVERALL: report["categories"][cat]},
                    prompts=[report["prompts"][i] for i in idx])
        for key in ("identity", "identity_transformers"):
            part[key] = {name: {"mismatches": sum(d["category"] == cat for d in v["details"]), "prompts": len(idx),
                                "details": [{**d, "index": idx.index(d["index"])} for d in v["details"] if d["category"] == cat]}
                         for name, v in report[key].items()}
        parts.append(json.loads(json.dumps(part)))  # as read back from the --json files
    return parts


@pytest.mark.parametrize("older_reports", [False, True])
def test_merging_subtask_runs_reproduces_the_overall_row(report, older_reports):
    from tandem.bench.spec_merge import merge_spec_reports

    parts = split_by_subtask(report)
    assert len(parts) == 2
    if older_reports:  # written before the counters carried num_committed_tokens
        for part in parts:
            for row in part["categories"][OVERALL]["tandem"].values():
                del row["spec"]["num_committed_tokens"]
    merged = merge_spec_reports(parts)
    assert list(merged["categories"]) == ["summarization", "qa", OVERALL]
    assert merged["num_prompts"] == len(CASES) and merged["prompts"] == report["prompts"]
    want, got = report["categories"][OVERALL], merged["categories"][OVERALL]
    for side in ("tandem", "transformers"):
        assert list(got[side]) == list(want[side])
        for name, w in want[side].items():
            g = got[side][name]
            assert g["tokens"] == w["tokens"]
            assert g["tokens_per_second"] == pytest.approx(w["tokens_per_second"], rel=1e-2)  # seconds are stored rounded
            if "speedup" in w:
                assert g["speedup"] == pytest.approx(w["speedup"], rel=2e-2)
            if "spec" in w:
                assert g["tau"] == pytest.approx(w["tau"]) and g["acceptance_rate"] == pytest.approx(w["acceptance_rate"])
                assert g["acceptance_per_position"] == pytest.approx(w["acceptance_per_position"])
                assert g["accepted_per_position"] == w["accepted_per_position"]
            if "draft" in w:
                assert g["drafted_acceptance"] == pytest.approx(w["drafted_acceptance"])
                assert {k: v for k, v in g["draft"].items() if k != "seconds"} == \
                    {k: v for k, v in w["draft"].items() if k != "seconds"}
    assert got["transformers"]["plain"]["vs_tandem_plain"] == pytest.approx(
        want["transformers"]["plain"]["vs_tandem_plain"], rel=2e-2)
    for key in ("identity", "identity_transformers"):
        assert {n: (v["mismatches"], v["prompts"]) for n, v in merged[key].items()} == \
            {n: (v["mismatches"], v["prompts"]) for n, v in report[key].items()}
    assert [m["subtasks"] for m in merged["merged_from"]] == [["summarization"], ["qa"]]


def test_merge_rejects_overlapping_or_different_runs(report):
    from tandem.bench.spec_merge import merge_spec_reports

    a, b = split_by_subtask(report)
    with pytest.raises(ValueError, match="summarization is in both"):
        merge_spec_reports([a, a], ["a.json", "again.json"])
    with pytest.raises(ValueError, match="num_draft_tokens differs"):
        merge_spec_reports([a, {**b, "num_draft_tokens": 7}])
    fewer = json.loads(json.dumps(b))
    del fewer["categories"][OVERALL]["tandem"]["suffix"]
    with pytest.raises(ValueError, match="different configurations"):
        merge_spec_reports([a, fewer])
    with pytest.raises(ValueError, match="no overall row"):
        merge_spec_reports([a, {**b, "categories": {}}])
    with pytest.raises(ValueError, match="no reports"):
        merge_spec_reports([])
    # The merged figures carry one machine: parts from another CPU or thread count are refused ...
    for key, value in (("cpu", "Intel Xeon"), ("torch_threads", 7)):
        with pytest.raises(ValueError, match=f"different machines or settings \\({key}"):
            merge_spec_reports([a, {**b, "machine": {**b["machine"], key: value}}])
    # ... and the noisiest sitting's steal is the merge's
    merged = merge_spec_reports([{**a, "machine": {**a["machine"], "steal": 0.01}},
                                 {**b, "machine": {**b["machine"], "steal": 0.05}}])
    assert merged["machine"]["steal"] == 0.05


def test_spec_merge_command(report, tmp_path, capsys):
    from tandem.cli import main

    files = []
    for i, part in enumerate(split_by_subtask(report)):
        files.append(tmp_path / f"part{i}.json")
        files[-1].write_text(json.dumps(part))
    out_json, plots = tmp_path / "merged.json", tmp_path / "plots"
    # Named out of order (qa before summarization): merged in Spec-Bench's subtask order.
    assert main(["bench", "spec-merge", *map(str, files[::-1]), "--json", str(out_json), "--plots", str(plots)]) == 0
    merged = json.loads(out_json.read_text())
    assert merged["categories"][OVERALL]["num_prompts"] == len(CASES)
    assert list(merged["categories"]) == ["summarization", "qa", OVERALL]
    assert sorted(p.name for p in plots.iterdir()) == ["acceptance_per_position.png", "speedup_by_subtask.png",
                                                         "tau_vs_draft_length.png"]
    out = capsys.readouterr().out
    assert "merged 2 reports" in out and "greedy identity" in out
    assert main(["bench", "spec-merge", str(tmp_path / "missing.json"), "--json", ""]) == 2
    assert "no such report" in capsys.readouterr().err
    part = files[0].read_text()
    assert main(["bench", "spec-merge", *map(str, files), "--json", str(files[0]), "--plots", ""]) == 2
    assert "is one of the command's input files" in capsys.readouterr().err and files[0].read_text() == part


def test_parse_methods():
    assert parse_methods(["ngram,suffix", "draft_model=/x/tiny-draft"]) == [
        Method("ngram"), Method("suffix"), Method("draft_model", "/x/tiny-draft")]
    assert Method("draft_model", "/x/tiny-draft/").label == "draft_model(tiny-draft)"
    with pytest.raises(ValueError, match="unknown drafter 'nope'.*registered: .*ngram"):
        parse_methods(["ngram,nope"])
    with pytest.raises(ValueError, match="twice"):
        parse_methods(["ngram", "ngram"])
    with pytest.raises(ValueError, match="empty"):
        parse_methods([","])
    # Tree and length options, so a chain and trees of one drafter run side by side.
    chain, tree, bare = parse_methods(["eagle3@k=4,eagle3@k=16@topk=4@steps=6@lookup=0", "eagle3"])
    assert chain == Method("eagle3", num_draft_tokens=4) and chain.label == "eagle3@k=4"
    assert tree == Method("eagle3", None, 16, 4, 6, False) and tree.label == "eagle3@k=16@topk=4@steps=6@lookup=0"
    assert bare.label == "eagle3"
    # The suffix corpus on and off side by side, each reaching the engine's settings.
    with_corpus, without = parse_methods(["suffix", "suffix@corpus=0"])
    assert with_corpus.spec_config(4).corpus and not without.spec_config(4).corpus
    assert without.label == "suffix@corpus=0"
    # The three policies side by side: the fixed length, the adaptive policy, the confidence scheduler.
    fixed, adaptive, scheduled = parse_methods(["suffix", "suffix@adaptive=1", "dspark@sched=1"])
    assert [m.spec_config(4).policy for m in (fixed, adaptive, scheduled)] == ["fixed", "adaptive", "confidence"]
    assert adaptive.label == "suffix@adaptive=1"
    with pytest.raises(ValueError, match="two policies"):
        parse_methods(["dspark@sched=1@adaptive=1"])
    with pytest.raises(ValueError, match="bad option 'depth=3'"):
        parse_methods(["eagle3@depth=3"])
    # The flag the items came from is what the errors name, after other options too (advise's --drafters).
    with pytest.raises(ValueError, match="in --drafters item"):
        parse_methods(["suffix@lookup=0@depth=3"], "--drafters")
    with pytest.raises(ValueError, match="bad option 'topk=x'"):
        parse_methods(["eagle3@topk=x"])
    # 0 is no draft length (it used to run the default k under a k=0 label), 2 no switch
    with pytest.raises(ValueError, match="@k takes a number of at least 1"):
        parse_methods(["ngram@k=0"])
    with pytest.raises(ValueError, match="@sched takes 0 or 1"):
        parse_methods(["dspark@sched=2"])


# ---- the command end to end, on tiny model directories with a real tokenizer ------------------------


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from tandem.model.catalogue import ModelNotFoundError, resolve_model
    from tandem.model.loader import _ensure_gguf_metadata

    try:
        src = resolve_model("smollm2-135m-instruct")
    except ModelNotFoundError as err:
        pytest.skip(f"needs the bundled SmolLM2 tokenizer: {err}")
    _ensure_gguf_metadata(src)
    return AutoTokenizer.from_pretrained(str(src.hf_dir))


def save_tiny_family(root: Path, target_layers: int = 4) -> dict[str, str]:
    """Tiny HF model directories sharing SmolLM2's tokenizer (49152 tokens):

    target: `target_layers` layers, of which all but the first add nothing (zero attention and MLP
            output projections), so its logits are those of its first layer alone;
    early:  that first layer alone: the same greedy tokens as the target at a fraction of the cost,
            a draft model with controlled (full) agreement;
    other:  an unrelated one-layer model: a draft model that almost never agrees.
    """
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer()
    shape = dict(vocab_size=len(tok), max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    hf, _ = build_tiny("llama", seed=0, num_hidden_layers=target_layers, **shape)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    early = AutoModelForCausalLM.from_config(tiny_hf_config("llama", num_hidden_layers=1, **shape))
    kept = {k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    early.load_state_dict(kept, strict=True)
    other, _ = build_tiny("llama", seed=5, num_hidden_layers=1, **shape)
    dirs = {}
    for name, model in (("target", hf), ("early", early), ("other", other)):
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    return dirs


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return save_tiny_family(tmp_path_factory.mktemp("tiny_models"))


def test_tiny_family_agreement(tiny_dirs):
    """The premise of the advisor's test: `early` reproduces the target's logits, `other` does not."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 200, 3000, 45, 9000, 12]])
    logits = {n: AutoModelForCausalLM.from_pretrained(d)(ids).logits for n, d in tiny_dirs.items()}
    torch.testing.assert_close(logits["early"], logits["target"], atol=1e-4, rtol=1e-4)
    assert (logits["other"].argmax(-1) != logits["target"].argmax(-1)).float().mean() > 0.5


def test_bench_spec_command_writes_json_and_plots(tiny_dirs, tmp_path, capsys, monkeypatch):
    from tandem.cli import main
    from tandem.drafters import registry

    # Other test modules register scripted drafters; the default method list is about the real ones.
    monkeypatch.setattr(registry, "METHODS", {k: v for k, v in registry.METHODS.items() if not k.startswith("test_")})

    out_json, plots = tmp_path / "spec.json", tmp_path / "plots"
    rc = main(["bench", "spec", "--model", tiny_dirs["target"], "--limit", "2", "--max-new-tokens", "8",
               "--hf-assistant", tiny_dirs["early"], "--json", str(out_json), "--plots", str(plots), "--threads", "1"])
    assert rc == 0  # greedy identity held for every method
    report = json.loads(out_json.read_text())
    # The default methods: every registered drafter that needs no files; the others say why not.
    labels = [m["label"] for m in report["methods"]]
    assert "ngram" in labels and "suffix" in labels
    assert "draft_model_path" in report["skipped_methods"]["draft_model"]
    assert report["categories"][OVERALL]["num_prompts"] == 12 == 2 * (len(report["categories"]) - 1)
    assert report["transformers"]["assisted"]["applicable"] and report["identity_transformers"]["assisted"]["mismatches"] == 0
    assert sorted(int(n) for n in report["cost_curve"]) == [1, 2, 4, 8, 16, 32, 64]
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["acceptance_per_position.png", "cost_curve.png", "speedup_by_subtask.png", "tau_vs_draft_length.png"]
    for p in plots.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert "greedy identity" in capsys.readouterr().out


def test_assistant_not_applicable_is_explained():
    from tandem.bench.spec_hf import pick_assistant

    smollm2_tokenizer()
    name, why = pick_assistant("smollm2-135m-instruct", "auto")
    assert name is None and "no built-in model is smaller" in why
    assert pick_assistant("smollm2-135m-instruct", "none") == (None, "disabled with --hf-assistant none")
    assert pick_assistant("/some/model", "/some/assistant") == ("/some/assistant", "")


def test_every_plot_names_its_machine(report, monkeypatch):
    """The figures of a report carry its machine line at their foot, as its tables do."""
    pytest.importorskip("matplotlib")
    from tandem.bench import plots

    stamped = []
    real = plots.stamp_machine

    def recording(fig, machine):
        real(fig, machine)
        stamped.append([t.get_text() for t in fig.texts])

    monkeypatch.setattr(plots, "stamp_machine", recording)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        paths = plots.plot_spec_report(report, d)
    assert len(stamped) == len(paths) >= 3
    assert all(texts == [machine_line(report["machine"])] for texts in stamped)
    assert machine_line(report["machine"]).startswith("CPU: ")
